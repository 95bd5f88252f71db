"""No learning on padding, inside the rows: a PPO batch's real tokens packed into rows without pads.

A rollout batch ``[left-padded prompts | responses]`` (B, L) holds, after ``attended_span`` cuts
the columns no row attends, still the padding inside the span: a short prompt's left pads and
the columns after a row's stop token. On ragged rollouts that is 30-45% of what a forward
computes (bench/RESULTS.md, useful-token MFU). ``pack`` moves every row's attended tokens (a
contiguous run: prompt, then response up to its stop) into bins of ``capacity`` columns, first fit
by decreasing length; each token keeps its position (its row's mask cumsum, so a sequence starts
at 0 in its bin). The model runs on the bins with ``position_ids`` and no attention mask, and
transformers reads a position that does not continue the previous one as the start of a new
sequence (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal mask. The
forwards here go further (``forward_packed``): they carry each sequence's start
(``Packed.cu_seqlens``) and run the attention of tasks/ppo/varlen.py, which on the GPU visits only
each sequence's own key blocks (the flash varlen kernel) instead of every column pair of a bin.
Either way each token's output equals the padded forward's up to summation order. A bin's unused
tail is one more sequence of pad ids from position 0, read by nobody (no query row is fully
masked: cuDNN's NaN of issue 18 cannot arise).

``Packed.index`` maps every attended (row, column) of the batch to its flat place in the bins, so
per-token outputs come back as (B, ...) with ``unpack``; ``action_positions`` gives the places
that predict the actions (the token before each), which is where the LM head and the critic's
values are read.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor

from tasks.ppo.padding import MULTIPLE

VARLEN = True  # False: the forwards give transformers only the position restarts and it masks each bin
# densely (what packing did before tasks/ppo/varlen.py; bench/useful_mfu.py's 'packedN-mask' variants set it)


class Packed(NamedTuple):
    input_ids: Tensor     # (R, C) the bins
    position_ids: Tensor  # (R, C) each token's position in its own sequence
    index: Tensor         # (B, L) long, on the CPU: flat place (into R * C) of each attended token; -1 elsewhere
    cu_seqlens: Tensor    # (S + 1,) int32: where each of the S sequences of the flat R * C places starts (bin tails
    #                       included), then R * C; on the bins' device
    max_len: int          # the longest of them


def bins_first_fit(lengths: list[int], capacity: int) -> tuple[list[int], list[int], list[int]]:
    """First-fit decreasing: (bin of each item, offset of each item in its bin, fill of each bin)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    fill: list[int] = []
    where, offset = [0] * len(lengths), [0] * len(lengths)
    for i in order:
        n = lengths[i]
        b = next((b for b, f in enumerate(fill) if f + n <= capacity), len(fill))
        if b == len(fill):
            fill.append(0)
        where[i], offset[i] = b, fill[b]
        fill[b] += n
    return where, offset, fill


def bin_width(lengths: list[int], capacity: int, multiple: int = MULTIPLE) -> tuple[int, tuple[list[int], list[int], list[int]]]:
    """The bins' width C and ``bins_first_fit`` at it: as few bins as ``capacity`` columns give
    (or the longest row where that is longer; rounded up to ``multiple``), at the narrowest
    multiple of ``multiple`` that still needs no more of them (binary search), so a minibatch of
    2,300 tokens takes 3 bins of 800 columns, not 3 of 1,024."""
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    C = up(max(capacity, max(lengths)))
    best = bins_first_fit(lengths, C)
    R = len(best[2])
    lo, hi = max(up(max(lengths)), up(-(-sum(lengths) // R))) // multiple, C // multiple - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        got = bins_first_fit(lengths, mid * multiple)
        if len(got[2]) <= R:
            C, best, hi = mid * multiple, got, mid - 1
        else:
            lo = mid + 1
    return C, best


def pack(sequences: Tensor, attention_mask: Tensor, capacity: int, multiple: int = MULTIPLE,
         device: torch.device | str | None = None) -> Packed:
    """The attended tokens of ``sequences`` (B, L) (``attention_mask`` 1, one contiguous run a row)
    in bins of C <= ``capacity`` columns (``bin_width``; the longest row's, rounded up to
    ``multiple``, where that is longer), built on ``device`` (default: the sequences').

    The layout is worked out on the CPU from the mask, and only the bins' ids and positions go to
    the device (no blocking copy): given the batch as it arrives from Ray (on the CPU), packing
    makes the GPU wait for nothing. ``index`` stays on the CPU."""
    dev = sequences.device if device is None else torch.device(device)
    mask = attention_mask.bool().cpu()
    lengths = mask.sum(1)
    C, (where, offset, fill) = bin_width(lengths.tolist(), capacity, multiple)
    R = len(fill)
    start = torch.tensor(where) * C + torch.tensor(offset)
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    index = torch.where(mask, start[:, None] + pos, -1)
    # the tail of bin r is a sequence of its own starting at position 0
    position_ids = (torch.arange(C)[None, :] - torch.tensor(fill)[:, None]).clamp_min(0).flatten()
    source = torch.full((R * C,), -1)  # the flat (row * L + column) of the token at each place
    flat = index[mask]
    position_ids[flat], source[flat] = pos[mask], mask.flatten().nonzero().squeeze(1)
    cu = torch.cat([(position_ids == 0).nonzero().squeeze(1), torch.tensor([R * C])])  # every sequence starts at 0
    source = source.to(dev, non_blocking=True)
    tokens = sequences.to(dev, non_blocking=True).flatten()[source.clamp_min(0)]
    input_ids = torch.where(source >= 0, tokens, 0)  # a bin's tail: id 0, read by nobody
    return Packed(input_ids.view(R, C), position_ids.view(R, C).to(dev, non_blocking=True), index,
                  cu.to(torch.int32).to(dev, non_blocking=True), int(cu.diff().max()))


@contextlib.contextmanager
def forward_packed(config, p: Packed):
    """Yields the keyword arguments of a forward on the bins of ``p`` (positions; with ``VARLEN``
    the sequences' starts, under transformers' flash names) and, while in this context, has the
    model whose ``config`` this is attend within those sequences (tasks/ppo/varlen.py)."""
    if not VARLEN:
        yield {"position_ids": p.position_ids}
        return
    from tasks.ppo.varlen import attend_packed

    with attend_packed(config):
        yield {"position_ids": p.position_ids, "cu_seq_lens_q": p.cu_seqlens, "max_length_q": p.max_len}


def unpack(x: Tensor, index: Tensor) -> Tensor:
    """Per-token outputs of the bins (R, C, ...) -> (B, K, ...) at ``index`` (B, K); 0 where it is -1."""
    index = index.to(x.device, non_blocking=True)
    flat = x.reshape(-1, *x.shape[2:])[index.clamp_min(0)]
    keep = (index >= 0).view(*index.shape, *([1] * (flat.dim() - index.dim())))
    return torch.where(keep, flat, flat.new_zeros(()))


def action_positions(packed: Packed, attention_mask: Tensor, num_actions: int) -> Tensor:
    """(B, N) flat place (on the CPU) of the token that predicts each action (the one before it);
    -1 where the action column is not attended (after a row's stop)."""
    L = attention_mask.shape[1]
    before = packed.index[:, L - num_actions - 1: L - 1]
    return torch.where(attention_mask[:, L - num_actions:].bool().cpu(), before, -1)


@contextlib.contextmanager
def head_on(module: torch.nn.Module | None, places: Tensor):
    """While in this context, ``module`` (a model's LM head) reads only the hidden states at the
    flat ``places`` (K,) of its (R, C, H) input, as a (1, K, H) batch: logits of the positions
    that predict actions, not of every packed token (at a 128k vocabulary those are most of a
    forward's memory). Yields a list that holds True once the head ran so."""
    ran: list[bool] = []
    if module is None:
        yield ran
        return

    def gather(_mod, args):
        h = args[0]
        ran.append(True)
        return (h.reshape(1, -1, h.shape[-1])[:, places], *args[1:])

    handle = module.register_forward_pre_hook(gather)
    try:
        yield ran
    finally:
        handle.remove()
