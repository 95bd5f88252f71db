"""Flash attention over packed short sequences, forward and backward, in Triton.

The learners' packed forwards (tasks/ppo/packing.py) hold rollouts of ~100-300 tokens, several to
a bin. aten's flash varlen kernel (FlashAttention 2) tiles for long sequences: in the 0.4B learn
epoch on an H100 its 48 forwards and backwards took 14.4 ms where the attention's FLOPs need ~1
(bench/RESULTS.md, twelfth session), the backward 10.7 of it in three kernels (dot(dO, O), the
main loop with its fp32 dQ accumulated by atomics, the dQ conversion). Here a sequence is a few
tiles long, so one program can own a tile of it outright:

1. ``_forward_kernel``, grid (query tiles of the longest sequence, sequences, heads): the online
   softmax of one tile of one sequence's queries over its keys (causal: those up to the tile's
   end), in fp32; writes the output and the rows' log-sum-exp (log2 domain) for the backward.
2. ``_backward_kernel``, grid (tiles of the longest sequence, sequences, KV heads): one program
   takes tile ``j`` of one sequence for one KV head and all its GQA query heads, and computes
   dK / dV of key tile ``j`` (over the query tiles that see it) and dQ of query tile ``j`` (over
   the key tiles it sees), recomputing the probabilities from the saved log-sum-exp. No atomics,
   no fp32 dQ buffer, no separate dot(dO, O) pass (each row's delta is taken where it is used),
   and GQA without repeating K/V: one launch.

Programs whose tile lies past their sequence's end return at once. ``varlen_attention`` is a
``torch.library.triton_op`` with its autograd registered, so torch.compile (the learners'
compiled blocks) traces both kernels. tasks/ppo/varlen.py chooses it (``KERNEL``); the tests
run it in Triton's interpreter (TRITON_INTERPRET=1), the GPU run checks and times it
(bench/varlen_attention.py, bench/useful_mfu.py's '-tvarlen' variants); ptxas's register counts for an
H100 are checked without one (tests/test_varlen.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# Triton's interpreter multiplies bfloat16 bit patterns in tl.dot (tasks/ppo/decode_attention.py):
# there the operands, already in the input dtype, are widened to fp32 first
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# launch settings, read at call time (bench/varlen_attention.py --settings sweeps them); FWD_WARPS 0 =
# by the head dim, as ``settings`` says. The forward's query rows and key columns a tile, the backward's
# one tile (a program's key tile and query tile are the same rows of its sequence). Chosen so that
# no program spills registers on an H100 (sm90, bf16; ptxas's counts, tests/test_varlen.py): the
# backward holds four fp32 tiles of the head dim (dK, dV and two of scores), so at 64-row tiles it
# spilled at 4 warps and head dim 64 (8 B a thread aligned as a call usually is, 760 not), and at
# 8 warps and 128 (144 / 1,016 B). Registers differ between Triton versions: at 8 warps and head
# dim 64 Triton 3.9 gave 64-row tiles 230 registers, Triton 3.6 (the GPU image's) 255 and an 80 B
# spill unaligned (bench/RESULTS.md 2026-12-08), so the backward takes 32-row tiles at every head
# dim (3.6: 171 / 217, 3.9: 161 / 196 at 64; 186 / 255 and 169 / 249 at 128, none spilled).
BLOCK_M, BLOCK_N, FWD_WARPS, BLOCK_BWD, BWD_WARPS, NUM_STAGES = 64, 64, 0, 32, 8, 2


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr):
    if WIDEN:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")  # fp32 inputs: IEEE products (no TF32); half: ignored


@triton.jit
def _span(CU, seq):
    """(first token, length) of sequence ``seq``."""
    start = tl.load(CU + seq)
    return start, tl.load(CU + seq + 1) - start


@triton.jit
def _rows(X, start, rows, ok, s_t, s_h, head, d, d_ok):
    """Rows ``rows`` of one head of a (T, heads, D) tensor from token ``start`` on; zeros where not ``ok``."""
    return tl.load(X + (start + rows)[:, None] * s_t + head * s_h + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _store_rows(X, value, start, rows, ok, s_t, s_h, head, d, d_ok):
    """``value`` (fp32) into ``_rows``'s places of X, in X's dtype."""
    tl.store(X + (start + rows)[:, None] * s_t + head * s_h + d[None, :], value.to(X.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _forward_kernel(Q, K, V, O, LSE, CU, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sl_h, G, D, scale_log2: tl.constexpr,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    WIDEN: tl.constexpr):
    """One query tile of one sequence and head: the output rows and their log-sum-exp (log2).
    The scales are compile-time constants: a float argument under torch.compile comes typed fp64
    (as tasks/ppo/decode_attention.py found), which makes the fp32 softmax state fp64 in the loop
    and fails the compile ("Loop-carried variable m has initial type fp32", checked for sm90)."""
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length = _span(CU, seq)
    if tile * BLOCK_M >= length:
        return
    kv_head = head // G
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_ok, d_ok = rows < length, d < D
    q = _rows(Q, start, rows, row_ok, sq_t, sq_h, head, d, d_ok)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(length, (tile + 1) * BLOCK_M) if CAUSAL else length
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        k = _rows(K, start, cols, col_ok, sk_t, sk_h, kv_head, d, d_ok)
        seen = col_ok[None, :]
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None])
        x = tl.where(seen, _dot(q, tl.trans(k), WIDEN) * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))  # finite: every row sees its sequence's first key
        p = tl.exp2(x - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        v = _rows(V, start, cols, col_ok, sv_t, sv_h, kv_head, d, d_ok)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, WIDEN)
        s = s * alpha + tl.sum(p, 1)
        m = m_new
    _store_rows(O, acc / s[:, None], start, rows, row_ok, so_t, so_h, head, d, d_ok)
    tl.store(LSE + head * sl_h + start + rows, m + tl.log2(s), mask=row_ok)


@triton.jit
def _backward_kernel(Q, K, V, O, DO, LSE, DQ, DK, DV, CU, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sl_h,
                     sdq_t, sdq_h, sdk_t, sdk_h, G, D, scale: tl.constexpr, scale_log2: tl.constexpr, CAUSAL: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, WIDEN: tl.constexpr):
    """Tile ``tile`` of one sequence for one KV head and its query heads: dK / dV of that key tile,
    then dQ of that query tile (the scales compile-time constants, as the forward's)."""
    tile, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length = _span(CU, seq)
    if tile * BLOCK >= length:
        return
    idx = tile * BLOCK + tl.arange(0, BLOCK)  # this program's key columns, then its query rows
    d = tl.arange(0, BLOCK_D)
    idx_ok, d_ok = idx < length, d < D
    tiles = tl.cdiv(length, BLOCK)
    # dK, dV of key tile `tile`: every query tile that sees it, of every head of the group
    k = _rows(K, start, idx, idx_ok, sk_t, sk_h, kv_head, d, d_ok)
    v = _rows(V, start, idx, idx_ok, sv_t, sv_h, kv_head, d, d_ok)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    first = tile if CAUSAL else 0
    for g in range(0, G):
        head = kv_head * G + g
        for i in range(first, tiles):
            rows = i * BLOCK + tl.arange(0, BLOCK)
            row_ok = rows < length
            q = _rows(Q, start, rows, row_ok, sq_t, sq_h, head, d, d_ok)
            do = _rows(DO, start, rows, row_ok, so_t, so_h, head, d, d_ok)
            o = _rows(O, start, rows, row_ok, so_t, so_h, head, d, d_ok)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            lse = tl.load(LSE + head * sl_h + start + rows, mask=row_ok, other=0.0)
            seen = idx_ok[:, None] & row_ok[None, :]  # (key, query)
            if CAUSAL:
                seen = seen & (idx[:, None] <= rows[None, :])
            pt = tl.where(seen, tl.exp2(_dot(k, tl.trans(q), WIDEN) * scale_log2 - lse[None, :]), 0.0)
            dv += _dot(pt.to(do.dtype), do, WIDEN)
            dst = pt * (_dot(v, tl.trans(do), WIDEN) - delta[None, :])
            dk += _dot(dst.to(q.dtype), q, WIDEN)
    _store_rows(DK, dk * scale, start, idx, idx_ok, sdk_t, sdk_h, kv_head, d, d_ok)
    _store_rows(DV, dv, start, idx, idx_ok, sdk_t, sdk_h, kv_head, d, d_ok)
    # dQ of query tile `tile`, each head of the group: every key tile it sees
    last = tile + 1 if CAUSAL else tiles
    for g in range(0, G):
        head = kv_head * G + g
        q = _rows(Q, start, idx, idx_ok, sq_t, sq_h, head, d, d_ok)
        do = _rows(DO, start, idx, idx_ok, so_t, so_h, head, d, d_ok)
        o = _rows(O, start, idx, idx_ok, so_t, so_h, head, d, d_ok)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        lse = tl.load(LSE + head * sl_h + start + idx, mask=idx_ok, other=0.0)
        dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
        for i in range(0, last):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            col_ok = cols < length
            kb = _rows(K, start, cols, col_ok, sk_t, sk_h, kv_head, d, d_ok)
            vb = _rows(V, start, cols, col_ok, sv_t, sv_h, kv_head, d, d_ok)
            seen = idx_ok[:, None] & col_ok[None, :]  # (query, key)
            if CAUSAL:
                seen = seen & (cols[None, :] <= idx[:, None])
            p = tl.where(seen, tl.exp2(_dot(q, tl.trans(kb), WIDEN) * scale_log2 - lse[:, None]), 0.0)
            ds = p * (_dot(do, tl.trans(vb), WIDEN) - delta[:, None])
            dq += _dot(ds.to(kb.dtype), kb, WIDEN)
        _store_rows(DQ, dq * scale, start, idx, idx_ok, sdq_t, sdq_h, head, d, d_ok)


LOG2E = 1.4426950408889634


def _check(q: Tensor, k: Tensor, v: Tensor, cu: Tensor) -> None:
    assert q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape and q.shape[0] == k.shape[0], (q.shape, k.shape, v.shape)
    assert q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
    assert q.dtype == k.dtype == v.dtype and cu.dtype == torch.int32, (q.dtype, k.dtype, v.dtype, cu.dtype)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "the head dimension must be contiguous"


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))  # tl.dot's smallest K


def settings(D: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, forward warps, BLOCK_BWD, backward warps, stages) for head dim ``D``:
    the module's, forward warps 0 taken by the head dim (4 up to 64, else 8)."""
    return BLOCK_M, BLOCK_N, FWD_WARPS or (4 if D <= 64 else 8), BLOCK_BWD, BWD_WARPS, NUM_STAGES


@torch.library.triton_op("rlhf::varlen_attention", mutates_args=())
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float,
                     causal: bool = True) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale) v within each packed sequence. q (T, H, D), k / v (T, H_kv, D) of T
    tokens (H a multiple of H_kv: GQA), the head dimension contiguous; ``cu`` (S + 1,) int32: where
    each of the S sequences starts, and T; ``max_len`` the longest. -> (out (T, H, D) in q's dtype,
    lse (H, T) fp32: each row's log2-sum-exp2 of its scores times log2(e), for the backward)."""
    _check(q, k, v, cu)
    T, H, D = q.shape
    out = q.new_empty(q.shape)  # contiguous: the backward reads dO with its strides
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    block_m, block_n, warps, _, _, stages = settings(D)
    grid = (triton.cdiv(max_len, block_m), cu.shape[0] - 1, H)
    torch.library.wrap_triton(_forward_kernel)[grid](
        q, k, v, out, lse, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), H // k.shape[1], D, scale_log2=scale * LOG2E,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(D), WIDEN=INTERPRETED,
        num_warps=warps, num_stages=stages)
    return out, lse


@torch.library.triton_op("rlhf::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: Tensor,
                              max_len: int, scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``varlen_attention`` given the gradient of its output."""
    _check(q, k, v, cu)
    T, H, D = q.shape
    dout = dout.contiguous()  # read with out's (contiguous) strides
    # contiguous, whatever the inputs' strides (GPT-2's q / k / v are views of one projection)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    _, _, _, block, warps, stages = settings(D)
    grid = (triton.cdiv(max_len, block), cu.shape[0] - 1, k.shape[1])
    torch.library.wrap_triton(_backward_kernel)[grid](
        q, k, v, out, dout, lse, dq, dk, dv, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), out.stride(0), out.stride(1), lse.stride(0), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1),
        H // k.shape[1], D, scale=scale, scale_log2=scale * LOG2E,
        CAUSAL=causal, BLOCK=block, BLOCK_D=_block_d(D), WIDEN=INTERPRETED, num_warps=warps, num_stages=stages)
    return dq, dk, dv


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu, max_len, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu)
    ctx.max_len, ctx.scale, ctx.causal = max_len, scale, causal
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor):
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward(dout, q, k, v, out, lse, cu, ctx.max_len, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)
