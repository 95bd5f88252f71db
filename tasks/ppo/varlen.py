"""Attention over packed sequences by their boundaries: the varlen kernel, not a block-diagonal mask.

A packed forward (tasks/ppo/packing.py) holds several sequences in each row (bin). Given only the
position restarts, transformers builds an (R, 1, C, C) block-diagonal mask and the masked SDPA
kernel computes every column pair of every bin: on an H100 at 1.5B packing doubled the learn
epoch's attention time (49 -> 98 ms, bench/RESULTS.md) while it cut the GEMMs' by a quarter.
Here the forward also carries the bins' cumulative sequence lengths under the names transformers'
own flash path reads (``cu_seq_lens_q`` / ``max_length_q``, FlashAttention's varlen convention),
and ``packed_attention`` serves as the model's attention function while ``attend_packed`` holds:

- CUDA, fp16 / bf16 (or fp32 under half autocast), head dim a multiple of 8 up to 256, no logit
  softcapping: aten's flash varlen kernel (``torch.ops.aten._flash_attention_forward`` with
  cumulative lengths; torch's autograd has its backward), which visits only the key blocks of
  each query's own sequence, GQA without repeating K/V.
- with ``KERNEL = 'triton'`` (bench/useful_mfu.py's '-tvarlen' variants; not measured on a GPU
  yet, so not the default), no sliding window, softcapping or dropout: tasks/ppo/varlen_kernel.py,
  a Triton flash attention for short packed sequences, forward and backward one launch each (on
  CUDA; on the CPU only in Triton's interpreter, for the tests).
- anything else (CPU, fp32, Gemma 2's softcapping, other head dims): a dense masked attention per
  bin with the mask built from the same lengths (what transformers computed before).

Either way a sequence attends only to itself, causally (``module.is_causal``), within a sliding
window where the layer has one; no query row is fully masked (each sees itself).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import Tensor

NAME = "rlhf_packed"  # the attention implementation this module registers with transformers
KERNEL = "flash"  # the GPU's kernel: 'flash' (aten's) or 'triton' (tasks/ppo/varlen_kernel.py), read at call time
HALF = (torch.float16, torch.bfloat16)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter (the CPU tests of the 'triton' kernel)
FLASH_GPU: list[bool] = []  # [whether this process's GPU runs the flash kernel (sm80+)], set by ``attend_packed``
# outside any compiled region: the attention function reads it as a constant


def _run_dtype(query: Tensor) -> torch.dtype:
    """The query's dtype if half, else under autocast its dtype (fp32 master weights under bf16
    autocast give fp32 queries: RoPE's fp32 cos / sin promote the bf16 projections; SDPA would
    cast them too), else fp32."""
    if query.dtype in HALF:
        return query.dtype
    autocast = torch.is_autocast_enabled(query.device.type) and torch.get_autocast_dtype(query.device.type)
    return autocast if autocast in HALF else query.dtype


def _flash_dtype(query: Tensor, softcap: float | None) -> torch.dtype | None:
    """The dtype the flash kernel runs this attention in, or None where it does not."""
    if not (query.is_cuda and FLASH_GPU and FLASH_GPU[0] and softcap is None and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256):
        return None
    dtype = _run_dtype(query)
    return dtype if dtype in HALF else None


def _triton_dtype(query: Tensor, softcap: float | None, window: int | None, dropout: float) -> torch.dtype | None:
    """The dtype tasks/ppo/varlen_kernel.py runs this attention in, or None where it does not."""
    if KERNEL != "triton" or softcap is not None or window or dropout or query.shape[-1] > 256:
        return None
    if not (query.is_cuda or INTERPRETED):
        return None
    return _run_dtype(query)


def packed_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, *,
                     cu_seq_lens_q: Tensor | None = None, max_length_q: int | None = None,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function interface: ``query`` (R, H, C, D), ``key`` / ``value``
    (R, H_kv, C, D) of R bins of C columns -> ((R, C, H, D), None). ``cu_seq_lens_q`` (S + 1,)
    int32 on the query's device: where each sequence of the R * C flat tokens starts, and their
    total; ``max_length_q`` the longest."""
    if cu_seq_lens_q is None or attention_mask is not None:
        raise RuntimeError(f"attention {NAME!r} runs only on packed rows: give cu_seq_lens_q and no attention_mask "
                           "(tasks/ppo/packing.py forward_packed)")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{type(module).__name__} has attention sinks (s_aux), which packed rows do not support; "
                         "set ppo.pack_tokens=0")
    R, H, C, D = query.shape
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    scaling = D ** -0.5 if scaling is None else scaling
    window = sliding_window if sliding_window and sliding_window < max_length_q else None
    # the bins' tokens flat, (R * C, heads, D), as the varlen kernels take them
    flat = lambda dtype: (t.transpose(1, 2).reshape(R * C, t.shape[1], D).to(dtype) for t in (query, key, value))  # noqa: E731
    if (dtype := _triton_dtype(query, softcap, window, dropout)) is not None:
        from tasks.ppo.varlen_kernel import varlen_attention

        return varlen_attention(*flat(dtype), cu_seq_lens_q, max_length_q, scaling, causal)[0].view(R, C, H, D), None
    if (half := _flash_dtype(query, softcap)) is not None:
        q, k, v = flat(half)
        side = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q,
                                                      dropout, causal, False, scale=scaling, **side)[0]
        return out.view(R, C, H, D), None
    return _masked(query, key, value, cu_seq_lens_q, scaling, causal, window, softcap, dropout), None


def _masked(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scaling: float, causal: bool, window: int | None,
            softcap: float | None, dropout: float) -> Tensor:
    """Each bin's attention, dense, under the mask of its sequences (from ``cu``) -> (R, C, H, D)."""
    R, H, C, D = query.shape
    seq = torch.bucketize(torch.arange(R * C, device=cu.device), cu[1:], right=True).view(R, C)
    keep = seq[:, :, None] == seq[:, None, :]
    i = torch.arange(C, device=query.device)
    if causal:
        keep = keep & (i[:, None] >= i[None, :])
    if window:
        keep = keep & (i[:, None] - i[None, :] < window)
    g = H // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=keep[:, None], dropout_p=dropout, scale=scaling)
    else:  # as transformers' eager attention: softcap the scores, softmax in fp32
        scores = torch.tanh(query @ key.transpose(2, 3) * scaling / softcap) * softcap
        weights = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1, dtype=torch.float32).to(query.dtype)
        out = F.dropout(weights, dropout, training=dropout > 0) @ value
    return out.transpose(1, 2).contiguous()


@contextlib.contextmanager
def attend_packed(config):
    """While in this context, the attention layers of the model whose ``config`` this is run
    ``packed_attention`` (transformers reads ``config._attn_implementation`` at each call and
    builds no mask for an implementation it has no mask function for)."""
    from transformers import AttentionInterface

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_attention)
        FLASH_GPU.append(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0))
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
