"""Where the PPO roles run and how their learners shard.

A ``RoleGroup`` is one role's Ray actors, each on its bundle of the one placement group of all
roles (one bundle per worker; with ``ppo.colocate``, bundle i holds worker i of every role), and
a torch.distributed group among them (rank 0 publishes MASTER_ADDR/PORT, the others
join; gloo on CPU, nccl on CUDA). Ray places, torch.distributed communicates, the strategy shards.

The strategy helpers at the bottom run inside the workers: ``wrap_learner`` (DDP / FSDP2 /
ColossalAI Booster), full state dicts for checkpoints, and the all-reduce that keeps sharded
ranks generating the same number of steps.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from tasks.common.dist import free_port, init_distributed, node_ip, placement_bundles
from tasks.common.model import allow_recompiles, transformer_blocks
from tasks.ppo.config import PPOConfig, RoleConfig

log = logging.getLogger("rlhf.ppo")


# ----------------------------------------------------------------------------- placement

def role_device(cfg: PPOConfig, role: str) -> str:
    """cuda for a role that holds GPUs (Ray sets CUDA_VISIBLE_DEVICES to them), else cpu."""
    return "cuda" if cfg.role(role).gpus_per_worker > 0 and cfg.device != "cpu" else "cpu"


def requested_resources(cfg: PPOConfig) -> dict[str, float]:
    """Total CPUs and GPUs the started role groups reserve."""
    cpus = sum(cfg.role(r).num_workers * cfg.role(r).cpus_per_worker for r in cfg.started_roles)
    gpus = sum(cfg.role(r).num_workers * cfg.role(r).gpus_per_worker for r in cfg.started_roles)
    return {"CPU": cpus, "GPU": gpus}


def check_cluster(cfg: PPOConfig) -> None:
    """Fail before any placement group exists when the Ray cluster cannot hold the roles."""
    import ray

    have = ray.cluster_resources()
    need = requested_resources(cfg)
    per_role = ", ".join(f"{r} {cfg.role(r).num_workers}x{cfg.role(r).gpus_per_worker}" for r in cfg.started_roles)
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


def role_bundles(cfg: PPOConfig) -> tuple[list[dict[str, float]], dict[str, int], list[str]]:
    """The one placement group of the PPO roles: (bundles, role -> index of its first bundle,
    a label per bundle for errors).

    Separate: one bundle per worker, role after role, so ``ppo.placement`` acts across all of
    them (STRICT_SPREAD: every worker on its own node; STRICT_PACK: all on one node). Colocate:
    bundle i holds worker i of every role that has one, so those share a node (and its GPUs).
    Only the roles that start (``cfg.started_roles``) hold bundles.
    """
    roles = cfg.started_roles
    if not cfg.colocate:
        bundles, first, labels = [], {}, []
        for r in roles:
            rc = cfg.role(r)
            first[r] = len(bundles)
            bundles += placement_bundles(rc.num_workers, rc.cpus_per_worker, rc.gpus_per_worker)
            labels += [f"{r} worker {i}" for i in range(rc.num_workers)]
        return bundles, first, labels
    bundles, labels = [], []
    for i in range(max(cfg.role(r).num_workers for r in roles)):
        here = [r for r in roles if cfg.role(r).num_workers > i]
        b = {"CPU": sum(cfg.role(r).cpus_per_worker for r in here)}
        if any(cfg.role(r).gpus_per_worker for r in here):
            b["GPU"] = sum(cfg.role(r).gpus_per_worker for r in here)
        bundles.append(b)
        labels.append(f"worker {i} of {'+'.join(here)}")
    return bundles, {r: 0 for r in roles}, labels


def _fits(bundle: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def unplaceable(bundles: list[dict[str, float]], labels: list[str], strategy: str,
                nodes: dict[str, dict[str, float]]) -> str | None:
    """Why ``bundles`` can never be placed on ``nodes`` (node -> total resources), or None.

    Exact for a bundle larger than every node, STRICT_PACK (the sum on one node) and STRICT_SPREAD
    (distinct nodes: a bipartite matching); PACK and SPREAD may still wait for resources in use.
    """
    for b, label in zip(bundles, labels):
        if not any(_fits(b, have) for have in nodes.values()):
            return f"bundle {label} {_fmt(b)} fits on no node"
    if strategy == "STRICT_PACK":
        total = {k: sum(b.get(k, 0.0) for b in bundles) for b in bundles for k in b}
        if not any(_fits(total, have) for have in nodes.values()):
            return f"STRICT_PACK needs {_fmt(total)} on one node"
    if strategy == "STRICT_SPREAD":
        owner: dict[str, int] = {}  # node -> bundle (Kuhn's augmenting paths)

        def place(i: int, seen: set) -> bool:
            for n, have in nodes.items():
                if n not in seen and _fits(bundles[i], have):
                    seen.add(n)
                    if n not in owner or place(owner[n], seen):
                        owner[n] = i
                        return True
            return False

        for i, label in enumerate(labels):
            if not place(i, set()):
                return (f"STRICT_SPREAD puts each of the {len(bundles)} bundles on its own node and bundle {label} "
                        f"{_fmt(bundles[i])} finds no node left")
    return None


def cluster_nodes() -> dict[str, dict[str, float]]:
    """Alive nodes of the connected Ray cluster: 'ip (id prefix)' -> total CPU/GPU."""
    import ray

    return {f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})": {k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU")}
            for n in ray.nodes() if n["Alive"]}


def create_placement_groups(cfg: PPOConfig, timeout_s: float = 120) -> dict[str, Any]:
    """role -> the PPO placement group (one for all roles, see ``role_bundles``); waits until placed.

    A shape the cluster can never hold fails at once, naming the bundle and every node; one that
    only waits on resources in use fails after ``timeout_s`` with the same account.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles, _, labels = role_bundles(cfg)
    nodes = cluster_nodes()
    shape = f"ppo.placement {cfg.placement} (colocate={cfg.colocate}) of {len(bundles)} bundles"
    has = "the cluster has " + "; ".join(f"{n} {_fmt(r)}" for n, r in nodes.items())
    if (why := unplaceable(bundles, labels, cfg.placement, nodes)) is not None:
        raise ValueError(f"{shape} can never be placed: {why}; {has}. Add nodes, lower ppo.<role>.num_workers or "
                         "cpus_per_worker/gpus_per_worker, or use placement PACK or SPREAD")
    pg = placement_group(bundles, strategy=cfg.placement, name="ppo-roles")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(f"{shape} not placed within {timeout_s:g} s: resources are in use by other work; "
                           f"{has} in total, {_fmt(ray.available_resources())} free now")
    return {r: pg for r in cfg.started_roles}


# Ray marks a lost node dead only once its health checks have failed, ~15 s with the defaults
# (a check every 3 s, dead after 5 missed); the wait for that is bounded by this
NODE_DEATH_WAIT_S = 60.0


def actor_system_failure(err: BaseException | None):
    """The RayActorError in ``err`` or its causes that is a failure of the actor's process or node
    (unreachable, or died), not an exception raised in its ``__init__``; else None."""
    from ray.exceptions import RayActorError

    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, RayActorError) and not err.actor_init_failed:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def start_roles_on_live_nodes(cfg: PPOConfig, start: Callable[[dict], dict],
                              wait_s: float = NODE_DEATH_WAIT_S) -> tuple[dict, dict]:
    """(placement groups, role groups): the roles placed (``create_placement_groups``) and
    started (``start(pgs)`` returns the groups), placed a second time if a node was lost meanwhile.

    Why: a lost node counts as alive until Ray's health checks mark it dead (~15 s by default),
    and a Prefect retry of this stage comes sooner (2 s by default), so its roles could be placed
    on that node and be unreachable (the likely cause of an ActorUnavailableError seen once in CI). So when starting
    fails with a failure of an actor's process (``actor_system_failure``), and a node the group
    was placed on is dead, or is marked dead within ``wait_s`` (for an unreachable actor, whose
    node Ray may not have marked yet), the group is removed (killing the roles started in it) and
    the roles are placed once more on the nodes left, in the same attempt, with one warning. Any
    other failure removes the group and raises as it came.
    """
    import ray
    from ray.exceptions import ActorUnavailableError
    from ray.util import placement_group_table
    from ray.util.placement_group import remove_placement_group

    for attempt in (1, 2):
        pgs = create_placement_groups(cfg)
        pg = next(iter(pgs.values()))
        placed_on = set(placement_group_table(pg)["bundles_to_node_id"].values())
        try:
            return pgs, start(pgs)
        except BaseException as err:
            remove_placement_group(pg)
            failure = actor_system_failure(err)
            if failure is None or attempt == 2:
                raise
            unreachable = isinstance(failure, ActorUnavailableError)  # a died actor's node is known at once
            t0 = time.monotonic()
            while not (lost := [n for n in ray.nodes() if n["NodeID"] in placed_on and not n["Alive"]]) \
                    and unreachable and time.monotonic() - t0 < wait_s:
                time.sleep(0.5)
            if not lost and not unreachable:
                raise
            if not lost:
                raise TimeoutError(
                    f"ppo roles failed to start ({type(err).__name__}: {(str(err).splitlines() or [''])[0]}) and none "
                    f"of the nodes they were placed on ({', '.join(sorted(n[:8] for n in placed_on))}) was marked "
                    f"dead by Ray within {wait_s:g} s: not a lost node") from err
            log.warning("ppo roles failed to start (%s): node %s (%s) was lost (marked dead by Ray after %.0f s); "
                        "placing them again on the nodes left", type(failure).__name__, lost[0]["NodeManagerAddress"],
                        lost[0]["NodeID"][:8], time.monotonic() - t0)


class RoleGroup:
    """``num_workers`` Ray actors of one role class, rank i on bundle ``first_bundle + i``, in one
    torch process group."""

    def __init__(self, name: str, worker_cls: type, role: RoleConfig, pg, strategy: str, seed: int, device: str,
                 first_bundle: int = 0):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=role.cpus_per_worker, num_gpus=role.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + i),
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

    def deal(self, method: str, chunks: list) -> list:
        """Refs to ``method`` on ``chunks``, in chunk order: chunk j goes to worker j % n
        (round-robin), and each worker gets one call with all of its chunks as arguments, giving
        one Ray return per chunk (the scoring methods of tasks/ppo/roles.py)."""
        n, refs = len(self.workers), [None] * len(chunks)
        for i, w in enumerate(self.workers[:len(chunks)]):
            mine = range(i, len(chunks), n)
            out = getattr(w, method).options(num_returns=len(mine)).remote(*(chunks[j] for j in mine))
            for j, ref in zip(mine, [out] if len(mine) == 1 else out):  # num_returns=1: one ref, not a list
                refs[j] = ref
        return refs

    def kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)


def as_returns(outs: list):
    """A worker method's ``outs`` as its Ray returns (``num_returns=len(outs)``, ``RoleGroup.deal``):
    one as itself, since a single return is the value, not a 1-tuple."""
    return outs[0] if len(outs) == 1 else tuple(outs)


class DistributedWorker:
    """What every role actor shares: its rank, the process group, device and thread count."""

    def __init__(self, role: str, rank: int, world_size: int, strategy: str, seed: int, cpus: float, device: str):
        import torch

        from tasks.common.model import no_cudnn_attention

        self.role, self.rank, self.world_size, self.strategy = role, rank, world_size, strategy
        self.seed, self.device = seed, device
        no_cudnn_attention(device)  # every role's forwards, models loaded on the CPU first too
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

def compile_blocks(model, mode: str | None = None) -> int:
    """Regional compilation: ``torch.compile`` every transformer block of ``model`` in place
    (``mode``: torch.compile's, e.g. 'reduce-overhead' for CUDA graphs; the stage uses the default).

    Blocks of one shape share one compiled graph (their parameters are graph inputs), so a
    24-layer model costs one layer's compile; the mask building and the loss around the blocks
    stay eager. Forwards must pass ``use_cache=False``: a KV cache's per-layer index would force
    one compile per layer. Returns the number of blocks compiled.

    That graph has a version per way the process calls it: with and without grad, the first block
    apart under a frozen embedding (its input needs no grad), a LoRA model's adapters on and off
    (the shared reference), static then dynamic shapes: the actor alone makes 8, dynamo's default
    limit, past which every new one silently runs eagerly (packed rows beside unpacked ones, or a
    second model of the same layer class in the process: ``hit config.recompile_limit (8)`` in
    bench/useful_mfu.py on an H100, whose next variant then ran eagerly). The limit is raised
    (``allow_recompiles``).
    """
    allow_recompiles()
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(mode=mode)
    return len(blocks)


COMPILE_AUTO_MIN_PARAMS = 50_000_000


def wants_compile(mode: str, device: str, model=None, strategy: str = "ddp") -> bool:
    """``ppo.compile``: 'auto' = on for CUDA roles of models of 50M parameters or more (below
    that, compiling costs more than the run: 32 s for the built-in 0.1M model on an H200, whose
    30 iterations then take 7 s) but not under colossalai_gemini, whose chunk hooks in the forward
    do not trace (PPOConfig refuses 'on' with it), 'on' = everywhere (CPU too), 'off'."""
    if mode != "auto":
        return mode == "on"
    if strategy == "colossalai_gemini":
        return False
    return device == "cuda" and (model is None or sum(p.numel() for p in model.parameters()) >= COMPILE_AUTO_MIN_PARAMS)


def fp32_all_reduce(state, bucket):
    """DDP communication hook: a bucket of bf16 gradients averaged across ranks in fp32 (DDP's own
    hook sums in the bucket's dtype), written back rounded, as FSDP's ``reduce_dtype`` fp32 does."""
    import torch.distributed as dist

    grads = bucket.buffer()
    wide = grads.float().div_(dist.get_world_size())

    def written_back(fut):
        return grads.copy_(fut.value()[0])

    return dist.all_reduce(wide, async_op=True).get_future().then(written_back)


def wrap_learner(model, lr: float, strategy: str, device: str, max_norm: float = 1.0, offload: str = "seed", bf16: bool = False):
    """(model to train, optimizer, model to run inference on) for one learner rank.

    ddp: DistributedDataParallel; inference (generation) runs on the unwrapped module, with no
    collectives. fsdp: FSDP2 ``fully_shard`` per block and at the root; every forward gathers
    parameters, so all ranks must run the same number of forwards (see ``agree_finished``).
    ``bf16`` (``PPOConfig.bf16_learners``): ddp casts the parameters to bf16, steps fp32 masters of
    the trainable ones (``MasterAdamW``) and averages the bf16 gradients in fp32
    (``fp32_all_reduce``); fsdp keeps fp32 shards as the masters, gathers them as bf16 and reduces
    the gradients in fp32 (``MixedPrecisionPolicy``).
    colossalai_*: Booster with LowLevelZeroPlugin (stage 2) or GeminiPlugin, HybridAdam, bf16 (seed);
    ``offload`` (ppo.colossalai_offload) 'seed' offloads the optimizer state (ZeRO-2) or the
    parameters and the optimizer state (Gemini) to the CPU, 'optimizer' only the optimizer
    state, 'none' nothing (HybridAdam then steps with its fused CUDA kernel). The ZeRO
    optimizers own the gradients: the step must call ``optimizer.backward(loss)`` and clipping is
    the plugin's ``max_norm`` (torch's ``clip_grad_norm_`` does not see sharded gradients).
    ZeRO-2 keeps every parameter whole on every rank, so inference runs on the unwrapped PEFT
    model; Gemini keeps parameters in chunks that only its own forward gathers, so inference runs
    on the wrapped model (every rank the same forwards, like fsdp), and rollouts on a
    ``plain_copy`` of it where FastGenerator applies.
    """
    import torch

    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from tasks.common.optim import MasterAdamW, params_to_bf16

        if bf16:
            params_to_bf16(model)  # before DDP: its buckets take the parameters' dtype
        wrapped = DDP(model, device_ids=[0] if device == "cuda" else None)
        if bf16 and torch.distributed.get_world_size() > 1:  # (one rank: nothing to average, no copies)
            wrapped.register_comm_hook(None, fp32_all_reduce)
        params = [p for p in model.parameters() if p.requires_grad]
        return wrapped, MasterAdamW(params, lr=lr) if bf16 else torch.optim.Adam(params, lr=lr), model
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for unit in transformer_blocks(model):
            fully_shard(unit, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr), model
    # every ColossalAI import of this project is in this module: colossalai_imports() reads them
    # from here for the preflight check, so a new one is checked the day it is written
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
    from colossalai.nn.optimizer import HybridAdam

    optim_frac, param_frac = {"seed": (1.0, 1.0), "optimizer": (1.0, 0.0), "none": (0.0, 0.0)}[offload]
    plugin = LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=max_norm, cpu_offload=optim_frac > 0) \
        if strategy == "colossalai_zero2" else \
        GeminiPlugin(precision="bf16", max_norm=max_norm, offload_optim_frac=optim_frac, offload_param_frac=param_frac)
    booster = Booster(plugin=plugin)
    optim = HybridAdam([p for p in model.parameters() if p.requires_grad], lr=lr)
    wrapped, optim, *_ = booster.boost(model, optim)
    # unwrap_peft=False: the PeftModel itself (its adapters are switched for the KL reference)
    return wrapped, optim, wrapped.unwrap(unwrap_peft=False) if strategy == "colossalai_zero2" else wrapped


def plain_copy(module, device):
    """A copy of ``module`` for inference only, whose every parameter is a plain frozen tensor:
    the frozen ones share their storage with ``module``'s, the trainable ones get storage of their
    own (uninitialised: fill it with ``load_trainable``), buffers are cloned.

    It is how Gemini's actor decodes with FastGenerator: Gemini turns every parameter into a
    ColoParameter whose ops run through Python hooks (at 0.3B on an H200, everything offloaded, its
    first evaluation, 64 tokens through the plain loop, ended 73 s after the roles were placed) and keeps the trainable ones in chunks that hold data only inside that forward,
    while the frozen ones (the LoRA actor's base) stay whole bf16 tensors on the GPU, outside the
    chunks. So the copy costs the trainable weights only (the LoRA adapters: MBs)."""
    import copy

    import torch

    memo = {}
    for p in module.parameters():
        data = p.data  # .data is a plain tensor (ColossalAI's tensors leave it unwrapped)
        memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=data.dtype, device=device) if p.requires_grad else data,
                                         requires_grad=False)
    out = copy.deepcopy(module, memo)
    out.rollout_owned = sorted(n for n, p in module.named_parameters() if p.requires_grad)  # what load_trainable must fill
    return out


def load_trainable(copy, weights: dict) -> None:
    """Write ``weights`` (name -> tensor, as ``full_state`` returns the trainable ones) into the
    parameters of ``plain_copy``'s copy, cast to each one's dtype."""
    import torch

    params = dict(copy.named_parameters())
    unknown = sorted(set(weights) - set(params))
    assert not unknown, f"weights not in the rollout copy: {unknown[:5]}"
    missing = sorted(set(copy.rollout_owned) - set(weights))  # their storage would stay uninitialised
    assert not missing, f"trainable weights of the rollout copy not given: {missing[:5]}"
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(w)


# ----------------------------------------------------------------------------- ColossalAI's install

# The pip distribution of every top-level module that the ColossalAI imports of this module load
# beyond the project's own dependencies, pinned, for `pip install --no-deps` (colossalai 0.5.0
# pins torch<=2.5.1, transformers==4.51.3, peft<=0.13.2, which this environment does not meet).
# Found by importing exactly those modules into a venv of the project's pins plus colossalai
# alone (issue 19): colossalai.nn.optimizer imports galore_torch at module level, which imports
# bitsandbytes; colossalai.booster imports einops. Not imports, but needed all the same:
# contexttimer (declared by colossalai, its legacy code) and ninja (HybridAdam JIT-builds its
# CUDA kernels with torch.utils.cpp_extension at first use). scripts/setup.sh --colossalai
# installs exactly these.
COLOSSALAI_DISTRIBUTIONS = {"colossalai": "colossalai==0.5.0", "galore_torch": "galore-torch==1.0",
                            "bitsandbytes": "bitsandbytes==0.50.2", "einops": "einops==0.8.2",
                            "contexttimer": "contexttimer==0.3.3", "ninja": "ninja==1.13.2"}
COLOSSALAI_INSTALL = "scripts/setup.sh --colossalai"


def colossalai_imports(path: Path = Path(__file__)) -> list[tuple[str, str | None]]:
    """(module, name) for every ColossalAI import in ``path`` (this module), in source order:
    ``from colossalai.booster import Booster`` gives ('colossalai.booster', 'Booster'),
    ``colossalai.launch_from_torch`` after ``import colossalai`` ('colossalai', 'launch_from_torch')."""
    found: list[tuple[int, int, tuple[str, str | None]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "colossalai":
            found += [(node.lineno, node.col_offset, (node.module, a.name)) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, node.col_offset, (a.name, None)) for a in node.names if a.name.split(".")[0] == "colossalai"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "colossalai":
            found.append((node.lineno, node.col_offset, ("colossalai", node.attr)))
    return list(dict.fromkeys(item for *_, item in sorted(found)))


# Runs in a fresh interpreter: a failing import leaves nothing half-imported in the caller, and a
# library that crashes the process on import (a native extension) cannot take the driver down.
_PROBE = """
import importlib, json, sys
for module, name in json.loads(sys.argv[1]):
    try:
        obj = importlib.import_module(module)
        if name is not None:
            getattr(obj, name)
    except Exception as e:
        missing = e.name if isinstance(e, ModuleNotFoundError) else None
        print("RLHF-PROBE " + json.dumps({"module": module, "name": name, "type": type(e).__name__,
                                          "error": (str(e).splitlines() or [""])[0], "missing": missing}))
        break
else:
    print("RLHF-PROBE null")
"""
_IMPORTS_OK: set[tuple] = set()


def import_failure(imports: list[tuple[str, str | None]], python: str = sys.executable,
                   env: dict[str, str] | None = None, timeout_s: float = 300) -> dict | None:
    """The first of ``imports`` ((module, name) pairs, in order) that fails in a fresh ``python``,
    as {module, name, type, error, missing: the top-level module a ModuleNotFoundError names, or
    None}; None when all import. ``env``: the interpreter's environment (default: this one)."""
    memo = (python, json.dumps(imports), json.dumps(env, sort_keys=True))
    if memo in _IMPORTS_OK:
        return None
    out = subprocess.run([python, "-c", _PROBE, json.dumps(imports)], capture_output=True, text=True,
                         env=env, timeout=timeout_s)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RLHF-PROBE ")]
    if not lines:  # the interpreter died (a crash in a native extension): report its own words
        tail = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"module": imports[0][0] if imports else "", "name": None, "type": "crash", "error": tail, "missing": None}
    failure = json.loads(lines[-1][len("RLHF-PROBE "):])
    if failure is None:
        _IMPORTS_OK.add(memo)
    elif failure["missing"]:
        failure["missing"] = failure["missing"].split(".")[0]
    return failure


def colossalai_problem(strategy: str, failure: dict) -> str:
    """The error for ``failure`` (``import_failure`` of ``colossalai_imports()``): what failed,
    the missing piece's pip distribution, and the install command."""
    what = f"from {failure['module']} import {failure['name']}" if failure["name"] else f"import {failure['module']}"
    every = " ".join(COLOSSALAI_DISTRIBUTIONS.values())
    missing = failure["missing"]
    if missing in COLOSSALAI_DISTRIBUTIONS:
        piece = f"; the missing piece is {missing!r} (pip distribution {COLOSSALAI_DISTRIBUTIONS[missing]})"
    elif missing:
        piece = f"; the missing piece is {missing!r}, not one this project knew ColossalAI to need (pip install it)"
    else:
        piece = ""
    return (f"ppo.strategy {strategy!r} needs ColossalAI: `{what}` fails here ({failure['type']}: {failure['error']}){piece}. "
            f"Install the whole closure with `{COLOSSALAI_INSTALL}` (= pip install --no-deps {every}; CUDA only); "
            "or use ppo.strategy 'ddp' / 'fsdp'")


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


def full_state(model, optimizer=None, strategy: str = "ddp", with_optimizer: bool = True) -> tuple[dict, dict | None]:
    """Trainable weights and optimizer state as full (unsharded) CPU tensors, keyed by parameter
    name (the PEFT model's names, whatever the wrapper). Collective for sharded models: every rank
    calls it; rank 0's copy is complete. ColossalAI's strategies need the optimizer for the weights
    too (ZeRO-2's fp32 master weights live in it); ``with_optimizer=False`` leaves its state out."""
    if strategy.startswith("colossalai"):
        return _colossalai_full_state(model, optimizer, strategy, with_optimizer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from tasks.common.optim import MasterAdamW

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=opts)
    if isinstance(optimizer, MasterAdamW) and weights:  # (rank 0's: full and on the CPU, the others get none)
        # ddp's bf16 weights are their fp32 masters rounded: the trained weights are the masters
        names = {id(p): n for n, p in getattr(model, "module", model).named_parameters()}
        masters = {names[id(p)]: m.cpu() for p, m in optimizer.masters()}
        assert masters.keys() <= weights.keys(), f"masters not among the weights: {sorted(masters.keys() - weights.keys())[:3]}"
        weights |= masters
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None and with_optimizer else None
    return weights, optim


def load_full_state(model, weights: dict, optimizer=None, optim_state: dict | None = None, strategy: str = "ddp") -> None:
    """Inverse of ``full_state``; every rank passes the same full dicts."""
    if strategy.startswith("colossalai"):
        return _colossalai_load_full_state(model, weights, optimizer, optim_state, strategy)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, strict=False)
    missing = set_model_state_dict(model, weights, options=opts)
    assert not missing.unexpected_keys, f"checkpoint weights not in the model: {missing.unexpected_keys[:5]}"
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=opts)


# ColossalAI's wrappers answer neither torch.distributed.checkpoint's state-dict functions nor each
# other's API (issue 19, on the H200: "'LowLevelZeroOptimizer' object is not iterable", "'GeminiDDP'
# object has no attribute 'base_model'"). ZeRO-2 keeps bf16 working weights whole on every rank
# and the fp32 master weights flat, padded and split across ranks in the optimizer: the masters
# are gathered (exact resume), and loading writes both. Gemini's own state_dict gathers its fp32
# chunks (the frozen base weights, outside the chunks, are left out by name). The optimizer state
# is each optimizer's own full state dict, keyed by parameter index: it loads back into the same
# strategy only, which the PPO key includes (a checkpoint never crosses strategies).

def prime_cpu_adam(optimizer) -> None:
    """Make ColossalAI's CPU Adam step independent of what it stepped before: call before each step.

    Its C++ kernel object keeps ``beta ** step`` between calls: the first tensor of a step gets the
    previous value times beta, the others ``pow(beta, step)``, so after a resume (a new kernel
    object, or one that ran ahead) the first tensor's update differs in its last bits (seen on the
    H200: 1 of 16 LoRA tensors after load + the same step). Calling the kernel once on a scratch
    tensor with the state's step sets its cache as every step leaves it, from the step count alone.
    No-op for any other optimizer, and for HybridAdam's tensors on the GPU (stepless fused kernel)."""
    import torch

    inner = optimizer
    while not hasattr(inner, "cpu_adam_op") and hasattr(inner, "optim"):  # the plugins' wrappers
        inner = inner.optim
    op = getattr(inner, "cpu_adam_op", None)
    if op is None:
        return
    step = max((int(s["step"]) for s in inner.state.values() if "step" in s), default=0)
    g = inner.param_groups[0]
    scratch = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    op.step(step, g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], g["bias_correction"], *scratch, -1)


def _zero2_trainable(model, optimizer) -> list[tuple[str, object, object, object]]:
    """(name, working parameter, fp32 master shard, process group) for each trainable parameter."""
    masters = optimizer.get_working_to_master_map()
    return [(n, p, masters[id(p)], optimizer.param_to_pg[p])
            for n, p in model.unwrap(unwrap_peft=False).named_parameters() if p.requires_grad]


@contextmanager
def _gemini_fp32_buffers(model):
    """Gemini's ``state_dict`` and ``load_state_dict`` gather each chunk that is not kept whole
    into a buffer of the working dtype (``model.mixed_precision``, bf16), so the fp32 master
    weights of every large chunk came back, and went in, rounded to bf16 (issue 19, on the H200:
    the 0.3B full-parameter critic resumed with value loss 2.77 where the uninterrupted run had
    3.27; small chunks, such as a LoRA adapter's, are kept whole and were exact). With the buffers
    in fp32 both directions are exact, and loading still syncs the bf16 working copy from them."""
    import torch

    working = model.mixed_precision
    model.mixed_precision = torch.float32
    try:
        yield
    finally:
        model.mixed_precision = working


def _colossalai_full_state(model, optimizer, strategy: str, with_optimizer: bool) -> tuple[dict, dict | None]:
    import torch
    import torch.distributed as dist

    if strategy == "colossalai_zero2":
        weights = {}
        for name, p, master, pg in _zero2_trainable(model, optimizer):
            shard = master.detach().to(p.device).contiguous()
            full = torch.empty(shard.numel() * dist.get_world_size(pg), dtype=shard.dtype, device=p.device)
            dist.all_gather_into_tensor(full, shard, group=pg)
            weights[name] = full[: p.numel()].view(p.shape).cpu()
        optim = optimizer.state_dict() if with_optimizer else None  # gathered on every rank
    else:
        trainable = [n for n, p in model.name2param.items() if p is not None and p.requires_grad]
        with _gemini_fp32_buffers(model):
            state = model.state_dict(only_rank_0=False)
        weights = {n: state[n].detach().cpu() for n in trainable}
        optim = optimizer.state_dict(only_rank_0=False) if with_optimizer else None
    return weights, optim


def _colossalai_load_full_state(model, weights: dict, optimizer, optim_state: dict | None, strategy: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if strategy == "colossalai_zero2":
        trainable = {name: rest for name, *rest in _zero2_trainable(model, optimizer)}
        unexpected = sorted(set(weights) - set(trainable))
        assert not unexpected, f"checkpoint weights not in the model: {unexpected[:5]}"
        with torch.no_grad():
            for name, w in weights.items():
                p, master, pg = trainable[name]
                p.copy_(w.to(p.device, p.dtype))
                world, rank = dist.get_world_size(pg), dist.get_rank(pg)
                flat = w.to(master.dtype).flatten()
                flat = F.pad(flat, [0, (world - flat.numel() % world) % world])
                master.copy_(flat.chunk(world)[rank].to(master.device))
    else:
        with _gemini_fp32_buffers(model):
            missing = model.load_state_dict(weights, strict=False)
        assert not missing.unexpected_keys, f"checkpoint weights not in the model: {missing.unexpected_keys[:5]}"
    if optim_state is not None:
        optimizer.load_state_dict(optim_state)
