"""The PPO stage's cache key, importable without torch (the flow decides hits before any model loads)."""

from __future__ import annotations

from storage.keys import code_version, stage_key
from storage.store import ArtifactRef
from tasks.common.model import ModelConfig
from tasks.ppo.config import PPOConfig


def read_parts(data: ArtifactRef, sft: ArtifactRef, rm: ArtifactRef) -> dict[str, ArtifactRef]:
    """The inputs narrowed to the parts PPO reads: what it keys on, and what its workers check
    they fetched (TensorBoard's event files, with wall times, must neither re-key PPO nor fail a
    worker's check when a racing run republished the same key)."""
    return {"data": data.only("tokenizer", "prompts_train.jsonl", "prompts_eval.jsonl", "ptx_train.jsonl"),
            "sft": sft.only("adapter"), "rm": rm.only("model.safetensors", "config.json")}


def ppo_key(cfg: PPOConfig, model: ModelConfig, data: ArtifactRef, sft: ArtifactRef, rm: ArtifactRef, seed: int) -> str:
    return stage_key("ppo", {"ppo": cfg, "model": model.identity(), "seed": ppo_seed(cfg, seed)}, read_parts(data, sft, rm),
                     code_version("tasks.ppo.train"))


def ppo_seed(cfg: PPOConfig, seed: int) -> int:
    return cfg.seed if cfg.seed is not None else seed
