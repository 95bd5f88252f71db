"""torch.distributed inside groups of Ray actors (the seed's DistributedTorchRayActor, redone).

Ray places the processes; torch.distributed does the collectives. Rank 0 finds its node's IP
and a free port and publishes them; the other ranks join that rendezvous. ``ray`` is imported
only inside the functions that need it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     local_rank: int = 0, backend: str | None = None, timeout_s: float = 600) -> None:
    """Set the standard env vars and start the process group (nccl on CUDA, gloo otherwise)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(local_rank))
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def placement_bundles(num_workers: int, cpus: float, gpus: float) -> list[dict[str, float]]:
    bundle = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    return [dict(bundle) for _ in range(num_workers)]


def run_data_parallel(fn: Callable[..., Any], num_workers: int, *args: Any, num_cpus: float = 1.0,
                      num_gpus: float = 0.0, placement: str = "PACK", **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_workers`` Ray actors forming one process group.

    Each actor gets its own bundle of a placement group; inside ``fn``, torch.distributed is
    initialised (``dist.get_rank()`` etc. work). Returns every rank's return value, rank order.
    An exception on any rank is raised here (Ray re-raises it), so Prefect retries see it.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group(placement_bundles(num_workers, num_cpus, num_gpus), strategy=placement)
    ray.get(pg.ready(), timeout=120)
    Worker = ray.remote(_DataParallelWorker)
    workers = [
        Worker.options(num_cpus=num_cpus, num_gpus=num_gpus,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
        for i in range(num_workers)
    ]
    try:
        addr, port = ray.get(workers[0].rendezvous.remote())
        return ray.get([w.run.remote(fn, i, num_workers, addr, port, args, kwargs) for i, w in enumerate(workers)])
    finally:
        for w in workers:
            ray.kill(w)
        remove_placement_group(pg)


class _DataParallelWorker:
    def rendezvous(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def run(self, fn, rank, world_size, addr, port, args, kwargs):
        import torch.distributed as dist

        init_distributed(rank, world_size, addr, port)
        try:
            return fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
