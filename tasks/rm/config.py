"""Reward model config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.common.model import CHECKPOINT_HELP, Switch


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_rank: int = Field(0, ge=0, description="0: full-parameter training (the seed's advice); >0: LoRA of this rank on the base.")
    lora_alpha: float = Field(32, gt=0, description="LoRA alpha (lora_rank > 0 only).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout (lora_rank > 0 only).")
    target_modules: list[str] | Literal["auto"] = Field("auto", description="Body modules LoRA wraps when lora_rank > 0; 'auto' picks per architecture (as sft.target_modules); the value head always trains in full.")
    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate (tuned for the built-in tiny model).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0, description="Share of steps of linear warmup.")
    batch_size: int = Field(16, gt=0, description="Pairs per micro-batch per worker.")
    accumulation_steps: int = Field(1, gt=0, description="Gradient accumulation steps.")
    max_epochs: int = Field(2, gt=0, description="Epochs over the preference train split (built-in task: held-out accuracy 1.0 within the first epoch).")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    margin: float = Field(0.0, ge=0.0, description="Margin m in -log sigmoid(r_chosen - r_rejected - m).")
    grad_clip: float = Field(1.0, gt=0.0, description="Max gradient norm.")
    eval_every: int = Field(25, gt=0, description="Evaluate every N optimizer steps.")
    log_every: int = Field(10, gt=0, description="Log every N optimizer steps.")
    num_workers: int = Field(1, gt=0, description="Data-parallel workers (DDP).")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda'.")
    gradient_checkpointing: Switch = Field("auto", description=CHECKPOINT_HELP)
