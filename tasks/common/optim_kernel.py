"""The Triton step of tasks/common/optim.py's ``MasterAdamW`` (imported only where it runs).

``step``: one launch over every parameter of a step count, weight dtype and gradient dtype, a
program per ``BLOCK`` of one parameter, steered by the chunk and pointer tables that
``MasterAdamW._triton_step`` builds; ``adam``: a block's loads, arithmetic and stores, apart, so
that tests/test_optim.py's per-parameter reference launch runs the same lines.
"""

import triton
import triton.language as tl


@triton.jit
def adam(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, offs, keep, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1, bc2_sqrt):
    """The step of the elements ``offs`` (where ``keep``): reads the gradient, master and
    moments, writes them and the weight (the master rounded to nearest even)."""
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


@triton.jit(do_not_specialize=["n_params", "n_chunks"])
def step(ptrs, chunks, n_params, n_chunks, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1, bc2_sqrt,
         P: tl.constexpr, G: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)  # the chunk table, rows of n_chunks: the parameter, the block's start, the parameter's size
    j = tl.load(chunks + c)
    start = tl.multiple_of(tl.load(chunks + n_chunks + c), BLOCK)
    n = tl.load(chunks + 2 * n_chunks + c)
    # the pointer table, rows of n_params: the weight, gradient, master, exp_avg, exp_avg_sq of parameter j
    p_ptr = tl.load(ptrs + j).to(tl.pointer_type(P))
    g_ptr = tl.load(ptrs + n_params + j).to(tl.pointer_type(G))
    w_ptr = tl.load(ptrs + 2 * n_params + j).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(ptrs + 3 * n_params + j).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(ptrs + 4 * n_params + j).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # every address 16-byte aligned and every size a multiple of 16 (the host checked): what Triton assumes
        # of pointer and int arguments it specialises so, as it did the per-parameter kernel's: vector loads and stores
        n = tl.multiple_of(n, 16)
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        w_ptr, m_ptr, v_ptr = tl.multiple_of(w_ptr, 16), tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    keep = offs < n
    adam(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, offs, keep, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1, bc2_sqrt)


def dtype(torch_dtype):
    """A torch floating dtype as Triton's (the ``P`` / ``G`` constexprs)."""
    return getattr(tl, str(torch_dtype).removeprefix("torch."))
