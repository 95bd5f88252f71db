"""The SFT loss: a small pure tensor function (STYLE 7)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class LMLoss(NamedTuple):
    loss: torch.Tensor      # () mean NLL over label tokens
    nll_sum: torch.Tensor   # () summed NLL over label tokens
    n_tokens: torch.Tensor  # () number of label tokens (long)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> LMLoss:
    """Next-token NLL averaged over label tokens that are not ``-100``.

        loss = sum_{b,t: y[b,t+1] != -100} -log softmax(logits[b,t])[y[b,t+1]] / #{label tokens}

    logits: (B, T, V) float; labels: (B, T) long, -100 on prompt and padding tokens (data prep
    masks prompts, ``collate_lm`` masks padding). Position t predicts label t+1. The sum and the
    count come back too, so callers can average over a whole accumulation window or all ranks
    instead of averaging micro-batch means. An all-masked batch gives loss 0, not NaN.
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    n = (shift_labels != IGNORE_INDEX).sum()
    return LMLoss(nll / n.clamp(min=1), nll, n)
