"""PPO config: roles and their placement, the algorithm, generation, checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RoleConfig(BaseModel):
    """One PPO role's Ray actor group."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(1, gt=0, description="Ray actors in the group (torch.distributed world size).")
    gpus_per_worker: float = Field(0.0, ge=0.0, description="GPUs per Ray actor; fractions (0.25) let roles share a GPU. 0 on CPU.")
    cpus_per_worker: float = Field(0.5, ge=0.0, description="CPUs Ray reserves per actor.")


class PPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: Literal["ddp", "fsdp", "colossalai_zero2", "colossalai_gemini"] = Field("ddp", description="How learner groups shard: DDP, torch FSDP2, or ColossalAI ZeRO-2 / Gemini (CUDA, ColossalAI installed).")
    actor: RoleConfig = Field(default_factory=RoleConfig, description="Policy: generates and learns.")
    critic: RoleConfig = Field(default_factory=RoleConfig, description="Value model: learns.")
    initial: RoleConfig = Field(default_factory=RoleConfig, description="Frozen reference policy for the KL penalty.")
    reward: RoleConfig = Field(default_factory=RoleConfig, description="Frozen reward model.")
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"] = Field("PACK", description="Ray placement-group strategy of each role's bundles (seed: STRICT_SPREAD across nodes).")
    colocate: bool = Field(False, description="Put all roles' bundles in one placement group so they share GPUs (one-GPU machines).")

    num_iterations: int = Field(20, gt=0, description="Rollout + learn iterations.")
    rollout_batch_size: int = Field(32, gt=0, description="Prompts per iteration (seed: experience_batch_size 8).")
    train_batch_size: int = Field(16, gt=0, description="Minibatch of the PPO update; must divide rollout_batch_size.")
    ppo_epochs: int = Field(2, gt=0, description="Passes over each rollout.")
    actor_lr: float = Field(1e-3, gt=0.0, description="Actor (LoRA) learning rate (seed: 5e-6 for real models).")
    critic_lr: float = Field(1e-3, gt=0.0, description="Critic learning rate.")
    kl_coef: float = Field(0.1, ge=0.0, description="Initial KL penalty coefficient (seed 0.1).")
    seed: int | None = Field(None, description="Overrides the pipeline seed for PPO.")

    max_new_tokens: int = Field(16, gt=0, description="Tokens generated per response.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_k: int = Field(50, ge=0, description="Top-k sampling (0: off).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling (1.0: off).")

    checkpoint_every: int = Field(5, gt=0, description="Write a checkpoint artifact every N iterations.")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda' inside the role workers.")

    @model_validator(mode="after")
    def _check_batches(self):
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError(
                f"ppo.train_batch_size ({self.train_batch_size}) must divide ppo.rollout_batch_size "
                f"({self.rollout_batch_size}): pick e.g. train_batch_size={_divisor(self.rollout_batch_size, self.train_batch_size)}"
            )
        return self


def _divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))
