"""Where the PPO roles run and how their learners shard.

A ``RoleGroup`` is one role's Ray actors: a placement group with one bundle per worker (or, with
``ppo.colocate``, one placement group shared by all roles, bundle i holding worker i of every
role), and a torch.distributed group among them (rank 0 publishes MASTER_ADDR/PORT, the others
join; gloo on CPU, nccl on CUDA). Ray places, torch.distributed communicates, the strategy shards.

The strategy helpers at the bottom run inside the workers: ``wrap_learner`` (DDP / FSDP2 /
ColossalAI Booster), full state dicts for checkpoints, and the all-reduce that keeps sharded
ranks generating the same number of steps.
"""

from __future__ import annotations

import os
from typing import Any

from tasks.common.dist import free_port, init_distributed, node_ip, placement_bundles
from tasks.common.model import transformer_blocks
from tasks.ppo.config import ROLES, PPOConfig, RoleConfig


# ----------------------------------------------------------------------------- placement

def role_device(cfg: PPOConfig, role: str) -> str:
    """cuda for a role that holds GPUs (Ray sets CUDA_VISIBLE_DEVICES to them), else cpu."""
    return "cuda" if cfg.role(role).gpus_per_worker > 0 and cfg.device != "cpu" else "cpu"


def requested_resources(cfg: PPOConfig) -> dict[str, float]:
    """Total CPUs and GPUs the four role groups reserve."""
    cpus = sum(cfg.role(r).num_workers * cfg.role(r).cpus_per_worker for r in ROLES)
    gpus = sum(cfg.role(r).num_workers * cfg.role(r).gpus_per_worker for r in ROLES)
    return {"CPU": cpus, "GPU": gpus}


def check_cluster(cfg: PPOConfig) -> None:
    """Fail before any placement group exists when the Ray cluster cannot hold the roles."""
    import ray

    have = ray.cluster_resources()
    need = requested_resources(cfg)
    per_role = ", ".join(f"{r} {cfg.role(r).num_workers}x{cfg.role(r).gpus_per_worker}" for r in ROLES)
    if need["GPU"] > have.get("GPU", 0.0) + 1e-9:
        raise ValueError(
            f"ppo roles ask for {need['GPU']:g} GPUs ({per_role}) but the Ray cluster has "
            f"{have.get('GPU', 0.0):g}: set ppo.<role>.gpus_per_worker to 0 on a CPU cluster, use fractions "
            "with ppo.colocate=true on a small GPU machine, or connect to a cluster with GPUs (ray.address)"
        )
    if need["CPU"] > have.get("CPU", 0.0) + 1e-9:
        raise ValueError(
            f"ppo roles ask for {need['CPU']:g} CPUs (sum of num_workers x cpus_per_worker) but the Ray cluster "
            f"has {have.get('CPU', 0.0):g}: lower ppo.<role>.cpus_per_worker (e.g. 0.5) or start Ray with more CPUs (ray.num_cpus)"
        )


def create_placement_groups(cfg: PPOConfig) -> dict[str, Any]:
    """role -> its placement group (the same one for every role with colocate); waits until placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if cfg.colocate:
        # bundle i: the sum of worker i of every role that has an i-th worker
        n = max(cfg.role(r).num_workers for r in ROLES)
        bundles = []
        for i in range(n):
            roles = [cfg.role(r) for r in ROLES if cfg.role(r).num_workers > i]
            b = {"CPU": sum(x.cpus_per_worker for x in roles)}
            if any(x.gpus_per_worker for x in roles):
                b["GPU"] = sum(x.gpus_per_worker for x in roles)
            bundles.append(b)
        pg = placement_group(bundles, strategy=cfg.placement, name="ppo-colocated")
        groups = {r: pg for r in ROLES}
    else:
        groups = {}
        for r in ROLES:
            rc = cfg.role(r)
            groups[r] = placement_group(placement_bundles(rc.num_workers, rc.cpus_per_worker, rc.gpus_per_worker),
                                        strategy=cfg.placement, name=f"ppo-{r}")
    unique = list({id(pg): pg for pg in groups.values()}.values())
    ready, _ = ray.wait([pg.ready() for pg in unique], num_returns=len(unique), timeout=120)
    if len(ready) < len(unique):
        for pg in unique:
            remove_placement_group(pg)
        raise TimeoutError(
            f"ppo placement groups not placed within 120 s (strategy {cfg.placement}, colocate={cfg.colocate}): "
            "the cluster has the resources in total but not in the shape asked; try placement PACK"
        )
    return groups


class RoleGroup:
    """``num_workers`` Ray actors of one role class, rank i on bundle i, in one torch process group."""

    def __init__(self, name: str, worker_cls: type, role: RoleConfig, pg, strategy: str, seed: int, device: str):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=role.cpus_per_worker, num_gpus=role.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(name, i, role.num_workers, strategy, seed, role.cpus_per_worker, device)
            for i in range(role.num_workers)
        ]

    def connect(self) -> list:
        """Refs that resolve once the group's process group is up (rank 0 hosts the rendezvous)."""
        import ray

        addr, port = ray.get(self.workers[0].rendezvous.remote())
        # init_process_group blocks until every rank joined: submit all, let the caller wait
        return [w.init_group.remote(addr, port) for w in self.workers]

    def __len__(self) -> int:
        return len(self.workers)

    def deal(self, j: int):
        """The worker that gets chunk ``j`` (round-robin)."""
        return self.workers[j % len(self.workers)]

    def kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)


class DistributedWorker:
    """What every role actor shares: its rank, the process group, device and thread count."""

    def __init__(self, role: str, rank: int, world_size: int, strategy: str, seed: int, cpus: float, device: str):
        import torch

        self.role, self.rank, self.world_size, self.strategy = role, rank, world_size, strategy
        self.seed, self.device = seed, device
        torch.set_num_threads(max(1, int(cpus)))
        torch.manual_seed(seed + 1000 * rank)

    def rendezvous(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def init_group(self, addr: str, port: int) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        if self.strategy.startswith("colossalai") and self.role in ("actor", "critic"):
            import colossalai

            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(self.world_size),
                              RANK=str(self.rank), LOCAL_RANK="0")
            colossalai.launch_from_torch(seed=self.seed)
            return
        # by the role's device, not torch.cuda.is_available(): Ray leaves the GPUs visible to actors
        # that reserved none, and gloo is what CPU tensors need
        init_distributed(self.rank, self.world_size, addr, port, backend="nccl" if self.device == "cuda" else "gloo")

    def memory_stats(self) -> dict[str, float]:
        """This actor's peak memory in GiB: on CUDA what its torch allocated and reserved
        (``torch.cuda.max_memory_allocated``), on CPU the process's peak resident set size."""
        import resource

        import torch

        if self.device != "cuda":
            return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                "allocated_gib": torch.cuda.memory_allocated() / 2**30}


# ----------------------------------------------------------------------------- strategies

def compile_blocks(model) -> int:
    """Regional compilation: ``torch.compile`` every transformer block of ``model`` in place.

    Blocks of one shape share one compiled graph (their parameters are graph inputs), so a
    24-layer model costs one layer's compile; the mask building and the loss around the blocks
    stay eager. Forwards must pass ``use_cache=False``: a KV cache's per-layer index would force
    one compile per layer. Returns the number of blocks compiled.
    """
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)


def wants_compile(mode: str, device: str) -> bool:
    """``ppo.compile``: 'auto' = on for CUDA roles, 'on' = everywhere (CPU too), 'off'."""
    return mode == "on" or (mode == "auto" and device == "cuda")


def wrap_learner(model, lr: float, strategy: str, device: str):
    """(model to train, optimizer, model to run inference on) for one learner rank.

    ddp: DistributedDataParallel; inference (generation) runs on the unwrapped module, with no
    collectives. fsdp: FSDP2 ``fully_shard`` per block and at the root; every forward gathers
    parameters, so all ranks must run the same number of forwards (see ``agree_finished``).
    colossalai_*: Booster with LowLevelZeroPlugin(stage 2) or GeminiPlugin, HybridAdam (seed).
    """
    import torch

    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, device_ids=[0] if device == "cuda" else None)
        return wrapped, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr), model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for unit in transformer_blocks(model):
            fully_shard(unit)
        fully_shard(model)
        return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr), model
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
    from colossalai.nn.optimizer import HybridAdam

    plugin = LowLevelZeroPlugin(stage=2, placement_policy="cpu") if strategy == "colossalai_zero2" else \
        GeminiPlugin(initial_scale=2**5, offload_optim_frac=1.0, offload_param_frac=1.0)
    booster = Booster(plugin=plugin)
    optim = HybridAdam([p for p in model.parameters() if p.requires_grad], lr=lr, clipping_norm=1.0)
    wrapped, optim, *_ = booster.boost(model, optim)
    return wrapped, optim, wrapped.unwrap()


def agree_finished(strategy: str, device: str):
    """For sharded strategies: stop generating only when every rank is done (MIN all-reduce)."""
    if strategy == "ddp":
        return None
    import torch
    import torch.distributed as dist

    def all_finished(local_done: bool) -> bool:
        t = torch.tensor([1 if local_done else 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    return all_finished


def full_state(model, optimizer=None) -> tuple[dict, dict | None]:
    """Trainable weights and optimizer state as full (unsharded) CPU tensors, keyed by parameter
    name. Collective for sharded models: every rank calls it; rank 0's copy is complete."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=opts)
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    return weights, optim


def load_full_state(model, weights: dict, optimizer=None, optim_state: dict | None = None) -> None:
    """Inverse of ``full_state``; every rank passes the same full dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, strict=False)
    missing = set_model_state_dict(model, weights, options=opts)
    assert not missing.unexpected_keys, f"checkpoint weights not in the model: {missing.unexpected_keys[:5]}"
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
