"""Split-K flash decoding: one query per row against a static KV cache, in Triton.

FastGenerator's decode step reads every cache column of every layer once per token. The library
attention kernels tile for long queries, so at one query per row they take 26 us a layer on an
H200 to read what the copy bandwidth reads in 16 (0.4b, batch 64, 256 columns: bench/RESULTS.md
"Rollout"). Here (flash-decoding, https://pytorch.org/blog/flash-decoding/):

1. ``_partial_kernel``, grid (b * n_kv, num_splits): a program takes one (row, KV head) and one
   run of cache columns, loads each K/V tile once for all ``g`` query heads of the group (GQA
   without repeating K/V) and keeps the online-softmax state in fp32: running max ``m``, sum
   ``l`` and the unnormalised weighted sum of V. With one split it writes the output directly.
2. ``_combine_kernel``, grid (b * n_kv,): merges the splits' states (log-sum-exp rescaling).
3. ``_partial_rope_kernel`` (``decode_attention_rope``, FastGenerator's on models without q/k
   norms): ``_partial_kernel`` that starts from the step's packed q/k/v projection (the split-K
   linears' fp32 partials as they are, or cuBLAS's product as one part): it sums them, applies
   RoPE to q and k, writes k and v into the cache column and attends, so RoPE and the two cache
   writes need no kernels of their own (the 0.4b decode step on an H100 1.398 -> 1.363 ms with the
   split-K linears, 1.463 -> 1.407 with cuBLAS's; bench/RESULTS.md, sixth and seventh sessions);
   with the split-K linears launched as a programmatic dependent (``decode_attention_rope_pdl``:
   1.317 -> 1.289-1.292 ms), whose programs ask the L2 for their first cache tile before they wait
   for the projection (1.276 -> 1.243-1.252 ms, eighth session). It reads no column after the
   step's (the future).

Masked columns (bias at the dtype's minimum) are not loaded: their K/V loads are predicated off,
so they cost no memory traffic and contribute exactly zero; late in a rollout most of a row is
visible, early most of the response columns are not.

Scores are a ``tl.dot`` of the group's queries, padded to 16 rows (the tensor cores' smallest
M), with the K tile: at 1 to 8 heads a group most of those rows are zeros, but the kernel is
bound by reading K/V, not by the MMA, and one code path serves every ``g`` (a broadcast product
would hold g x tile columns x head_dim fp32 values in registers: spills at g = 8, head_dim = 128).
fp32 inputs use IEEE products (no TF32), so an fp32 cache decodes as SDPA does; those run on
the FMA units, padding included (16/g times the useful products): right for tests and small
fp32 models, not the bf16 path that rollouts take.

``decode_attention`` is a ``torch.library.triton_op``: ``torch.compile`` sees the two kernels
(FastGenerator compiles the layer around it) and CUDA-graph capture sees two launches and
outputs of static shape (no host sync, nothing sized by data). The module imports triton at the
top: import it only where the kernel is wanted (``fast_generate`` does so for attention='triton').
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from tasks.ppo.decode_linear import pdl_capable, prefetch_l2

TILE_BYTES = 16384  # one K (or V) tile: 128 cache columns at head_dim 64 in bf16, 64 at head_dim 128 (64 columns
# always before 2026-12-06: the 0.4b decode step 1.05x slower on an H100, bench/RESULTS.md)
BLOCK_N: int | None = None  # cache columns per tile; None: from TILE_BYTES (bench/decode_parts.py sets it to sweep)
MIN_ROWS = 16  # tl.dot's smallest M (and N, K): the group's queries are padded to it
SMS_IF_NOT_CUDA = 132  # an H200's SM count, for the split choice off CUDA (the interpreter's tests)
PROGRAMS_PER_SM = 4  # enough programs in flight to keep the memory system busy
PREFETCH_TILES = 1  # the PDL RoPE kernel: a program's first cache tiles asked of the L2 before it waits for the projection
# (0.4b on an H100: 1.276 -> 1.243-1.252 ms a step; bench/RESULTS.md, eighth session, 'apreN'), read at call time
NUM_WARPS, NUM_STAGES = 4, 2  # the partial kernel's launch, read at call time (bench/decode_parts.py sweeps them:
# with 128-column tiles the fastest over 24 separate layer caches on an H100, 2026-12-06)
# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies bfloat16 bit patterns in
# tl.dot (triton-lang/triton#11584, "not supported yet"): there the dot operands, already rounded
# to the cache dtype, are widened to fp32 first, which gives the same products
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _sum_parts(QKV, sp, offsets, ok, PARTS: tl.constexpr, dtype: tl.constexpr):
    """sum over ``PARTS`` of QKV[part, offsets] in fp32, rounded to ``dtype`` (as ``_linear``'s
    cast of the summed partials), back in fp32."""
    x = tl.load(QKV + offsets, mask=ok, other=0.0).to(tl.float32)
    for part in tl.static_range(1, PARTS):
        x += tl.load(QKV + part * sp + offsets, mask=ok, other=0.0).to(tl.float32)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rope_from_parts(QKV, sp, offsets, partner, ok, sign, cos, sin, PARTS: tl.constexpr, dtype: tl.constexpr):
    """x cos + rotate_half(x) sin of the summed parts at ``offsets``; rotate_half(x)[d] = sign[d] x[partner[d]]."""
    x = _sum_parts(QKV, sp, offsets, ok, PARTS, dtype)
    xr = _sum_parts(QKV, sp, partner, ok, PARTS, dtype)
    return (x * cos + sign * xr * sin).to(dtype)


@triton.jit
def _partial_kernel(Q, K, V, Bias, Out, Mx, Sm, Acc,
                    sq_b, sq_h, sq_g, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sb_b, sb_l, so_b, so_h, so_g,
                    n_kv, G, L, cols_per_split, scale: tl.constexpr, masked: tl.constexpr, HD: tl.constexpr,
                    G_PAD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK: tl.constexpr, ONE_SPLIT: tl.constexpr,
                    DOT_IN_F32: tl.constexpr):
    """Softmax state of one (row, KV head) over one split of the cache columns: max ``Mx`` and
    sum ``Sm`` (b, n_kv, S, G) and unnormalised weighted V ``Acc`` (b, n_kv, S, G, HD), fp32,
    in base-2 units (exp2 is the hardware's); with ``ONE_SPLIT`` the normalised output instead.
    ``scale`` and ``masked`` are compile-time constants: as plain float arguments Inductor types
    them fp64, which turned the fp32 softmax state fp64 inside the loop (a CompilationError in
    the compiled decode layer on the H200, 2026-12-04)."""
    pair, split = tl.program_id(0), tl.program_id(1)
    row, head = (pair // n_kv).to(tl.int64), pair % n_kv  # 64-bit offsets: a cache past 2**31 elements
    offs_g, offs_d = tl.arange(0, G_PAD), tl.arange(0, HD_PAD)
    q = tl.load(Q + row * sq_b + head * sq_h + offs_g[:, None] * sq_g + offs_d[None, :],
                mask=(offs_g < G)[:, None] & (offs_d < HD)[None, :], other=0.0)
    _attend(q, K + row * sk_b + head * sk_h, V + row * sv_b + head * sv_h, Bias + row * sb_b, Out + row * so_b + head * so_h,
            Mx, Sm, Acc, pair, split, sk_l, sv_l, sb_l, so_g, G, L, cols_per_split, scale, masked, HD, G_PAD, HD_PAD, BLOCK,
            ONE_SPLIT, DOT_IN_F32)


@triton.jit
def _partial_rope_kernel(QKV, Cos, Sin, Col, K, V, Bias, Out, Mx, Sm, Acc,
                         sp, sqkv_b, sc_b, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sb_b, sb_l, so_b, so_h, so_g,
                         n_kv, G, L, cols_per_split, scale: tl.constexpr, masked: tl.constexpr, HD: tl.constexpr,
                         G_PAD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK: tl.constexpr, ONE_SPLIT: tl.constexpr,
                         DOT_IN_F32: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """``_partial_kernel`` from the step's packed projection: q, k and v come as ``PARTS`` parts of
    ``QKV`` (parts, b, (n_kv G + 2 n_kv) HD) whose sum is it (the split-K linears' fp32 partials, or
    the product itself as one part). The program sums its group's queries and its head's k and v,
    rotates q and k by the row's ``Cos`` / ``Sin`` (b, HD) as rotate_half RoPE does, writes k and v
    into cache column ``Col`` (the split that holds it does) and attends with q from registers:
    RoPE and the cache writes need no kernels of their own. ``PDL`` (launched as a programmatic
    dependent of the kernel before, the packed projection): the program waits for that kernel
    before reading its product and lets the next kernel launch at once: the next one's programs
    take the SMs this kernel's last wave leaves free and prefetch their weights there. Before it
    waits, the program asks the L2 for the visible columns of its first ``PREFETCH`` cache tiles:
    the cache before this step's column and the bias were written before the projection ran."""
    pair, split = tl.program_id(0), tl.program_id(1)
    row, head = (pair // n_kv).to(tl.int64), pair % n_kv
    stop = tl.minimum(tl.load(Col) + 1, L)  # the columns after this step's are the future: no row sees them
    if PDL:
        if PREFETCH > 0:
            start = split * cols_per_split
            _prefetch_tiles(K + row * sk_b + head * sk_h, V + row * sv_b + head * sv_h, Bias + row * sb_b, sk_l, sv_l, sb_l,
                            start, tl.minimum(start + cols_per_split, stop), masked, HD, HD_PAD, BLOCK, PREFETCH)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_g, offs_d = tl.arange(0, G_PAD), tl.arange(0, HD_PAD)
    g_ok, d_ok = offs_g < G, offs_d < HD
    dtype: tl.constexpr = K.dtype.element_ty
    half: tl.constexpr = HD // 2
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate_half(x) = (-x2, x1)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    cos = tl.load(Cos + row * sc_b + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(Sin + row * sc_b + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    at = QKV + row * sqkv_b
    q_at = (head * G + offs_g)[:, None] * HD
    q = _rope_from_parts(at, sp, q_at + offs_d[None, :], q_at + partner[None, :], g_ok[:, None] & d_ok[None, :],
                         sign[None, :], cos[None, :], sin[None, :], PARTS, dtype)
    k_at = n_kv * G * HD + head * HD
    k = _rope_from_parts(at, sp, k_at + offs_d, k_at + partner, d_ok, sign, cos, sin, PARTS, dtype)
    v = _sum_parts(at, sp, n_kv * (G + 1) * HD + head * HD + offs_d, d_ok, PARTS, dtype).to(dtype)
    k_base, v_base = K + row * sk_b + head * sk_h, V + row * sv_b + head * sv_h
    start = split * cols_per_split
    col = tl.load(Col + offs_d * 0)  # the column, once a lane (Triton's interpreter masks no scalar compare)
    mine = d_ok & (col >= start) & (col < tl.minimum(start + cols_per_split, L))  # the split that holds it writes it
    tl.store(k_base + col * sk_l + offs_d, k, mask=mine)
    tl.store(v_base + col * sv_l + offs_d, v, mask=mine)
    tl.debug_barrier()  # the block's own stores before its loads of the tiles
    _attend(q, k_base, v_base, Bias + row * sb_b, Out + row * so_b + head * so_h, Mx, Sm, Acc, pair, split,
            sk_l, sv_l, sb_l, so_g, G, stop, cols_per_split, scale, masked, HD, G_PAD, HD_PAD, BLOCK, ONE_SPLIT, DOT_IN_F32)


@triton.jit
def _prefetch_tiles(k_base, v_base, bias_row, sk_l, sv_l, sb_l, start, end, masked: tl.constexpr,
                    HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """The K and V lines of the visible columns before ``end`` in the first ``TILES`` tiles from
    ``start`` into the L2 (a hint: nothing waited on). A masked column's lanes ask for the split's
    first column instead (one line, whatever its bias), the lines past ``HD`` for the row's last."""
    LINE: tl.constexpr = 128 * 8 // k_base.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line
    LINES: tl.constexpr = (HD_PAD + LINE - 1) // LINE  # a power of two (HD_PAD and LINE are)
    offs_n, offs_l = tl.arange(0, BLOCK), tl.minimum(tl.arange(0, LINES) * LINE, HD - 1)
    for t in tl.static_range(TILES):
        cols = start + t * BLOCK + offs_n
        bias = tl.load(bias_row + cols * sb_l, mask=cols < end, other=masked).to(tl.float32)
        cols = tl.where(bias > masked, cols, start)
        prefetch_l2(k_base + cols[:, None] * sk_l + offs_l[None, :])
        prefetch_l2(v_base + cols[:, None] * sv_l + offs_l[None, :])


@triton.jit
def _attend(q, k_base, v_base, bias_row, out_base, Mx, Sm, Acc, pair, split, sk_l, sv_l, sb_l, so_g, G, stop, cols_per_split,
            scale: tl.constexpr, masked: tl.constexpr, HD: tl.constexpr, G_PAD: tl.constexpr, HD_PAD: tl.constexpr,
            BLOCK: tl.constexpr, ONE_SPLIT: tl.constexpr, DOT_IN_F32: tl.constexpr):
    """The online softmax of the group's queries ``q`` (G_PAD, HD_PAD) over this split's visible
    columns before ``stop`` of one (row, KV head)'s cache, and its state (or, with ``ONE_SPLIT``,
    output) written."""
    offs_g, offs_d, offs_n = tl.arange(0, G_PAD), tl.arange(0, HD_PAD), tl.arange(0, BLOCK)
    g_ok, d_ok = offs_g < G, offs_d < HD
    if DOT_IN_F32:
        q = q.to(tl.float32)
    LOG2E: tl.constexpr = 1.4426950408889634

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    s = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HD_PAD], tl.float32)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, stop)
    for n0 in range(start, end, BLOCK):
        cols = n0 + offs_n
        bias = tl.load(bias_row + cols * sb_l, mask=cols < end, other=masked).to(tl.float32)
        seen = bias > masked  # predicated K/V loads: a masked column is never read (loads on the split's columns
        # only, not waiting for the bias, measured within noise on an H100: bench/RESULTS.md, seventh session, 'kvall')
        kt = tl.load(k_base + cols[None, :] * sk_l + offs_d[:, None], mask=seen[None, :] & d_ok[:, None], other=0.0)
        if DOT_IN_F32:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision="ieee")  # (G_PAD, BLOCK), fp32 accumulation
        x = tl.where(seen[None, :], qk * scale + bias[None, :], float("-inf")) * LOG2E
        m_new = tl.maximum(m, tl.max(x, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with nothing seen yet: no NaN
        p = tl.exp2(x - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        v = tl.load(v_base + cols[:, None] * sv_l + offs_d[None, :], mask=seen[:, None] & d_ok[None, :], other=0.0)
        pv = p.to(v.dtype)  # probabilities in the cache dtype for the tensor cores, as flash attention
        if DOT_IN_F32:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        s = s * alpha + tl.sum(p, 1)
        m = m_new

    if ONE_SPLIT:
        out = acc / s[:, None]
        tl.store(out_base + offs_g[:, None] * so_g + offs_d[None, :], out.to(out_base.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        state = (pair * tl.num_programs(1) + split) * G + offs_g
        tl.store(Mx + state, m, mask=g_ok)
        tl.store(Sm + state, s, mask=g_ok)
        tl.store(Acc + state[:, None] * HD + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(Mx, Sm, Acc, Out, so_b, so_h, so_g, n_kv, G, num_splits,
                    HD: tl.constexpr, G_PAD: tl.constexpr, HD_PAD: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M the largest m_s: a split that
    saw no column (m_s = -inf, l_s = 0, acc_s = 0) weighs nothing."""
    pair = tl.program_id(0)
    row, head = (pair // n_kv).to(tl.int64), pair % n_kv  # 64-bit offsets: a cache past 2**31 elements
    offs_g, offs_d = tl.arange(0, G_PAD), tl.arange(0, HD_PAD)
    g_ok, d_ok = offs_g < G, offs_d < HD
    first = pair * num_splits * G + offs_g
    big = tl.full([G_PAD], float("-inf"), tl.float32)
    for split in range(0, num_splits):
        big = tl.maximum(big, tl.load(Mx + first + split * G, mask=g_ok, other=float("-inf")))
    big = tl.where(big == float("-inf"), 0.0, big)  # padded heads only: every real row sees a column
    s = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HD_PAD], tl.float32)
    for split in range(0, num_splits):
        state = first + split * G
        w = tl.exp2(tl.load(Mx + state, mask=g_ok, other=float("-inf")) - big)
        s += w * tl.load(Sm + state, mask=g_ok, other=0.0)
        acc += w[:, None] * tl.load(Acc + state[:, None] * HD + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    out = acc / tl.where(g_ok, s, 1.0)[:, None]
    tl.store(Out + row * so_b + head * so_h + offs_g[:, None] * so_g + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def tile_columns(head_dim: int, element_size: int) -> int:
    """Cache columns per tile: ``BLOCK_N`` when set, else a power of two giving ``TILE_BYTES`` (16 to 256)."""
    if BLOCK_N:
        return BLOCK_N
    return max(MIN_ROWS, min(256, TILE_BYTES // (triton.next_power_of_2(head_dim) * element_size)))


def choose_splits(pairs: int, L: int, sms: int, block: int) -> int:
    """Column splits per (row, KV head): the power of two that gives ``PROGRAMS_PER_SM`` programs
    on every SM, short of splits without a whole tile; 1 (no combine kernel) when the rows and
    heads already fill the GPU (0.4b: 64 rows x 16 heads = 1024 programs for 132 SMs).

    Under ``torch.compile`` with a symbolic batch, ``pairs`` is symbolic: the comparisons become
    guards and the count a plain int, so the kernels' constants and grid stay concrete; powers of
    two keep the compiled variants per batch-size range few."""
    want, splits = _cdiv(PROGRAMS_PER_SM * sms, pairs), 1
    while splits * block < L and splits < want:  # L first: no guard on the batch where one tile is all
        splits *= 2
    return splits


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else SMS_IF_NOT_CUDA


@torch.library.triton_op("rlhf::decode_attention", mutates_args=())
def decode_attention(q: Tensor, kc: Tensor, vc: Tensor, bias: Tensor, scale: float, num_splits: int = 0) -> Tensor:
    """softmax(q k^T * scale + bias) v for one query per row and head: the contract of
    ``F.scaled_dot_product_attention(q, kc, vc, attn_mask=bias, scale=scale)`` here.

    q (b, n_kv, g, hd): a KV head's ``g`` query heads. kc, vc (b, n_kv, L, hd): the cache, any
    strides with the last dimension contiguous (a ``[:b]`` slice of a larger buffer is read in
    place). bias (b, 1, 1, L): 0 where a row may attend, the dtype's minimum elsewhere (those
    columns are skipped); every row must see at least one column. -> (b, n_kv, g, hd), q's dtype.
    ``num_splits``: column splits per (row, KV head); 0 chooses from the shape (``choose_splits``).
    """
    return _attention(q, kc, vc, bias, scale, num_splits)


@torch.library.triton_op("rlhf::decode_attention_rope", mutates_args={"kc", "vc"})
def decode_attention_rope(qkv: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor, col: Tensor, bias: Tensor,
                          scale: float, n_heads: int, num_splits: int = 0) -> Tensor:
    """``decode_attention`` of the step's packed projection: RoPE on q and k and the cache write
    of k and v at column ``col`` (1,) done in its kernel. qkv (parts, b, (n_heads + 2 n_kv) hd)
    whose sum over the parts, cast to the cache dtype, is q | k | v before RoPE (fast_generate's
    ``_linear_parts``); cos, sin (b, hd): the rows' rotary tables at this step. Writes kc / vc at
    ``col`` as ``index_copy_`` of the rotated k and of v would; the columns after ``col`` are a
    decode step's future, masked for every row: not read. -> (b, n_kv, g, hd)."""
    return _attention(None, kc, vc, bias, scale, num_splits, rope=_rope_args(qkv, cos, sin, kc, col, n_heads))


def _rope_args(qkv: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, col: Tensor, n_heads: int) -> tuple:
    """``_attention``'s ``rope`` (qkv, cos, sin, col, g) for the RoPE ops, their inputs checked."""
    b, n_kv, L, hd = kc.shape
    assert qkv.shape == (qkv.shape[0], b, (n_heads + 2 * n_kv) * hd) and cos.shape == sin.shape == (b, hd), (qkv.shape, cos.shape, kc.shape)
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(1) == cos.stride(1) and cos.stride(0) == sin.stride(0)
    assert hd % 2 == 0 and col.numel() == 1, (hd, col.shape)
    return qkv, cos, sin, col, n_heads // n_kv


@torch.library.custom_op("rlhf::decode_attention_rope_pdl", mutates_args={"kc", "vc"})
def decode_attention_rope_pdl(qkv: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor, col: Tensor, bias: Tensor,
                              scale: float, n_heads: int, num_splits: int = 0) -> Tensor:
    """``decode_attention_rope`` launched as a programmatic dependent (CUDA sm90+; a plain launch
    elsewhere): an opaque op to torch.compile, as tasks/ppo/decode_linear.py's
    ``decode_linear_partials_pdl`` (a user kernel's launch cannot carry the attribute there)."""
    return _attention(None, kc, vc, bias, scale, num_splits, rope=_rope_args(qkv, cos, sin, kc, col, n_heads), pdl=pdl_capable(kc.device))


@decode_attention_rope_pdl.register_fake
def _(qkv, cos, sin, kc, vc, col, bias, scale, n_heads, num_splits=0):
    b, n_kv, _, hd = kc.shape
    return kc.new_empty((b, n_kv, n_heads // n_kv, hd))


def _attention(q: Tensor | None, kc: Tensor, vc: Tensor, bias: Tensor, scale: float, num_splits: int, rope: tuple | None = None,
               pdl: bool = False) -> Tensor:
    """The kernels' launch: q given, or (with ``rope``) made in the kernel from the projection's
    parts; ``pdl``: that kernel launched plainly (not wrapped for torch.compile) as a programmatic dependent."""
    if rope is None:
        b, n_kv, g, hd = q.shape
    else:
        qkv, cos, sin, col, g = rope
        b, n_kv, _, hd = kc.shape
    L = kc.shape[2]
    assert kc.shape == vc.shape == (b, n_kv, L, hd) and bias.shape == (b, 1, 1, L), (kc.shape, vc.shape, bias.shape)
    assert rope is not None or q.dtype == kc.dtype == vc.dtype, (q.dtype, kc.dtype, vc.dtype)
    assert kc.stride(-1) == 1 and vc.stride(-1) == 1, "the cache's head dimension must be contiguous"
    if rope is None and q.stride(-1) != 1:
        q = q.contiguous()
    block = tile_columns(hd, kc.element_size())
    splits = num_splits or choose_splits(b * n_kv, L, _sms(kc.device), block)
    cols_per_split = _cdiv(_cdiv(L, splits), block) * block  # whole tiles
    splits = _cdiv(L, cols_per_split)  # no split left without a column
    out = torch.empty((b, n_kv, g, hd), dtype=kc.dtype, device=kc.device)
    g_pad, hd_pad = max(MIN_ROWS, triton.next_power_of_2(g)), max(MIN_ROWS, triton.next_power_of_2(hd))
    masked = torch.finfo(bias.dtype).min
    # the splits' states (allocated, not written, with one split: no tensor passed twice, which
    # torch.compile's functionalisation of the kernel's outputs would have to untangle)
    mx = torch.empty((b, n_kv, splits, g), dtype=torch.float32, device=kc.device)
    sm = torch.empty((b, n_kv, splits, g), dtype=torch.float32, device=kc.device)
    acc = torch.empty((b, n_kv, splits, g, hd), dtype=torch.float32, device=kc.device)
    common = (kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), bias.stride(0), bias.stride(3),
              out.stride(0), out.stride(1), out.stride(2), n_kv, g, L, cols_per_split, scale, masked)
    launch = dict(HD=hd, G_PAD=g_pad, HD_PAD=hd_pad, BLOCK=block, ONE_SPLIT=splits == 1, DOT_IN_F32=INTERPRETED,
                  num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if rope is None:
        torch.library.wrap_triton(_partial_kernel)[(b * n_kv, splits)](
            q, kc, vc, bias, out, mx, sm, acc, q.stride(0), q.stride(1), q.stride(2), *common, **launch)
    else:
        kernel, extra = (_partial_rope_kernel, {"launch_pdl": True}) if pdl else (torch.library.wrap_triton(_partial_rope_kernel), {})
        kernel[(b * n_kv, splits)](
            qkv, cos, sin, col, kc, vc, bias, out, mx, sm, acc, qkv.stride(0), qkv.stride(1), cos.stride(0), *common,
            PARTS=qkv.shape[0], PDL=pdl, PREFETCH=PREFETCH_TILES, **launch, **extra)
    if splits > 1:
        torch.library.wrap_triton(_combine_kernel)[(b * n_kv,)](
            mx, sm, acc, out, out.stride(0), out.stride(1), out.stride(2), n_kv, g, splits,
            HD=hd, G_PAD=g_pad, HD_PAD=hd_pad, num_warps=4)
    return out
