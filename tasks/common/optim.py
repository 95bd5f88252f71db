"""AdamW over fp32 master weights of bf16 parameters: the learners' ``ppo.learner_weights`` 'bf16'.

The model holds bf16 weights, so its forward and backward read and write half the bytes of fp32
weights under autocast and cast no weight (DeepSpeed's bf16 mode; FSDP2's ``param_dtype`` does
the same from fp32 shards). The optimizer keeps an fp32 master of each parameter with its two
moments in ``state`` (``master``, ``exp_avg``, ``exp_avg_sq``, ``step``), steps the masters with
the bf16 gradients read as fp32, and writes each parameter back as its master rounded to nearest
even. The state is an ordinary optimizer state dict, so checkpoints carry the masters and a
resumed run continues bit for bit (``load_state_dict`` keeps them fp32: torch's would cast every
state tensor to the parameter's dtype).

The step: on CUDA one Triton pass over every parameter in two launches (``multi_tensor``, the
default: reads the gradient, master and moments, writes them and the bf16 weight, 28 bytes a
parameter as torch's fused AdamW on fp32 weights), or with ``multi_tensor=False`` the same pass
one launch a parameter. On an H100 at 0.4B (439 parameters, bench/RESULTS.md 2026-12-08) the two
launches took 6.6 ms of GPU time against 7.8, the step's span on the GPU 7.0 ms against 24, and
the learn epoch 1.11x faster (median, the two interleaved); elsewhere
(and for a parameter whose weight, gradient or state is not contiguous: the kernels index flat)
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
def _kernels():
    """(per_parameter, multi_tensor, tl_dtype) of tasks/common/optim_kernels.py, imported on first use."""
    from tasks.common import optim_kernels as k

    return k.per_parameter, k.multi_tensor, k.tl_dtype


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _contiguous(p: torch.Tensor, s: dict) -> bool:
    """Whether the weight, gradient and state of ``p`` are contiguous, as the Triton kernels index them."""
    return p.is_contiguous() and p.grad.is_contiguous() and all(s[k].is_contiguous() for k in STATE_KEYS)


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
    the parameters are on CUDA and triton is installed. ``multi_tensor`` (with the fused step): two
    launches for all the parameters of one step count and dtypes (``_multi_tensor_step``), not one
    a parameter."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, triton: bool | None = None, multi_tensor: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.triton, self.multi_tensor = triton, multi_tensor
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
            together = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self._state(p)
                # the kernels index flat: a weight, gradient or state that is not contiguous takes the torch ops
                fused = (self.triton if self.triton is not None else p.is_cuda and _has_triton()) and _contiguous(p, s)
                if fused and self.multi_tensor:
                    together.append((p, s))
                    continue
                s["step"] += 1
                step = float(s["step"])
                bc1, bc2_sqrt = 1 - b1 ** step, (1 - b2 ** step) ** 0.5
                w, m, v = s["master"], s["exp_avg"], s["exp_avg_sq"]
                if fused:
                    n = w.numel()
                    _kernels()[0][(-(-n // BLOCK),)](p, p.grad, w, m, v, n, lr, b1, 1 - b1, b2, 1 - b2, eps, 1 - lr * wd, bc1, bc2_sqrt,
                                                     BLOCK=BLOCK)
                    continue
                g = p.grad.float()  # torch.optim.AdamW's single-tensor step, op for op
                w.mul_(1 - lr * wd)
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                w.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-lr / bc1)
                p.copy_(w)  # round to nearest even
            if together:
                self._multi_tensor_step(together, lr, b1, b2, eps, wd)
        return loss

    def _multi_tensor_step(self, members: list, lr: float, b1: float, b2: float, eps: float, wd: float) -> None:
        """The fused step of ``members`` ((parameter, state) pairs) in two launches for each step
        count, weight and gradient dtype and device (one of each, unless some parameter missed a
        step): every whole ``BLOCK`` of every parameter unmasked, 16-byte vector accesses where
        every address is 16-byte aligned, then each parameter's partial last block, masked. One
        launch with masks throughout would be all scalar accesses: Triton cannot prove a mask
        constant over a vector when the size comes from memory (bench/RESULTS.md, 2026-12-07,
        fourteenth session: the PTX of both forms). Each program finds its parameter in a chunk
        table (cached, from the sizes) and its addresses in a pointer table built each step (the
        gradients come and go), copied from pinned memory without a wait."""
        _, kernel, tl_dtype = _kernels()
        steps = [s["step"] for _, s in members]
        torch._foreach_add_(steps, 1)  # the CPU step tensors, as += 1 on each
        launches: dict = {}
        for (p, s), step in zip(members, torch.stack(steps).tolist()):
            launches.setdefault((step, p.dtype, p.grad.dtype, p.device), []).append((p, s))
        for (step, p_dtype, g_dtype, device), group in launches.items():
            ptrs = [p.data_ptr() for p, _ in group] + [p.grad.data_ptr() for p, _ in group]
            ptrs += [s[k].data_ptr() for k in STATE_KEYS for _, s in group]
            # the tensors behind the addresses live on in p.grad and the state (a gradient freed after the step is reused
            # only in stream order, after the kernels)
            table = torch.tensor(ptrs, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
            args = (lr, b1, 1 - b1, b2, 1 - b2, eps, 1 - lr * wd, 1 - b1 ** step, (1 - b2 ** step) ** 0.5)
            consts = dict(P=tl_dtype(p_dtype), G=tl_dtype(g_dtype), ALIGNED=not any(a % 16 for a in ptrs), BLOCK=BLOCK)
            whole, tails = self._chunks(tuple(p.numel() for p, _ in group), device)
            for chunks, tail in ((whole, False), (tails, True)):
                if chunks.shape[1]:
                    kernel[(chunks.shape[1],)](table, chunks, len(group), chunks.shape[1], *args, TAIL=tail, **consts)

    def _chunks(self, numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk tables of parameters of these sizes, int64 on ``device``: every whole block
        (2, blocks: its parameter, its start) and every partial last block (3, tails: its
        parameter, its start, the parameter's size); cached (a few sets of sizes at most)."""
        key = (numels, device, BLOCK)
        if key not in self._chunk_tables:
            if len(self._chunk_tables) >= 8:
                self._chunk_tables.clear()
            n = torch.tensor(numels, dtype=torch.int64)
            count = n // BLOCK
            param = torch.repeat_interleave(torch.arange(len(numels)), count)
            start = (torch.arange(len(param)) - (count.cumsum(0) - count)[param]) * BLOCK
            partial = (n % BLOCK).nonzero().squeeze(1)
            tails = torch.stack([partial, count[partial] * BLOCK, n[partial]])
            self._chunk_tables[key] = torch.stack([param, start]).to(device), tails.to(device)
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
