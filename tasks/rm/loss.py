"""The reward model's loss: a small pure tensor function (STYLE 7)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PairwiseLoss(NamedTuple):
    loss: torch.Tensor         # () mean -log sigmoid(r_c - r_r - m)
    accuracy: torch.Tensor     # () share of pairs with r_c > r_r (ties count as wrong)
    margin_mean: torch.Tensor  # () mean of r_c - r_r


def pairwise_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float | torch.Tensor = 0.0) -> PairwiseLoss:
    """Bradley-Terry pairwise loss of scalar rewards, with an optional margin m.

        loss     = mean_i -log sigmoid(r_c[i] - r_r[i] - m[i])
        accuracy = mean_i 1[r_c[i] > r_r[i]]
        margin   = mean_i (r_c[i] - r_r[i])

    r_chosen, r_rejected: (B,) rewards of the preferred and the other sequence of each pair;
    margin: a float or (B,) (Llama 2's margin loss). ``logsigmoid`` keeps it finite for large
    differences. accuracy and margin_mean are detached statistics.
    """
    diff = r_chosen.float() - r_rejected.float()
    loss = -F.logsigmoid(diff - margin).mean()
    diff = diff.detach()
    return PairwiseLoss(loss, (diff > 0).float().mean(), diff.mean())
