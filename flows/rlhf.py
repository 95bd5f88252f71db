"""The ``rlhf`` flow: data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray.

Each stage is a plain function in ``tasks/``; the Prefect tasks below only add what Prefect is
for: retries with backoff, a cross-run cache, Ray resources, and a published Prefect artifact.

Caching: a stage's Prefect cache key is its artifact key (``storage.keys.stage_key``: its own
config, its code version, the content hashes of its inputs), so an unchanged stage is skipped
in a new run and a change upstream re-runs exactly the stages downstream of it. A cache hit is
trusted only if the artifact is still in the store and passes its checksums; otherwise the key
changes and the stage rebuilds. Each stage function also returns an artifact that is already
published at its key, so the store alone is enough to resume (a lost Prefect database costs
nothing but the cache lookups).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from prefect import flow, get_run_logger, task

from flows.config import PipelineConfig, StageResources, validate_config
from storage.store import ArtifactRef, ArtifactStore

log = logging.getLogger("rlhf.flow")


def open_store(cfg: PipelineConfig) -> ArtifactStore:
    return ArtifactStore(cfg.store.resolved_uri(), cfg.store.storage_options)


def stage_cache_key(stage: str):
    """A Prefect cache_key_fn: the stage's artifact key (content-derived), in the store's namespace.

    Whether a cached result may be used is decided before submitting (``submit_stage``): a stage
    whose artifact is missing or fails its checksums is submitted with ``refresh_cache``.
    """

    def key_fn(context, parameters) -> str:
        cfg = validate_config(parameters["cfg"])
        inputs = {k: v for k, v in parameters.items() if k != "cfg"}
        key = expected_key(stage, cfg, inputs)
        # Prefect stores cache records under this name: hash it (URIs hold '/' and ':')
        return "rlhf-" + hashlib.sha256(f"{cfg.store.resolved_uri()}|{key}".encode()).hexdigest()[:40]

    return key_fn


def expected_key(stage: str, cfg: PipelineConfig, p: dict) -> str:
    if stage == "data":
        from tasks.data.prepare import data_key

        return data_key(cfg.data, cfg.model, cfg.seed)
    if stage == "sft":
        from tasks.sft.train import sft_key

        return sft_key(cfg.sft, cfg.model, p["data"], cfg.seed)
    if stage == "rm":
        from tasks.rm.train import rm_key

        return rm_key(cfg.rm, cfg.model, p["data"], cfg.seed)
    from tasks.ppo.train import ppo_key

    return ppo_key(cfg.ppo, cfg.model, p["data"], p["sft"], p["rm"], cfg.seed)


def publish_prefect_artifact(stage: str, store: ArtifactStore, ref: ArtifactRef) -> None:
    """A markdown card per stage: URI, metrics, curves (PPO: samples and per-iteration tables); flows/report.py."""
    from flows.report import publish_card

    publish_card(stage, store, ref)


def _inject_fault(stage: str) -> None:
    """Fault injection for tests and drills: RLHF_FAIL_ONCE='<stage>:<marker path>' fails that stage
    once (the marker records that it did), so a retry or a rerun can show that it recovers."""
    spec = os.environ.get("RLHF_FAIL_ONCE", "")
    if spec.partition(":")[0] == stage:
        marker = Path(spec.partition(":")[2])
        if not marker.exists():
            marker.write_text("failed once")
            raise RuntimeError(f"injected fault in stage {stage!r} (RLHF_FAIL_ONCE)")


def _progress_to_stderr() -> None:
    """Stage progress lines (loggers ``rlhf.*``) on the Ray worker's stderr, which Ray forwards to
    the driver's console: the step/loss/reward lines of a run are where the user runs it."""
    lg = logging.getLogger("rlhf")
    lg.setLevel(logging.INFO)
    if not any(getattr(h, "_rlhf", False) for h in lg.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s", "%H:%M:%S"))
        h._rlhf = True
        lg.addHandler(h)
        lg.propagate = False


def _run_stage(stage: str, fn, cfg: PipelineConfig, **inputs: ArtifactRef) -> ArtifactRef:
    cfg = validate_config(cfg)
    _progress_to_stderr()
    _inject_fault(stage)
    store = open_store(cfg)
    from flows.report import progress

    with progress(stage):  # a Prefect progress artifact that follows the stage's steps
        ref = fn(cfg, store, *inputs.values(), force=stage in cfg.refresh or "all" in cfg.refresh)
    get_run_logger().info("%s -> %s", stage, ref.uri)
    publish_prefect_artifact(stage, store, ref)
    return ref


# -- the four stage tasks: thin wrappers over tasks/*.py -------------------------------------
def _data(cfg, store, force):
    from tasks.data.prepare import prepare_data

    return prepare_data(cfg.data, cfg.model, store, cfg.seed, force=force)


def _sft(cfg, store, data, force):
    from tasks.sft.train import train_sft

    return train_sft(cfg.sft, cfg.model, store, data, cfg.seed, force=force, tracking=cfg.tracking)


def _rm(cfg, store, data, force):
    from tasks.rm.train import train_reward_model

    return train_reward_model(cfg.rm, cfg.model, store, data, cfg.seed, force=force, tracking=cfg.tracking)


def _ppo(cfg, store, data, sft, rm, force):
    from tasks.ppo.train import train_ppo

    return train_ppo(cfg.ppo, cfg.model, store, data, sft, rm, cfg.seed, force=force, tracking=cfg.tracking)


_TASK_OPTS = dict(persist_result=True, cache_expiration=None, log_prints=True)


@task(name="data", cache_key_fn=stage_cache_key("data"), **_TASK_OPTS)
def data_task(cfg: PipelineConfig) -> ArtifactRef:
    return _run_stage("data", _data, cfg)


@task(name="sft", cache_key_fn=stage_cache_key("sft"), **_TASK_OPTS)
def sft_task(cfg: PipelineConfig, data: ArtifactRef) -> ArtifactRef:
    return _run_stage("sft", _sft, cfg, data=data)


@task(name="rm", cache_key_fn=stage_cache_key("rm"), **_TASK_OPTS)
def rm_task(cfg: PipelineConfig, data: ArtifactRef) -> ArtifactRef:
    return _run_stage("rm", _rm, cfg, data=data)


@task(name="ppo", cache_key_fn=stage_cache_key("ppo"), **_TASK_OPTS)
def ppo_task(cfg: PipelineConfig, data: ArtifactRef, sft: ArtifactRef, rm: ArtifactRef) -> ArtifactRef:
    return _run_stage("ppo", _ppo, cfg, data=data, sft=sft, rm=rm)


def submit_stage(t, stage: str, cfg: PipelineConfig, store: ArtifactStore, **inputs):
    """Submit one stage's task to Ray with its resources, retries (exponential backoff) and cache rule."""
    from prefect_ray.context import remote_options

    r: StageResources = cfg.resources[stage]
    key = expected_key(stage, cfg, inputs)
    stale = not store.is_good(key)  # never reuse what is not there whole
    if stale and store.exists(key):
        get_run_logger().warning("%s: %s failed its check and will be rebuilt", stage, store.uri_of(key))
    opts = dict(retries=r.retries, retry_delay_seconds=[r.retry_delay_s * 2**i for i in range(max(r.retries, 1))],
                refresh_cache=stale or stage in cfg.refresh or "all" in cfg.refresh)
    ray_opts = {"num_cpus": r.num_cpus, **({"num_gpus": r.num_gpus} if r.num_gpus else {}),
                **({"resources": dict(r.resources)} if r.resources else {})}
    with remote_options(**ray_opts):
        return t.with_options(**opts).submit(cfg, **inputs)


@flow(name="rlhf-stages")
def rlhf_stages(cfg: PipelineConfig) -> dict[str, ArtifactRef]:
    store = open_store(cfg)
    data = submit_stage(data_task, "data", cfg, store).result()
    sft = submit_stage(sft_task, "sft", cfg, store, data=data)
    rm = submit_stage(rm_task, "rm", cfg, store, data=data)  # independent of SFT: Ray runs them side by side
    sft, rm = sft.result(), rm.result()
    ppo = submit_stage(ppo_task, "ppo", cfg, store, data=data, sft=sft, rm=rm).result()
    return {"data": data, "sft": sft, "rm": rm, "ppo": ppo}


@flow(name="rlhf", log_prints=True)
def rlhf(config: PipelineConfig = PipelineConfig()) -> dict[str, ArtifactRef]:
    """data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray; returns the artifact refs."""
    from flows.preflight import preflight
    from flows.runtime import ray_task_runner
    from tasks.common.tracking import run_pipeline_tracked

    cfg = validate_config(config)
    preflight(cfg)  # every config/data/cluster error before any model loads
    return run_pipeline_tracked(cfg, rlhf_stages.with_options(task_runner=ray_task_runner(cfg.ray)))  # MLflow, when set
