"""The ``rlhf`` flow: data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray.

Each stage is a plain function in ``tasks/``; the Prefect tasks below only add what Prefect is
for: retries with backoff, a cross-run cache, Ray resources, and a published Prefect artifact.

Caching, one fact in one place: the artifact store is the truth, Prefect's cache an index of it.
The flow computes each stage's key once (``tasks.*.train.*_key``: its config, its derived code
version, the content hashes of its inputs) as soon as its inputs are known, and hands it to the
task and the stage function; Prefect's cache key is that key. A stage is a hit when the store
holds a whole artifact at the key (``ArtifactStore.is_good``: manifest, files and sizes, no
hashing); a hit runs in the flow's own thread and Prefect records it as Cached, so no Ray worker
starts for it, and when every stage is a hit no Ray starts at all. A miss, or an artifact that
failed its check, is submitted to Ray with ``refresh_cache``. The ref a hit returns is the
store's (``store.ref``), never a copy from Prefect's records, and cached results are JSON
dicts, not pickles.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.serializers import JSONSerializer

from flows.config import PipelineConfig, StageResources, describe_resources, local_gpus, resolve_resources, validate_config
from flows.plan import all_hit, hit, open_store, ppo_key, refreshed, rm_key, sft_key  # noqa: F401 (open_store: flows.cli)
from storage.store import ArtifactRef, ArtifactStore

log = logging.getLogger("rlhf.flow")


def cache_key(context, parameters) -> str:
    """Prefect's cache key: the artifact key handed to the task, in its store's namespace
    (hashed: Prefect stores records under this name, and URIs hold '/' and ':')."""
    store_uri = parameters["cfg"].store.resolved_uri()
    return "rlhf-" + hashlib.sha256(f"{store_uri}|{parameters['key']}".encode()).hexdigest()[:40]


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


def _run_stage(stage: str, fn, cfg: PipelineConfig, key: str, **inputs: ArtifactRef) -> dict:
    from flows.console import stage_console
    from flows.report import progress

    _inject_fault(stage)
    store = open_store(cfg)
    with stage_console(stage), progress(stage):  # console lines or bar; a Prefect progress artifact
        ref = fn(cfg, store, *inputs.values(), key=key, force=stage in cfg.refresh or "all" in cfg.refresh)
    get_run_logger().info("%s -> %s", stage, ref.uri)
    publish_prefect_artifact(stage, store, ref)
    return ref.model_dump(mode="json")  # JSON data in Prefect's result store, see _TASK_OPTS


# -- the four stage tasks: thin wrappers over tasks/*.py -------------------------------------
def _data(cfg, store, key, force):
    from tasks.data.prepare import prepare_data

    return prepare_data(cfg.data, cfg.model, store, cfg.seed, key=key, force=force)


def _sft(cfg, store, data, key, force):
    from tasks.sft.train import train_sft

    return train_sft(cfg.sft, cfg.model, store, data, cfg.seed, key=key, force=force, tracking=cfg.tracking)


def _rm(cfg, store, data, key, force):
    from tasks.rm.train import train_reward_model

    return train_reward_model(cfg.rm, cfg.model, store, data, cfg.seed, key=key, force=force, tracking=cfg.tracking)


def _ppo(cfg, store, data, sft, rm, key, force):
    from tasks.ppo.train import train_ppo

    return train_ppo(cfg.ppo, cfg.model, store, data, sft, rm, cfg.seed, key=key, force=force, tracking=cfg.tracking)


# Results are plain JSON dicts (ArtifactRef.model_dump) with no object hooks: reading a record
# imports and runs nothing of ours, and a record from before a field was added still validates.
_TASK_OPTS = dict(persist_result=True, cache_expiration=None, log_prints=True, cache_key_fn=cache_key,
                  result_serializer=JSONSerializer(object_encoder=None, object_decoder=None))


@task(name="data", **_TASK_OPTS)
def data_task(cfg: PipelineConfig, key: str) -> dict:
    return _run_stage("data", _data, cfg, key)


@task(name="sft", **_TASK_OPTS)
def sft_task(cfg: PipelineConfig, key: str, data: ArtifactRef) -> dict:
    return _run_stage("sft", _sft, cfg, key, data=data)


@task(name="rm", **_TASK_OPTS)
def rm_task(cfg: PipelineConfig, key: str, data: ArtifactRef) -> dict:
    return _run_stage("rm", _rm, cfg, key, data=data)


@task(name="ppo", **_TASK_OPTS)
def ppo_task(cfg: PipelineConfig, key: str, data: ArtifactRef, sft: ArtifactRef, rm: ArtifactRef | None = None) -> dict:
    return _run_stage("ppo", _ppo, cfg, key, data=data, sft=sft, rm=rm)


class Stage:
    """One submitted stage: ``result()`` waits for its ref and prints what happened."""

    def __init__(self, stage: str, store: ArtifactStore, outcome: str, ref: ArtifactRef | None = None, future=None):
        self.stage, self.store, self.outcome, self.ref, self.future, self.t0 = stage, store, outcome, ref, future, time.time()

    def result(self) -> ArtifactRef:
        if self.ref is None:
            self.ref = ArtifactRef.model_validate(self.future.result())
        print(f"rlhf: {self.stage:5s} {self.outcome:28s} {time.time() - self.t0:6.1f}s  {self.ref.uri}")
        return self.ref


def submit_stage(t, stage: str, key: str, cfg: PipelineConfig, store: ArtifactStore, **inputs: ArtifactRef) -> Stage:
    """A hit runs in this thread (Prefect finds its record: Cached, no Ray worker); anything else
    goes to Ray with the stage's resources, retries (exponential backoff) and ``refresh_cache``."""
    r: StageResources = cfg.resources[stage]
    opts = dict(retries=r.retries, retry_delay_seconds=[r.retry_delay_s * 2**i for i in range(max(r.retries, 1))])
    if hit(cfg, store, stage, key):
        t.with_options(**opts, refresh_cache=False)(cfg, key, **inputs)
        return Stage(stage, store, "cached", ref=store.ref(key))
    outcome = "built" if refreshed(cfg, stage) or not store.exists(key) else "rebuilt (failed its check)"
    if outcome != "built":
        get_run_logger().warning("%s: %s failed its check and will be rebuilt", stage, store.uri_of(key))
    from prefect_ray.context import remote_options  # imports ray: not on the all-hit path

    ray_opts = {"num_cpus": r.num_cpus, **({"num_gpus": r.num_gpus} if r.num_gpus else {}),
                **({"resources": dict(r.resources)} if r.resources else {})}
    with remote_options(**ray_opts):
        return Stage(stage, store, outcome, future=t.with_options(**opts, refresh_cache=True).submit(cfg, key, **inputs))


@flow(name="rlhf-stages")
def rlhf_stages(cfg: PipelineConfig, keys: dict[str, str]) -> dict[str, ArtifactRef]:
    store = open_store(cfg)
    data = submit_stage(data_task, "data", keys["data"], cfg, store).result()
    sft = submit_stage(sft_task, "sft", keys.get("sft") or sft_key(cfg, data), cfg, store, data=data)
    # the reward model stage runs only when PPO needs it: a reward term of kind 'model', or the critic (gae)
    rm = submit_stage(rm_task, "rm", keys.get("rm") or rm_key(cfg, data), cfg, store, data=data) \
        if cfg.ppo.needs_reward_model else None  # beside SFT on Ray
    sft, rm = sft.result(), rm.result() if rm is not None else None
    ppo = submit_stage(ppo_task, "ppo", keys.get("ppo") or ppo_key(cfg, data, sft, rm), cfg, store, data=data, sft=sft,
                       **({"rm": rm} if rm is not None else {}))
    return {"data": data, "sft": sft, **({"rm": rm} if rm is not None else {}), "ppo": ppo.result()}


@flow(name="rlhf", log_prints=True)
def rlhf(config: PipelineConfig = PipelineConfig()) -> dict[str, ArtifactRef]:
    """data prep -> PEFT LoRA SFT -> reward model -> PPO on Ray; returns the artifact refs."""
    from flows.preflight import preflight
    from flows.runtime import ray_task_runner
    from tasks.common.tracking import run_pipeline_tracked

    cfg = validate_config(config)
    gpus = local_gpus(cfg.ray)
    cfg = resolve_resources(cfg, gpus)  # unset GPU requests, once, for the GPUs there are
    print(f"rlhf: {describe_resources(cfg, gpus)}")
    keys = preflight(cfg)  # every config/data/cluster error before any model loads; the keys known now
    # every stage a hit: no Ray to start
    stages = rlhf_stages if all_hit(cfg, open_store(cfg), keys) else rlhf_stages.with_options(task_runner=ray_task_runner(cfg.ray))
    return run_pipeline_tracked(cfg, lambda c: stages(c, keys))  # inside the pipeline's MLflow run, when set
