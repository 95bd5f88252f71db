"""Split-K skinny GEMM for the decode step's linears, in Triton: x (M, K) @ w (N, K)^T at M <= 64.

At one token per row the decode step's four GEMMs a layer read 26 MB of weights (0.4b) at about
1.2 TB/s on an H100 (bench/RESULTS.md, 2026-12-06): at M = 64 cuBLAS's kernels spend a few
microseconds of fixed cost each, and the down projection (N = 1024, K = 2816) has too few output
tiles to keep the SMs reading. Here a program takes one ``BLOCK_N`` slice of the output columns
and one of ``splits`` runs of K, reads its weight tile once for every row, and writes an fp32
partial sum: ``decode_linear_partials`` returns (splits, M, N) fp32 and the caller sums over the
first dimension (tasks/ppo/fast_generate.py's ``_linear``). Inside FastGenerator's compiled layer that sum is folded by Inductor into the
kernel that consumes the product (RoPE and the cache write, the residual add and RMSNorm,
SwiGLU), so a split-K costs no reduce kernel of its own, and the sum's order is fixed (no atomics:
seeded rollouts stay reproducible).

Measured on an H100 (bench/RESULTS.md, 2026-12-06, fourth session): at 0.4B, batch 64, it takes
the decode step from 1.53 to 1.46 ms (the o and down projections, which leave cuBLAS short of
tiles, 1.3x and 1.6x); at 1.5B and 8B it gained nothing, and with the PDL launch below it loses
there (2.17 against 2.08-2.10 ms, 9.37 against 7.07, ninth session). So ``ppo.decode_linear``
'auto' (the stage's default; FastGenerator's own default stays ``linear='cublas'``) takes it only
up to a hidden size of 1024 (``fast_generate.LINEAR_AUTO_MAX_HIDDEN``) and in half precision. Its
greedy tokens are as close to an fp32 model's as cuBLAS's (eleventh session). On Hopper FastGenerator launches it as a
programmatic dependent (``decode_linear_partials_pdl``, Inductor's kernels around it compiled
with PDL): each program prefetches its weight slice into the L2 before waiting on the kernel
before it, and the 0.4B step takes 1.40 ms against 1.43 without and cuBLAS's 1.51 (fifth session).
bench/decode_parts.py's gemm part times this kernel beside cuBLAS over launch settings (24 layer
weights in turn, cold L2) and fills ``TUNED``; its step options ``tlinear`` / ``tuned`` / ``nopdl``
run it in the whole decode step; the tests run it in Triton's interpreter on CPU and natively on
a GPU.

Like tasks/ppo/decode_attention.py a ``torch.library.triton_op`` (and the PDL launch a
``custom_op``: torch.compile cannot give a user kernel's launch that attribute); the module imports
triton at the top: import it only where the kernel is wanted.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 64  # one tile of rows: the decode batch (FastGenerator uses F.linear above it)
BLOCK_K = 128  # K per loop step (bf16: 256-byte rows of the weight tile)
NUM_WARPS, NUM_STAGES = 4, 4
MAX_SPLITS = 8  # Inductor unrolls a reduction this short into the consuming pointwise kernel (unroll_reductions_threshold)
PROGRAMS_PER_SM = 2  # output tiles x K splits aimed at: the programs in flight that keep the memory system busy
SMS_IF_NOT_CUDA = 132
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # widen tl.dot's bf16 operands (see decode_attention.py)
CONFIG: tuple[int, int] | None = None  # (block_n, splits) forced for every shape (bench/decode_parts.py sweeps it)
# (n, k) -> (block_n, splits, block_k, stages) measured for that weight shape (bench/decode_parts.py's
# step option 'tuned' fills it from its sweep), taken before ``choose``'s rule; CONFIG overrides it
TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {}


@triton.jit
def prefetch_l2(ptrs):
    """A hint: the 128-byte lines of ``ptrs`` into the L2 (no registers written, nothing waited on)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _partials_kernel(X, W, P, M, N, K, sx_m, sw_n, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_IN_F32: tl.constexpr,
                     PDL: tl.constexpr):
    """P[split, m, n] = sum over this split's K of X[m, k] W[n, k], fp32. ``PDL`` (launched as a
    programmatic dependent of the kernel before): the program's weight slice is prefetched into the
    L2 while that kernel finishes, then it waits for it (``gdc_wait``) before reading X and lets
    the next kernel launch."""
    tile, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    start = split * k_per_split
    end = tl.minimum(start + k_per_split, K)
    if PDL:
        lines = tl.arange(0, BLOCK_K // 64) * 64  # bf16: 64 elements a 128-byte line
        rows = W + tl.where(n_ok, offs_n, 0)[:, None].to(tl.int64) * sw_n
        for k0 in range(start, end, BLOCK_K):
            prefetch_l2(rows + tl.minimum(k0 + lines, end - 1)[None, :])
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(start, end, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < end
        x = tl.load(X + offs_m[:, None] * sx_m + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(W + offs_n[None, :].to(tl.int64) * sw_n + ks[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_IN_F32:
            x, wt = x.to(tl.float32), wt.to(tl.float32)
        acc += tl.dot(x, wt, input_precision="ieee")
    out = P + split * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


def choose(n: int, k: int, sms: int) -> tuple[int, int]:
    """(block_n, splits): 64 output columns a program where that gives enough programs, else 32;
    then K halved (in whole ``BLOCK_K`` steps) until ``PROGRAMS_PER_SM`` programs an SM, while the
    fp32 partials of a full batch (splits x ``MAX_ROWS`` x n x 4 bytes, written and read back) stay
    within a quarter of the weight's bytes (n x k x 2): splits <= k / 512, and at most
    ``MAX_SPLITS``. On the H100's 0.4B sweep its choice came within 0.1-0.3 us of the fastest
    setting of each GEMM, and within noise of it in the whole step."""
    if CONFIG:
        return CONFIG
    block_n = 64 if _cdiv(n, 64) >= sms else 32
    tiles, splits = _cdiv(n, block_n), 1
    while (splits < MAX_SPLITS and tiles * splits * 2 <= PROGRAMS_PER_SM * sms and _cdiv(k, splits * 2) >= BLOCK_K
           and 4 * (splits * 2 * MAX_ROWS * 4) <= k * 2):  # an output column's partials (fp32) vs its weight row (bf16)
        splits *= 2
    return block_n, splits


def settings(n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(block_n, splits, block_k, stages) for an (n, k) weight: ``TUNED``'s, else ``choose``'s with
    the module's ``BLOCK_K`` and ``NUM_STAGES``."""
    if not CONFIG and (n, k) in TUNED:
        return TUNED[(n, k)]
    return (*choose(n, k, sms), BLOCK_K, NUM_STAGES)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): a CUDA device of sm90+, not Triton's interpreter."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else SMS_IF_NOT_CUDA


def _plan(x: Tensor, w: Tensor) -> tuple[int, int, int, int, int]:
    """(block_n, splits, block_k, stages, k_per_split) for x (M, K) @ w (N, K)^T: ``settings`` with
    the split count cut to splits that get a column of K each."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.dtype == w.dtype and M <= MAX_ROWS, (x.shape, w.shape, x.dtype, w.dtype)
    N, K = int(N), int(K)  # a weight's shape is static (under torch.compile's dynamic shapes: a guard)
    block_n, splits, block_k, stages = settings(N, K, _sms(x.device))
    k_per_split = _cdiv(_cdiv(K, splits), block_k) * block_k
    return block_n, _cdiv(K, k_per_split), block_k, stages, k_per_split


def _launch(kernel, x: Tensor, w: Tensor, pdl: bool) -> Tensor:
    """``kernel`` (the JIT function, or wrapped for torch.compile) launched on x @ w^T -> its partials."""
    M, K = x.shape
    N = w.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w.stride(-1) == 1, "the weight's K dimension must be contiguous"
    # M may be symbolic under torch.compile (a batch size compiled dynamically): only comparisons
    # on it (guards), so the kernel's constants and grid stay concrete
    block_n, splits, block_k, stages, k_per_split = _plan(x, w)
    p = torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    kernel[(_cdiv(N, block_n), splits)](
        x, w, p, M, N, K, x.stride(0), w.stride(0), k_per_split,
        BLOCK_M=16 if M <= 16 else 32 if M <= 32 else 64, BLOCK_N=block_n, BLOCK_K=block_k, DOT_IN_F32=INTERPRETED,
        PDL=pdl, num_warps=NUM_WARPS, num_stages=stages, **extra)
    return p


@torch.library.triton_op("rlhf::decode_linear_partials", mutates_args=())
def decode_linear_partials(x: Tensor, w: Tensor) -> Tensor:
    """x (M, K), w (N, K), both with the last dimension contiguous, M <= ``MAX_ROWS`` -> (splits,
    M, N) fp32 partial products whose sum over the first dimension is ``x @ w.T`` (fp32 accumulation)."""
    return _launch(torch.library.wrap_triton(_partials_kernel), x, w, pdl=False)


@torch.library.custom_op("rlhf::decode_linear_partials_pdl", mutates_args=())
def decode_linear_partials_pdl(x: Tensor, w: Tensor) -> Tensor:
    """``decode_linear_partials`` launched with programmatic dependent launch (CUDA, sm90+; a
    plain launch elsewhere): an opaque op to torch.compile, whose user-kernel launches cannot
    carry the launch attribute, so the call is Python at capture time and the graph replays the
    attributed launch."""
    return _launch(_partials_kernel, x, w, pdl=pdl_capable(x.device))


@decode_linear_partials_pdl.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty((_plan(x, w)[1], x.shape[0], w.shape[0]), dtype=torch.float32)
