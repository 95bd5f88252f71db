"""No work on padding: the columns of a PPO batch that no row attends are cut before a forward.

A rollout batch is ``[left-padded prompts | responses]`` (B, L) with the last N columns the
actions. Two kinds of columns hold no token of any row: the leading ones (every prompt is shorter
than the longest in the whole rollout, e.g. a minibatch of short prompts) and the trailing ones
(every row of the batch stopped before the last step). Every forward of the learners and scorers
(policy / reference log-probs, values, rewards) then runs on the attended span only, and the
per-action outputs are padded back to N columns with zeros, where the action mask is 0 anyway.

Cutting only whole columns keeps each kept token's position (positions come from the mask's
cumulative sum) and the attention over the kept tokens (the cut columns were masked keys), so the
outputs equal the uncut forward's up to summation order. The kept width is rounded up to a
multiple of ``multiple`` (by cutting less on the left) so compiled blocks see few shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

MULTIPLE = 16


class Span(NamedTuple):
    start: int        # first kept column
    stop: int         # one past the last kept column
    actions: int      # action columns kept (the first ``actions`` of the N)
    num_actions: int  # N


def attended_span(attention_mask: Tensor, num_actions: int, multiple: int = MULTIPLE) -> Span:
    """The columns ``[start, stop)`` of ``attention_mask`` (B, L) that any row attends, widened to
    keep the position that predicts the first action and a width that is a multiple of ``multiple``."""
    B, L = attention_mask.shape
    N = num_actions
    if not 0 < N < L:
        raise ValueError(f"attended_span: num_actions ({N}) must be in 1..{L - 1} for {L} columns")
    used = attention_mask.bool().any(0)
    idx = used.nonzero().flatten()
    if idx.numel() == 0:
        return Span(0, L, N, N)
    prompt_end = L - N
    start = min(int(idx[0]), prompt_end - 1)  # the last prompt column predicts the first action
    stop = max(int(idx[-1]) + 1, prompt_end + 1)  # at least one action column
    width = -(-(stop - start) // multiple) * multiple
    if width > stop - start:  # widen to the left first (more prompt padding), then to the right
        start = max(0, stop - width)
        stop = min(L, start + width)
    return Span(start, stop, stop - prompt_end, N)


def cut(t: Tensor, span: Span) -> Tensor:
    """The span's columns of a (B, L, ...) tensor."""
    return t[:, span.start:span.stop]


def pad_actions(x: Tensor, span: Span) -> Tensor:
    """Per-action outputs (B, kept, ...) back to (B, N, ...) with zeros after the kept actions."""
    missing = span.num_actions - span.actions
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], missing, *x.shape[2:]))], dim=1)
