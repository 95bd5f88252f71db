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
multiple of ``multiple`` (by cutting less on the left) so compiled blocks see few shapes. What
a minibatch can cut depends on its rows: ``length_order`` (ppo.bucket_by_length) puts rows of
similar length into one.

The same two facts let one forward score several chunks (``score_together``): chunks of
different widths (prompts left-padded per generating worker) are left-padded to the widest with
columns no row attends and concatenated along rows, and every output where the action mask is 1
equals the chunk's own forward's up to summation order (after a row's stop, where it is 0, a
column cut for the chunk alone may be computed in the fused batch).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
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


def length_order(attention_mask: Tensor, num_actions: int, chunk_rows: int, group: int = 1) -> Tensor:
    """A permutation (B,) of the rows of ``attention_mask`` (B, L) such that its consecutive
    minibatches of ``chunk_rows`` rows compute fewer columns (``attended_span``): a minibatch's
    width is its longest prompt plus its longest response, so rows of similar lengths go together.
    Of the orders by response length, by prompt length, by their sum and by the larger of their
    shares of the columns (each longest first, stable), and the rollout order itself, the one whose
    minibatches compute the fewest columns. The ``group`` consecutive rows of a group
    (n_samples_per_prompt) move as one, keyed by their longest row."""
    B, L = attention_mask.shape
    P = L - num_actions
    response, prompt = attention_mask[:, P:].sum(1), attention_mask[:, :P].sum(1)

    def by(key: Tensor) -> Tensor:
        groups = torch.sort(key.view(B // group, group).amax(1), descending=True, stable=True).indices
        return (groups[:, None] * group + torch.arange(group)).flatten()

    def columns(order: Tensor) -> int:
        return sum(s.stop - s.start for s in (attended_span(c, num_actions) for c in attention_mask[order].split(chunk_rows)))

    orders = [torch.arange(B), *(by(k) for k in (response, prompt, response + prompt,
                                                 torch.maximum(response / num_actions, prompt / max(P, 1))))]
    return min(orders, key=columns)


def logit_rows(chunk_rows: int, max_new_tokens: int, vocab_size: int) -> int:
    """Rows per forward of the actor's / reference's scoring (``score_together``): its fp32
    logits of the action columns (rows x max_new_tokens x vocab_size) kept to 2**28 numbers
    (1 GiB), rounded down to a multiple of ``chunk_rows`` (whole chunks) and at least one chunk.
    From config values only, so every rank of a sharded strategy runs the same forwards."""
    return max(chunk_rows, 2**28 // (max_new_tokens * vocab_size) // chunk_rows * chunk_rows)


def score_together(fn: Callable, rollouts: Sequence, rows: int | None = None) -> list:
    """``fn`` (Rollout -> Tensor or tuple of Tensors, batch first) on every rollout chunk, in as
    few calls as fit: consecutive whole chunks, up to ``rows`` rows a call (None: all; a chunk is
    never split, so a call has at least one), fused by ``left_pad_cat``. Chunks (B_j, L_j) share
    N = action_mask.shape[1]. Returns fn's outputs per chunk, in order, each (B_j, ...) and a copy
    of its own (a view would carry the whole batch's storage through Ray)."""
    groups = []
    for ro in rollouts:
        if groups and (rows is None or sum(len(r.sequences) for r in groups[-1]) + len(ro.sequences) <= rows):
            groups[-1].append(ro)
        else:
            groups.append([ro])
    out = []
    for group in groups:
        y = fn(left_pad_cat(group))
        sizes = [len(r.sequences) for r in group]
        if isinstance(y, tuple):
            out += [tuple(t.clone() for t in ts) for ts in zip(*(t.split(sizes) for t in y))]
        else:
            out += [t.clone() for t in y.split(sizes)]
    return out


def left_pad_cat(rollouts: Sequence):
    """Rollout chunks (B_j, L_j) as one Rollout (sum B_j, max L_j): sequences and attention mask
    left-padded with 0 (columns no row attends), the action mask (B_j, N) and ended_with_eos
    concatenated."""
    L = max(r.sequences.shape[1] for r in rollouts)
    wide = lambda t: F.pad(t, (L - t.shape[1], 0))  # noqa: E731
    return type(rollouts[0])(sequences=torch.cat([wide(r.sequences) for r in rollouts]),
                             attention_mask=torch.cat([wide(r.attention_mask) for r in rollouts]),
                             action_mask=torch.cat([r.action_mask for r in rollouts]),
                             ended_with_eos=torch.cat([r.ended_with_eos for r in rollouts]))
