"""The PPO stage's cache key, importable without torch (the flow decides hits before any model loads)."""

from __future__ import annotations

from storage.keys import code_version, stage_key
from storage.store import ArtifactRef
from tasks.common.model import ModelConfig
from tasks.ppo.config import PPOConfig


def read_parts(data: ArtifactRef, sft: ArtifactRef, rm: ArtifactRef | None) -> dict[str, ArtifactRef]:
    """The inputs narrowed to the parts PPO reads: what it keys on, and what its workers check
    they fetched (TensorBoard's event files, with wall times, must neither re-key PPO nor fail a
    worker's check when a racing run republished the same key). No reward model when the config
    needs none (``PPOConfig.needs_reward_model``)."""
    parts = {"data": data.only("tokenizer", "prompts_train.jsonl", "prompts_eval.jsonl", "ptx_train.jsonl"), "sft": sft.only("adapter")}
    return parts | ({"rm": rm.only("model.safetensors", "config.json")} if rm is not None else {})


def ppo_key(cfg: PPOConfig, model: ModelConfig, data: ArtifactRef, sft: ArtifactRef, rm: ArtifactRef | None, seed: int) -> str:
    check_reward_model(cfg, rm)
    config = {"ppo": cfg, "model": model.identity(), "seed": ppo_seed(cfg, seed)}
    if any(src.kind == "function" for src in cfg.rewards):  # a reward function's source keys the stage
        from tasks.ppo.rewards import reward_code_version  # imports the function (and torch): only then

        config["reward_code"] = reward_code_version(cfg)
    return stage_key("ppo", config, read_parts(data, sft, rm), code_version("tasks.ppo.train"))


def check_reward_model(cfg: PPOConfig, rm: ArtifactRef | None) -> None:
    if cfg.needs_reward_model and rm is None:
        raise ValueError(f"ppo.advantage {cfg.advantage!r} with ppo.rewards kinds {[r.kind for r in cfg.rewards]} needs the reward "
                         "model stage's artifact (the critic starts from it, or a term is kind 'model'); pass it, or use a "
                         "critic-free advantage (grpo, rloo, reinforce_pp) with rewards of kind 'function' / 'http' only")


def ppo_seed(cfg: PPOConfig, seed: int) -> int:
    return cfg.seed if cfg.seed is not None else seed
