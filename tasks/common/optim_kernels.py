"""The Triton steps of tasks/common/optim.py's ``MasterAdamW`` (imported by it only where they run:
triton is not a dependency of a CPU install). ``adamw`` is the update of one block; ``per_parameter``
launches it once a parameter, ``multi_tensor`` over the blocks of many (``MasterAdamW._multi_tensor_step``)."""

import triton
import triton.language as tl


@triton.jit
def adamw(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, offs, keep, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1,
          bc2_sqrt):
    """AdamW on the fp32 master, moments and bf16 weight at ``offs`` (where ``keep``) from the gradient there."""
    # 1 - beta comes in from the host: in fp32 on the GPU, 1 - 0.999 is 1.3e-5 off
    g = tl.load(g_ptr + offs, mask=keep).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=keep) * decay
    m = beta1 * tl.load(m_ptr + offs, mask=keep) + one_minus_beta1 * g
    v = beta2 * tl.load(v_ptr + offs, mask=keep) + one_minus_beta2 * g * g
    w = w - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(w_ptr + offs, w, mask=keep)
    tl.store(m_ptr + offs, m, mask=keep)
    tl.store(v_ptr + offs, v, mask=keep)
    tl.store(p_ptr + offs, w.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)


@triton.jit
def per_parameter(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, n, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1,
                  bc2_sqrt, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    adamw(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, offs, offs < n, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1,
          bc2_sqrt)


@triton.jit(do_not_specialize=["n_params", "n_chunks"])
def multi_tensor(ptrs, chunks, n_params, n_chunks, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1, bc2_sqrt,
                 P: tl.constexpr, G: tl.constexpr, TAIL: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)  # the chunk table, rows of n_chunks: the parameter, the block's start (, the parameter's size)
    j = tl.load(chunks + c)
    start = tl.multiple_of(tl.load(chunks + n_chunks + c), BLOCK)  # whole blocks, tails too
    # the pointer table, rows of n_params: the weight, gradient, master, exp_avg, exp_avg_sq of parameter j
    p_ptr = tl.load(ptrs + j).to(tl.pointer_type(P))
    g_ptr = tl.load(ptrs + n_params + j).to(tl.pointer_type(G))
    w_ptr = tl.load(ptrs + 2 * n_params + j).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(ptrs + 3 * n_params + j).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(ptrs + 4 * n_params + j).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # every address 16-byte aligned (the host checked): what Triton assumes of the pointer arguments it
        # specialises so, as it did the per-parameter kernel's; with whole unmasked blocks, vector loads and stores
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        w_ptr, m_ptr, v_ptr = tl.multiple_of(w_ptr, 16), tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    if TAIL:  # a parameter's last, partial block: masked by its size
        adamw(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, offs, offs < tl.load(chunks + 2 * n_chunks + c), lr, beta1, one_minus_beta1, beta2,
              one_minus_beta2, eps, decay, bc1, bc2_sqrt)
    else:
        adamw(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, offs, None, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1,
              bc2_sqrt)


def tl_dtype(dtype):
    """torch's floating dtype as Triton's."""
    return getattr(tl, str(dtype).removeprefix("torch."))
