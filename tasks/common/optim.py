"""AdamW over fp32 master weights of bf16 parameters: the learners' ``ppo.learner_weights`` 'bf16'.

The model holds bf16 weights, so its forward and backward read and write half the bytes of fp32
weights under autocast and cast no weight (DeepSpeed's bf16 mode; FSDP2's ``param_dtype`` does
the same from fp32 shards). The optimizer keeps an fp32 master of each parameter with its two
moments in ``state`` (``master``, ``exp_avg``, ``exp_avg_sq``, ``step``), steps the masters with
the bf16 gradients read as fp32, and writes each parameter back as its master rounded to nearest
even. The state is an ordinary optimizer state dict, so checkpoints carry the masters and a
resumed run continues bit for bit (``load_state_dict`` keeps them fp32: torch's would cast every
state tensor to the parameter's dtype).

The step: on CUDA one Triton pass a parameter (reads the gradient, master and moments, writes
them and the bf16 weight: 28 bytes a parameter, as torch's fused AdamW on fp32 weights); elsewhere
torch ops in the order of ``torch.optim.AdamW``'s single-tensor step, so on the CPU the masters
equal AdamW's on fp32 copies exactly. With ``weight_decay`` 0 (the PPO learners') it is Adam.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")  # fp32, per parameter
BLOCK = 4096


@functools.cache
def _kernel():
    """The Triton step (built once, on first use: triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, n, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1, bc2_sqrt,
               BLOCK: tl.constexpr):
        # 1 - beta comes in from the host: in fp32 on the GPU, 1 - 0.999 is 1.3e-5 off
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        g = tl.load(g_ptr + offs, mask=keep).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=keep) * decay
        m = beta1 * tl.load(m_ptr + offs, mask=keep) + one_minus_beta1 * g
        v = beta2 * tl.load(v_ptr + offs, mask=keep) + one_minus_beta2 * g * g
        w = w - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(w_ptr + offs, w, mask=keep)
        tl.store(m_ptr + offs, m, mask=keep)
        tl.store(v_ptr + offs, v, mask=keep)
        tl.store(p_ptr + offs, w.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)

    return kernel


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def params_to_bf16(model: torch.nn.Module) -> None:
    """Every floating-point parameter of ``model`` to bf16, in place, trainable or frozen (a
    policy's frozen KL-reference adapter computes as its trainable twin does); buffers (RoPE's
    fp32 ``inv_freq``) stay as they are."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on fp32 masters of the parameters (module docstring).
    ``triton``: the fused step (True also on CPU tensors, in Triton's interpreter); None = where
    the parameters are on CUDA and triton is installed."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, triton: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.triton = triton

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            master = p.detach().float().clone()
            state.update(step=torch.tensor(0.0), master=master, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self._state(p)
                s["step"] += 1
                step = float(s["step"])
                bc1, bc2_sqrt = 1 - b1 ** step, (1 - b2 ** step) ** 0.5
                w, m, v = s["master"], s["exp_avg"], s["exp_avg_sq"]
                if self.triton if self.triton is not None else p.is_cuda and _has_triton():
                    n = w.numel()
                    _kernel()[(-(-n // BLOCK),)](p, p.grad, w, m, v, n, lr, b1, 1 - b1, b2, 1 - b2, eps, 1 - lr * wd, bc1, bc2_sqrt,
                                                 BLOCK=BLOCK)
                    continue
                g = p.grad.float()  # torch.optim.AdamW's single-tensor step, op for op
                w.mul_(1 - lr * wd)
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                w.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-lr / bc1)
                p.copy_(w)  # round to nearest even
        return loss

    def masters(self):
        """(parameter, its fp32 master) of every parameter stepped so far (the rest equal their weights)."""
        return [(p, self.state[p]["master"]) for g in self.param_groups for p in g["params"] if self.state.get(p)]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, with the masters and moments kept fp32 (torch casts state to each parameter's dtype)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        super().load_state_dict(state_dict)
        for i, p in zip(ids, params):
            for k in STATE_KEYS if i in saved else ():
                self.state[p][k] = saved[i][k].to(p.device, torch.float32, copy=True)
