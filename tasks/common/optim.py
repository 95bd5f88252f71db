"""AdamW over fp32 master weights of bf16 parameters: the learners' ``ppo.learner_weights`` 'bf16'.

The model holds bf16 weights, so its forward and backward read and write half the bytes of fp32
weights under autocast and cast no weight (DeepSpeed's bf16 mode; FSDP2's ``param_dtype`` does
the same from fp32 shards). The optimizer keeps an fp32 master of each parameter with its two
moments in ``state`` (``master``, ``exp_avg``, ``exp_avg_sq``, ``step``), steps the masters with
the bf16 gradients read as fp32, and writes each parameter back as its master rounded to nearest
even. The state is an ordinary optimizer state dict, so checkpoints carry the masters and a
resumed run continues bit for bit (``load_state_dict`` keeps them fp32: torch's would cast every
state tensor to the parameter's dtype).

The step: on CUDA one Triton launch for all the parameters with gradients (of one step count,
weight dtype and gradient dtype: normally one launch a parameter group), each program one
``BLOCK`` of one parameter. Two small int64 device tables steer it: the chunk table (each
block's parameter, start and that parameter's size) depends on the sizes alone and is built once;
the pointer table (the addresses of each parameter's weight, gradient, master and moments) is
built on the host every step, since gradients come and go, and copied from pinned memory without
a wait. The kernel reads the gradient, master and moments and writes them and the bf16 weight
(28 bytes a parameter, as torch's fused AdamW on fp32 weights), fp32 op for op as the one pass a
parameter it replaces. Elsewhere, and for a parameter whose weight, gradient or state is not
contiguous (the kernel indexes flat), torch ops in the order of ``torch.optim.AdamW``'s
single-tensor step, so on the CPU the masters equal AdamW's on fp32 copies exactly. With
``weight_decay`` 0 (the PPO learners') it is Adam.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")  # fp32, per parameter
BLOCK = 4096


@functools.cache
def _kernel():
    """The Triton step (built once, on first use: triton is imported only where it runs) and
    torch's floating dtypes as Triton's."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_params", "n_chunks"])
    def kernel(ptrs, chunks, n_params, n_chunks, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, bc1, bc2_sqrt,
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

    return kernel, lambda dtype: getattr(tl, str(dtype).removeprefix("torch."))


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _contiguous(p: torch.Tensor, s: dict) -> bool:
    """Whether the weight, gradient and state of ``p`` are contiguous, as the kernel indexes them."""
    return (p.is_contiguous() and p.grad.is_contiguous() and s["master"].is_contiguous() and s["exp_avg"].is_contiguous()
            and s["exp_avg_sq"].is_contiguous())


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
        self._chunk_tables: dict = {}

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
            fused = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self._state(p)
                if (self.triton if self.triton is not None else p.is_cuda and _has_triton()) and _contiguous(p, s):
                    fused.append((p, s))
                    continue
                s["step"] += 1
                step = float(s["step"])
                bc1, bc2_sqrt = 1 - b1 ** step, (1 - b2 ** step) ** 0.5
                w, m, v = s["master"], s["exp_avg"], s["exp_avg_sq"]
                g = p.grad.float()  # torch.optim.AdamW's single-tensor step, op for op
                w.mul_(1 - lr * wd)
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                w.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-lr / bc1)
                p.copy_(w)  # round to nearest even
            if fused:
                self._triton_step(fused, lr, b1, b2, eps, wd)
        return loss

    def _triton_step(self, fused: list, lr: float, b1: float, b2: float, eps: float, wd: float) -> None:
        """One launch for the parameters (with their states) of each step count, weight and
        gradient dtype and device: a group's parameters share all four unless some missed steps."""
        kernel, tl_dtype = _kernel()
        steps = [s["step"] for _, s in fused]
        torch._foreach_add_(steps, 1)  # the CPU step tensors, as += 1 on each
        launches = {}
        for (p, s), step in zip(fused, torch.stack(steps).tolist()):
            launches.setdefault((step, p.dtype, p.grad.dtype, p.device), []).append((p, s))
        for (step, p_dtype, g_dtype, device), members in launches.items():
            bc1, bc2_sqrt = 1 - b1 ** step, (1 - b2 ** step) ** 0.5
            numels = tuple(p.numel() for p, _ in members)
            chunks = self._chunks(numels, device)
            if not chunks.shape[1]:
                continue
            ptrs = [p.data_ptr() for p, _ in members] + [p.grad.data_ptr() for p, _ in members]
            ptrs += [s[k].data_ptr() for k in STATE_KEYS for _, s in members]
            # the tensors behind the addresses live on in p.grad and the state (a gradient freed after the step is reused only
            # in stream order, after the kernel); the table goes from pinned memory, without a wait
            table = torch.tensor(ptrs, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
            aligned = not any(a % 16 for a in ptrs) and not any(n % 16 for n in numels)
            kernel[(chunks.shape[1],)](table, chunks, len(members), chunks.shape[1], lr, b1, 1 - b1, b2, 1 - b2, eps, 1 - lr * wd, bc1,
                                       bc2_sqrt, P=tl_dtype(p_dtype), G=tl_dtype(g_dtype), ALIGNED=aligned, BLOCK=BLOCK)

    def _chunks(self, numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The chunk table of parameters of these sizes: (3, blocks) int64 on ``device``, each
        block's parameter, start and parameter size; cached (a few sets of sizes at most)."""
        key = (numels, device, BLOCK)
        if key not in self._chunk_tables:
            if len(self._chunk_tables) >= 8:
                self._chunk_tables.clear()
            n = torch.tensor(numels, dtype=torch.int64)
            count = (n + BLOCK - 1) // BLOCK
            param = torch.repeat_interleave(torch.arange(len(numels)), count)
            start = (torch.arange(len(param)) - (count.cumsum(0) - count)[param]) * BLOCK
            self._chunk_tables[key] = torch.stack([param, start, n[param]]).to(device)
        return self._chunk_tables[key]

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
