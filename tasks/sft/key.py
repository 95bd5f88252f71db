"""The SFT stage's cache key, importable without torch (the flow decides hits before any model loads)."""

from __future__ import annotations

from storage.keys import code_version, stage_key
from storage.store import ArtifactRef
from tasks.common.model import ModelConfig
from tasks.sft.config import SFTConfig

# Fields that change neither the result nor its meaning stay out of the key.
_NOT_IN_KEY = {"resume", "log_every"}


def sft_key(cfg: SFTConfig, model: ModelConfig, data: ArtifactRef, seed: int) -> str:
    return stage_key("sft", {"sft": cfg.model_dump(mode="json", exclude=_NOT_IN_KEY), "model": model.identity(), "seed": seed},
                     {"data": data.only("tokenizer", "sft_train.jsonl", "sft_eval.jsonl")}, code_version("tasks.sft.train"))
