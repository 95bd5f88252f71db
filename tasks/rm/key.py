"""The reward model stage's cache key, importable without torch (the flow decides hits before any model loads)."""

from __future__ import annotations

from storage.keys import code_version, stage_key
from storage.store import ArtifactRef
from tasks.common.model import ModelConfig
from tasks.rm.config import RewardConfig

_NOT_IN_KEY = {"log_every"}


def rm_key(cfg: RewardConfig, model: ModelConfig, data: ArtifactRef, seed: int) -> str:
    return stage_key("rm", {"rm": cfg.model_dump(mode="json", exclude=_NOT_IN_KEY), "model": model.identity(), "seed": seed},
                     {"data": data.only("tokenizer", "pref_train.jsonl", "pref_eval.jsonl")}, code_version("tasks.rm.train"))
