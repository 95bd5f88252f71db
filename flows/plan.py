"""What a run will do, decided before Prefect or Ray start: each stage's key and whether it is a hit.

Prefect-free (importing Prefect fixes its API URL for the process, flows/cli.py), so the CLI's
pre-flight can ask whether every stage is a hit before any server starts. The flow computes
each key once, as soon as the stage's inputs are known, and hands it to the task and the stage
function (flows/rlhf.py).
"""

from __future__ import annotations

from flows.config import PipelineConfig
from storage.store import ArtifactRef, ArtifactStore


def open_store(cfg: PipelineConfig) -> ArtifactStore:
    return ArtifactStore(cfg.store.resolved_uri(), cfg.store.storage_options)


def data_key(cfg: PipelineConfig) -> str:
    from tasks.data.prepare import data_key

    return data_key(cfg.data, cfg.model, cfg.seed)


def sft_key(cfg: PipelineConfig, data: ArtifactRef) -> str:
    from tasks.sft.key import sft_key

    return sft_key(cfg.sft, cfg.model, data, cfg.seed)


def rm_key(cfg: PipelineConfig, data: ArtifactRef) -> str:
    from tasks.rm.key import rm_key

    return rm_key(cfg.rm, cfg.model, data, cfg.seed)


def ppo_key(cfg: PipelineConfig, data: ArtifactRef, sft: ArtifactRef, rm: ArtifactRef | None) -> str:
    from tasks.ppo.key import ppo_key

    return ppo_key(cfg.ppo, cfg.model, data, sft, rm, cfg.seed)


def refreshed(cfg: PipelineConfig, stage: str) -> bool:
    return stage in cfg.refresh or "all" in cfg.refresh


def hit(cfg: PipelineConfig, store: ArtifactStore, stage: str, key: str) -> bool:
    return not refreshed(cfg, stage) and store.is_good(key)


def known_keys(cfg: PipelineConfig, store: ArtifactStore) -> dict[str, str]:
    """The keys computable before anything runs: data's, and each next stage's while its inputs
    are hits. The flow computes the rest once their inputs are built."""
    keys = {"data": data_key(cfg)}
    if not hit(cfg, store, "data", keys["data"]):
        return keys
    data = store.ref(keys["data"])
    keys["sft"] = sft_key(cfg, data)
    if cfg.ppo.needs_reward_model:  # critic-free with rewards by code: no RM stage at all
        keys["rm"] = rm_key(cfg, data)
    if hit(cfg, store, "sft", keys["sft"]) and ("rm" not in keys or hit(cfg, store, "rm", keys["rm"])):
        keys["ppo"] = ppo_key(cfg, data, store.ref(keys["sft"]), store.ref(keys["rm"]) if "rm" in keys else None)
    return keys


def all_hit(cfg: PipelineConfig, store: ArtifactStore, keys: dict[str, str]) -> bool:
    """Every stage a hit (``keys`` from ``known_keys``): nothing builds, no model loads, no Ray starts."""
    return "ppo" in keys and hit(cfg, store, "ppo", keys["ppo"])
