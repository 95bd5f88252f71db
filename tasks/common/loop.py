"""Pieces of a data-parallel training loop that SFT and the reward model share.

Data order follows ``torch.utils.data.DistributedSampler`` (shuffle with ``seed + epoch``,
``drop_last``): the order is a pure function of (seed, epoch, rank), so a resumed run only needs
the step to find its place. Everything here works with one process (no process group) too.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce across ranks (a no-op with one process); returns ``t``."""
    import torch.distributed as dist

    if rank_world()[1] > 1:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()))
    return t


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """This rank's micro-batches of record indices for ``epoch``.

    DistributedSampler(shuffle=True, seed=seed, drop_last=True): permute with a generator seeded
    ``seed + epoch``, drop the tail so every rank gets ``n // world`` records, take every
    ``world``-th from ``rank``. Then cut into batches of ``batch_size``; a short last batch is
    dropped too, so all ranks step in lock-step with equal batch shapes.
    """
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist()
    per_rank = n // world
    mine = order[: per_rank * world][rank::world]
    return [mine[i:i + batch_size] for i in range(0, per_rank - batch_size + 1, batch_size)]


def steps_per_epoch(n: int, batch_size: int, accumulation_steps: int, world: int) -> int:
    return ((n // world) // batch_size) // accumulation_steps


def check_batches(prefix: str, n: int, batch_size: int, accumulation_steps: int, world: int, split: str) -> int:
    """Optimizer steps per epoch; an error naming the fields when the split is too small for one."""
    spe = steps_per_epoch(n, batch_size, accumulation_steps, world)
    if spe == 0:
        raise ValueError(
            f"{prefix}.batch_size ({batch_size}) x {prefix}.accumulation_steps ({accumulation_steps}) x "
            f"{prefix}.num_workers ({world}) = {batch_size * accumulation_steps * world} records per step, "
            f"but {split} has {n}: lower them or give more data"
        )
    return spe


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int):
    """LambdaLR: linear warmup 0 -> peak over ``warmup_steps``, then cosine decay to 0 at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast(device: str):
    """bf16 autocast on CUDA; plain fp32 elsewhere."""
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def wrap_ddp(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """DDP when a process group is up, else the model itself."""
    if rank_world()[1] == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device.startswith("cuda") else None)


def no_sync(model: torch.nn.Module, last_micro: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last of a step."""
    if hasattr(model, "no_sync") and not last_micro:
        return model.no_sync()
    return nullcontext()


def max_weight_diff(params: list[torch.Tensor]) -> float:
    """Largest |w_rank - w_rank0| over ``params`` and ranks (0.0 with one process): DDP's invariant."""
    import torch.distributed as dist

    if rank_world()[1] == 1:
        return 0.0
    worst = torch.zeros((), dtype=torch.float64)
    for p in params:
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        worst = torch.maximum(worst, (p.detach() - ref).abs().max().double().cpu())
    return float(all_reduce(worst, "max"))


def gather_rng() -> list[torch.Tensor]:
    """Every rank's torch CPU RNG state (rank order), for a checkpoint rank 0 writes."""
    import torch.distributed as dist

    state = torch.get_rng_state()
    if rank_world()[1] == 1:
        return [state]
    out: list = [None] * rank_world()[1]
    dist.all_gather_object(out, state)
    return out


def check_store_reachable(prefix: str, num_workers: int, store) -> None:
    """memory:// lives in one process: Ray workers cannot publish into the caller's."""
    if num_workers > 1 and "memory" in (store.fs.protocol if isinstance(store.fs.protocol, tuple) else (store.fs.protocol,)):
        raise ValueError(
            f"{prefix}.num_workers ({num_workers}) > 1 runs on Ray workers, which cannot reach the "
            f"in-process store {store.uri!r}: use a file:// or s3:// store, or num_workers 1"
        )


def wants_gpu(requested: str) -> bool:
    return requested.startswith("cuda") or (requested == "auto" and torch.cuda.is_available())
