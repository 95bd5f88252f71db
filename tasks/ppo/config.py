"""PPO config: roles and their placement, the algorithm, generation, evaluation, checkpoints.

Checks that need only the config (batch sizes dividing, whole GPUs) live in the validator; checks
that need the environment (ColossalAI installed, GPUs in the Ray cluster) are in
``tasks.ppo.group.check_cluster`` and ``tasks.ppo.train.check_ppo``, run before any actor starts.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.common.model import CHECKPOINT_HELP, Switch

ROLES = ("actor", "critic", "initial", "reward")
LEARNERS = ("actor", "critic")
SHARDED = ("fsdp", "colossalai_zero2", "colossalai_gemini")


class RoleConfig(BaseModel):
    """One PPO role's Ray actor group."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(1, gt=0, description="Ray actors in the group (torch.distributed world size).")
    gpus_per_worker: float | None = Field(None, ge=0.0, description="GPUs per Ray actor; fractions (0.25) let roles share a GPU. None: chosen for the GPUs there are (`resolve_placement`): 0 without GPUs, else the GPU(s) shared by every role.")
    cpus_per_worker: float = Field(0.5, ge=0.0, description="CPUs Ray reserves per actor (also its torch thread count, at least 1).")


class RewardSource(BaseModel):
    """One term of the reward: the trained reward model, a Python function, or an HTTP server.
    ``ppo.rewards`` sums its terms, each times its ``weight`` (tasks/ppo/rewards.py)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["model", "function", "http"] = Field("model", description="'model': the reward model stage's artifact (the `reward` role group); 'function': `function`(prompts, responses, **metadata) -> list[float], run in Ray tasks; 'http': POST {prompts, responses, metadata} to `url`, which answers {rewards: [...]}.")
    weight: float = Field(1.0, description="This term's weight in the sum.")
    function: str | None = Field(None, description="kind 'function': 'package.module:function', importable on every node; its module's source is part of the PPO stage's key.")
    url: str | None = Field(None, description="kind 'http': the endpoint that scores a batch.")
    version: str | None = Field(None, description="kind 'http': the server's scoring version, part of the PPO stage's key (the server's code is not visible here): change it when the scoring changes.")
    timeout_s: float = Field(30.0, gt=0.0, description="kind 'http': seconds to wait for one answer.")
    retries: int = Field(2, ge=0, description="kind 'http': retries after a timeout, a refused connection or a 5xx (exponential backoff from 1 s).")
    num_cpus: float = Field(0.0, ge=0.0, description="kind 'function'/'http': CPUs each scoring Ray task reserves (0: runs beside the roles, whose placement group may hold every CPU).")

    @model_validator(mode="after")
    def _check(self):
        need = {"model": (), "function": ("function",), "http": ("url", "version")}[self.kind]
        for f in ("function", "url", "version"):
            if f in need and not getattr(self, f):
                example = {"function": "'mypkg.verify:score'", "url": "'http://127.0.0.1:8000/score'", "version": "'v1'"}[f]
                raise ValueError(f"a reward of kind {self.kind!r} needs `{f}`: e.g. {f}={example}")
            if f not in need and getattr(self, f) is not None:
                raise ValueError(f"`{f}` ({getattr(self, f)!r}) is not used by a reward of kind {self.kind!r}: remove it, or set kind")
        if self.function is not None:
            mod, _, fn = self.function.partition(":")
            if not mod or not fn or not all(p.isidentifier() for p in mod.split(".") + [fn]):
                raise ValueError(f"function {self.function!r} is not an import path 'package.module:function' (e.g. "
                                 "'tasks.common.builtin:sentiment_reward')")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r}: expected http://host:port/path or https://...")
        return self


# strategies whose actor ranks can hand FastGenerator (tasks/ppo/fast_generate.py) whole parameters:
# DDP and ZeRO-2 hold them (ZeRO-2 shards only the optimizer), Gemini through a plain copy refreshed
# before every rollout (tasks/ppo/group.py ``plain_copy``); FSDP's are sharded DTensors
FAST_GENERATE_STRATEGIES = ("ddp", "colossalai_zero2", "colossalai_gemini")
# FastGenerator's kernel options: ppo option -> the library's kernel; 'triton' is ours, in tasks/ppo/<option>.py
DECODE_KERNELS = {"decode_attention": "sdpa", "decode_linear": "cublas"}


class PPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # -- roles and placement
    strategy: Literal["ddp", "fsdp", "colossalai_zero2", "colossalai_gemini"] = Field("ddp", description="How the learner groups (actor, critic) shard: DDP, torch FSDP2, or ColossalAI ZeRO-2 / Gemini (CUDA, ColossalAI installed). Frozen roles keep a full copy per worker.")
    colossalai_offload: Literal["seed", "optimizer", "none"] = Field("seed", description="What ColossalAI's strategies keep on the CPU: 'seed' = as the seed (Gemini: parameters and optimizer state; ZeRO-2: optimizer state), 'optimizer' = the optimizer state only (Adam steps on the CPU, with the learner's CPUs as threads), 'none' = everything on the GPU (fused CUDA Adam: the fastest where the GPU has room).")
    actor: RoleConfig = Field(default_factory=RoleConfig, description="Policy: generates and learns.")
    critic: RoleConfig = Field(default_factory=RoleConfig, description="Value model: learns.")
    initial: RoleConfig = Field(default_factory=RoleConfig, description="Frozen reference policy for the KL penalty.")
    reward: RoleConfig = Field(default_factory=RoleConfig, description="Frozen reward model.")
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"] = Field("PACK", description="Ray placement-group strategy across the bundles of all role workers (one placement group): PACK = as few nodes as possible, SPREAD = as many as possible, STRICT_SPREAD = every worker on its own node, STRICT_PACK = all on one node.")
    colocate: bool | None = Field(None, description="Bundle i holds worker i of every role, so those share a node and its GPUs (one-GPU machines). None: chosen with gpus_per_worker (`resolve_placement`).")
    reference: Literal["shared", "separate"] = Field("shared", description="The KL reference (the frozen SFT policy): 'shared' = a frozen copy of the SFT adapter on the actor's own base model, run by the actor workers (no second base in memory; the `initial` role group is not started and gets no GPU), 'separate' = the `initial` role group with its own base.")

    # -- the PPO loop
    num_iterations: int = Field(30, gt=0, description="Rollout + learn iterations.")
    rollout_batch_size: int = Field(32, gt=0, description="Responses per iteration: rollout_batch_size / n_samples_per_prompt prompts, each answered n_samples_per_prompt times (seed: experience_batch_size 8).")
    train_batch_size: int = Field(8, gt=0, description="Minibatch per learner worker of one optimizer step; actor/critic num_workers x train_batch_size must divide rollout_batch_size.")
    ppo_epochs: int = Field(2, gt=0, description="Passes over each rollout.")
    actor_lr: float = Field(5e-4, gt=0.0, description="Actor (LoRA) learning rate (tuned for the built-in model; seed: 5e-6 for real models).")
    critic_lr: float = Field(1e-3, gt=0.0, description="Critic learning rate (tuned for the full-parameter critic of the built-in model).")
    critic_lora_rank: int = Field(0, ge=0, description="0: full-parameter critic (weights, gradients and Adam state, fp32 masters with ppo.learner_weights bf16: ~16 bytes a parameter). >0: a LoRA adapter of this rank on the reward model's body, frozen (bf16 on CUDA), plus the value head in full; the memory of one bf16 body. Off by default: critic_lr is tuned for the full-parameter critic.")
    critic_lora_alpha: float = Field(32, gt=0, description="LoRA alpha of the critic (critic_lora_rank > 0).")
    reward_model: Literal["shared", "separate"] = Field("shared", description="With a LoRA critic (critic_lora_rank > 0), 'shared': the critic workers also score, with their adapter disabled (the reward model's own body) and a frozen copy of the reward head, so the body is in memory once and the `reward` role group is not started. 'separate', and always with a full-parameter critic: the `reward` role group.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient norm clip of both learners.")
    eps_clip: float = Field(0.2, gt=0.0, description="PPO ratio clip (seed 0.2).")
    value_clip: float | None = Field(0.4, gt=0.0, description="Value clip around the rollout's values (seed 0.4); None: unclipped.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of GAE and of the critic-free estimators' returns-to-go.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (1.0 with gamma 1.0 gives the seed's reward - value).")
    bucket_by_length: bool = Field(True, description="The learners' minibatches hold rows of similar length (attended tokens, longest first; a group of n_samples_per_prompt moves as one), so their forwards, which skip the columns no row of a minibatch attends, skip more of the padding of ragged rollouts. Off: minibatches in rollout order. The advantages and their whitening are over the whole rollout either way.")
    pack_tokens: int = Field(1024, ge=0, description="No forward on the padding inside the rows: the learners' and scorers' forwards (policy / reference log-probs, values, rewards) run on the rows' real tokens packed into bins of up to this many columns (a longer row gets a bin of its own length), each sequence with its own positions, attending only within itself (tasks/ppo/packing.py; on a GPU the flash varlen kernel, tasks/ppo/varlen.py). 0: off, forwards run on the attended columns of each minibatch, left pads and post-stop columns inside them included. On an H100, minibatches of 16 ragged rows laid out on the CPU as the roles do (bench/useful_mfu.py), 1024-column bins computed 58% of the token slots and the learn epoch ran 1.1-1.4x the unpacked speed at 0.4B and 1.5B, and at 8B (LoRA) 1.19x the packing under a block-diagonal mask (bench/RESULTS.md). Models whose forward cannot take packed rows (remote code; no position_ids, e.g. bloom) run unpacked.")
    whiten_advantages: bool | None = Field(None, description="Whiten advantages over the rollout batch. None: on for gae and reinforce_pp (REINFORCE++'s batch-whitened baseline), off for grpo and rloo (their baseline is the group's).")

    # -- the advantage estimator (tasks/ppo/advantages.py) and the reward (tasks/ppo/rewards.py)
    advantage: Literal["gae", "grpo", "rloo", "reinforce_pp"] = Field("gae", description="'gae': PPO with the critic (a value model from the reward model); critic-free, no critic role and no critic memory: 'grpo' (score minus its group's mean, over its std unless grpo_normalize_std is off), 'rloo' (minus the mean of the other responses to the prompt), 'reinforce_pp' (REINFORCE++: returns whitened over the batch).")
    n_samples_per_prompt: int = Field(1, gt=0, description="Responses sampled per prompt (one group); grpo and rloo need >= 2. Must divide rollout_batch_size; with grpo/rloo also train_batch_size, so a group stays on one learner rank.")
    grpo_normalize_std: bool = Field(True, description="grpo: divide by the group's std (GRPO); off: Dr. GRPO (score minus group mean only).")
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = Field("token_mean", description="How the per-token policy loss (and a KL loss) becomes one number per minibatch: 'token_mean' over all tokens, 'sequence_mean' = mean over responses of their token mean (GRPO), 'constant' = token sum / (responses x max_new_tokens) (Dr. GRPO).")
    kl_penalty: Literal["reward", "loss"] = Field("reward", description="Where the KL to the reference goes: 'reward' = -kl_coef x kl_estimator per token in the reward (PPO), 'loss' = + kl_coef x k3 in the actor's loss (GRPO; kl_estimator then only shapes the reported KL).")
    rewards: list[RewardSource] = Field(default_factory=lambda: [RewardSource()], min_length=1, description="The reward: the weighted sum of these terms (default: the trained reward model alone).")
    missing_eos_penalty: float | None = Field(None, ge=0.0, description="Subtract this from the score of responses that end without a stop token (truncated at max_new_tokens); None: off.")
    ptx_coef: float = Field(0.0, ge=0.0, description="Weight of the pretraining (ptx) LM loss on ptx_train (seed 0.9; off here: the built-in ptx text has random sentiment).")
    ptx_batch_size: int = Field(8, gt=0, description="ptx sequences per optimizer step per actor worker.")

    # -- KL penalty
    kl_coef: float = Field(0.1, ge=0.0, description="Initial KL penalty coefficient (seed 0.1).")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="Per-token KL estimate in the reward: k1 = logp - ref_logp, k3 = exp(-d) + d - 1 (>= 0).")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="Fixed kl_coef, or adaptive towards kl_target (Ziegler et al. 2019).")
    kl_target: float = Field(1.0, gt=0.0, description="Adaptive controller: target KL per sequence.")
    kl_horizon: int = Field(1000, gt=0, description="Adaptive controller: horizon in samples.")

    # -- generation
    max_new_tokens: int = Field(16, gt=0, description="Tokens generated per response.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (log-probs use the same).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off; seed 50). Off by default so the KL estimate is of the policy itself.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling (1.0: off).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that also end a response, besides the model's own stop ids (always on: the tokenizer's eos, generation_config.eos_token_id, which may be a list, and the chat template's turn-end token such as <|im_end|>). The response's score is read at its first stop token.")
    stop_strings: list[str] = Field(default_factory=list, description="Strings that also end a response; each must be a single token of the tokenizer (e.g. '<|eot_id|>'), checked before any model loads.")
    fast_generate: Switch = Field("auto", description="Rollouts with tasks/ppo/fast_generate.py (static KV cache; CUDA graphs on CUDA): 'auto' = on for CUDA actors of a Llama-family model with strategy 'ddp' or 'colossalai_zero2' (whole parameters), or 'colossalai_gemini' (through a plain bf16 copy of the actor's trainable weights, re-filled from Gemini's chunks before every rollout; the frozen base is shared), not 'fsdp', 'on' = also on CPU (eager) and an error where it cannot apply, 'off' = the plain loop of tasks/ppo/generation.py.")
    decode_attention: Literal["auto", "sdpa", "triton"] = Field("auto", description="FastGenerator's attention over the KV cache while decoding: 'sdpa' (torch's scaled_dot_product_attention) or 'triton' (tasks/ppo/decode_attention.py, split-K flash decoding that reads each K/V tile once per GQA group and skips masked columns, and also does RoPE and the K/V cache writes; on an H200, 0.4B, batch 64, 128+128 left-padded prompts: decode step 1.50 ms against SDPA's 2.13, bench/RESULTS.md). 'triton' needs CUDA actors and the triton package; it applies where FastGenerator does (ppo.fast_generate). 'auto': 'triton' where FastGenerator runs on a CUDA GPU and triton imports, else 'sdpa'.")
    decode_linear: Literal["auto", "cublas", "triton"] = Field("auto", description="FastGenerator's linears at a decode step of at most 64 rows: 'cublas' (F.linear) or 'triton' (tasks/ppo/decode_linear.py, a split-K skinny GEMM whose fp32 partials Inductor sums in the next kernel; on Hopper launched as programmatic dependents that prefetch their weights into the L2; on an H100, 0.4B, batch 64, 128+128: decode step 1.24-1.25 ms against cuBLAS's 1.41, its tokens as close to the fp32 model's as cuBLAS's; at 1.5B and 8B slower: 2.17 against 2.08-2.10 ms and 9.37 against 7.07 ms; bench/RESULTS.md). 'auto' (the default): 'triton' where FastGenerator runs on a CUDA GPU, triton imports, the model's hidden size is at most 1024 and it decodes in bf16 / fp16 (where it was measured faster), else 'cublas'. 'triton' by name needs CUDA actors and the triton package; it applies where FastGenerator does (ppo.fast_generate).")

    gradient_checkpointing: Switch = Field("auto", description=CHECKPOINT_HELP + " For the learners (actor, critic).")
    compile: Switch = Field("auto", description="torch.compile each transformer block of the learners (actor, critic): fuses the norms, RoPE, activations and casts around the matmuls; the actor's log-prob head (log-softmax at the actions, entropy) is compiled with them. 'auto' = on for CUDA roles of models of 50M+ parameters (the first iteration pays ~1 min of compilation) except under colossalai_gemini (its chunk hooks do not trace), 'on' = also on CPU, 'off' = eager.")
    learner_weights: Literal["auto", "fp32", "bf16"] = Field("auto", description="The dtype the learners (actor, critic) hold their weights in under ppo.strategy 'ddp' / 'fsdp'. 'fp32': fp32 trainable weights, computed under bf16 autocast on CUDA (every forward casts them). 'bf16': bf16 weights and gradients, fp32 master weights and Adam moments in the optimizer, written back rounded to nearest even after each step (DeepSpeed's bf16 mode): DDP through tasks/common/optim.py's MasterAdamW (one fused Triton pass a parameter on CUDA), FSDP2 through its MixedPrecisionPolicy (bf16 gathered weights over fp32 shards, gradients reduced in fp32); checkpoints carry the masters; the exported adapter is the masters. About 16 bytes a trainable parameter as with 'fp32', but no bf16 copies of fp32 weights under autocast: on an H100 at 1.5B the four-role stage's critic peaked at 22 GiB instead of 29, and one optimizer step of 64 ragged rows learned 1.09-1.10x faster (46.7% useful-token MFU; bench/RESULTS.md). 'auto' = 'bf16' on CUDA unless model.dtype is 'float32' / 'float16', 'fp32' on CPU. ColossalAI's strategies always train this way (their plugins' precision 'bf16').")
    detect_anomaly: bool = Field(False, description="Debugging a NaN: the learners run autograd's anomaly mode (torch.autograd.set_detect_anomaly), so the first backward op that returns a NaN stops the run with the op's name and the forward line that made it. Slow (every op keeps its traceback); with ppo.compile 'off' it names ops, not compiled blocks.")

    # -- evaluation, checkpoints, logging
    eval_every: int = Field(10, gt=0, description="Evaluate on prompts_eval every N iterations (and at start and end).")
    eval_prompts: int | None = Field(None, gt=0, description="Evaluate on the first N eval prompts (None: all).")
    eval_greedy: bool = Field(False, description="Greedy eval responses; off: sampled with a fixed seed (then the KL is an unbiased estimate).")
    checkpoint_every: int = Field(10, gt=0, description="Publish a checkpoint artifact every N iterations.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto': cuda for roles with gpus_per_worker > 0, else cpu.")
    seed: int | None = Field(None, description="Overrides the pipeline seed for PPO.")

    @model_validator(mode="after")
    def _check(self):
        n = self.n_samples_per_prompt
        if self.rollout_batch_size % n:
            raise ValueError(f"ppo.n_samples_per_prompt ({n}) must divide ppo.rollout_batch_size ({self.rollout_batch_size}), "
                             f"the responses per iteration: e.g. rollout_batch_size={_multiple(self.rollout_batch_size, n)}")
        if self.advantage in ("grpo", "rloo"):
            if n < 2:
                raise ValueError(f"ppo.advantage {self.advantage!r} compares the responses to one prompt, so ppo.n_samples_per_prompt "
                                 f"({n}) must be >= 2: e.g. n_samples_per_prompt=4 (or advantage 'reinforce_pp' / 'gae' for one)")
            if self.train_batch_size % n:
                raise ValueError(f"ppo.n_samples_per_prompt ({n}) must divide ppo.train_batch_size ({self.train_batch_size}) with "
                                 f"advantage {self.advantage!r}, so no group is split across minibatches or learner ranks: "
                                 f"e.g. train_batch_size={_multiple(self.train_batch_size, n)}")
        if self.advantage != "gae" and self.critic_lora_rank:
            raise ValueError(f"ppo.critic_lora_rank ({self.critic_lora_rank}): advantage {self.advantage!r} has no critic; "
                             "set critic_lora_rank 0, or advantage 'gae'")
        if sum(r.kind == "model" for r in self.rewards) > 1:
            raise ValueError("ppo.rewards lists kind 'model' more than once: there is one reward model; give its weight once")
        for role in self.learners:
            n = getattr(self, role).num_workers
            if self.rollout_batch_size % (n * self.train_batch_size):
                raise ValueError(
                    f"ppo.rollout_batch_size ({self.rollout_batch_size}) must be divisible by ppo.{role}.num_workers x "
                    f"ppo.train_batch_size ({n} x {self.train_batch_size} = {n * self.train_batch_size}) so that every "
                    f"{role} rank runs the same number of optimizer steps: e.g. rollout_batch_size="
                    f"{_multiple(self.rollout_batch_size, n * self.train_batch_size)}"
                )
        for role in ROLES:
            g = getattr(self, role).gpus_per_worker
            if g is not None and g > 1 and g != int(g):
                raise ValueError(f"ppo.{role}.gpus_per_worker ({g}): above 1 it must be a whole number of GPUs (Ray's rule)")
        if self.compile == "on" and self.strategy == "colossalai_gemini":
            raise ValueError(
                "ppo.compile 'on' with ppo.strategy 'colossalai_gemini': Gemini gathers each parameter chunk from hooks inside "
                "the forward, which torch.compile cannot trace (InternalTorchDynamoError in colossalai's "
                "cuda_accelerator.stream, seen on an H200 with torch 2.11): use ppo.compile 'auto' (eager under Gemini) or 'off'")
        if self.colossalai_offload != "seed" and not self.strategy.startswith("colossalai"):
            raise ValueError(f"ppo.colossalai_offload {self.colossalai_offload!r} applies to ppo.strategy 'colossalai_zero2' / "
                             f"'colossalai_gemini', not {self.strategy!r}: drop it, or choose a ColossalAI strategy")
        if self.learner_weights == "fp32" and self.strategy.startswith("colossalai"):
            raise ValueError(f"ppo.learner_weights 'fp32' with ppo.strategy {self.strategy!r}: ColossalAI's plugins train bf16 weights "
                             "with fp32 masters (precision 'bf16'); use ppo.learner_weights 'auto', or ppo.strategy 'ddp' / 'fsdp' for fp32 weights")
        if self.fast_generate == "on" and self.strategy not in FAST_GENERATE_STRATEGIES:
            raise ValueError(
                f"ppo.fast_generate 'on' needs every actor rank to hold full parameters, but ppo.strategy "
                f"{self.strategy!r} shards them: use ppo.strategy one of {FAST_GENERATE_STRATEGIES}, or ppo.fast_generate 'auto' / 'off'"
            )
        for option, library in DECODE_KERNELS.items():
            if getattr(self, option) == "triton" and (self.fast_generate == "off" or self.strategy not in FAST_GENERATE_STRATEGIES):
                why = "ppo.fast_generate is 'off'" if self.fast_generate == "off" else f"ppo.strategy {self.strategy!r} shards the parameters"
                raise ValueError(f"ppo.{option} 'triton' is FastGenerator's, but {why}, so the plain loop decodes: "
                                 f"set ppo.{option} {library!r}, or ppo.fast_generate 'auto' with ppo.strategy one of "
                                 f"{FAST_GENERATE_STRATEGIES}")
        if any(i < 0 for i in self.stop_token_ids):
            raise ValueError(f"ppo.stop_token_ids {self.stop_token_ids}: token ids are >= 0; drop the negative ones")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"ppo.stop_strings {self.stop_strings}: an empty string can never be generated; drop it")
        if self.device == "cuda" and all(getattr(self, r).gpus_per_worker == 0 for r in self.started_roles):
            raise ValueError("ppo.device 'cuda' but every role has gpus_per_worker 0: give roles GPUs (e.g. 0.25 each with colocate) or use device 'auto'")
        return self

    def bf16_learners(self, device: str) -> bool:
        """Whether the learners hold bf16 weights over fp32 masters on ``device``: ``learner_weights``,
        and always under ColossalAI's strategies (their plugins' precision 'bf16')."""
        return (self.strategy.startswith("colossalai") or self.learner_weights == "bf16"
                or (self.learner_weights == "auto" and device.startswith("cuda")))

    def role(self, name: str) -> RoleConfig:
        return getattr(self, name)

    @property
    def started_roles(self) -> tuple[str, ...]:
        """The role groups that get Ray actors: all four, less `initial` with a shared reference,
        `critic` with a critic-free estimator, and `reward` when the critic serves it or no reward
        term is the model."""
        skip = {"initial"} if self.reference == "shared" else set()
        if not self.uses_critic:
            skip.add("critic")
        if self.reward_on_critic or not self.uses_reward_model:
            skip.add("reward")
        return tuple(r for r in ROLES if r not in skip)

    @property
    def learners(self) -> tuple[str, ...]:
        """The role groups that learn (and checkpoint): actor, and the critic with 'gae'."""
        return tuple(r for r in LEARNERS if r in self.started_roles)

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_reward_model(self) -> bool:
        """A reward term is the trained reward model (kind 'model')."""
        return any(r.kind == "model" for r in self.rewards)

    @property
    def needs_reward_model(self) -> bool:
        """The reward-model stage must run: a reward term is the model, or the critic starts from it."""
        return self.uses_reward_model or self.uses_critic

    @property
    def reward_on_critic(self) -> bool:
        """The critic workers serve the frozen reward model (``reward_model`` 'shared', LoRA critic)."""
        return self.critic_lora_rank > 0 and self.reward_model == "shared" and self.uses_critic and self.uses_reward_model

    @property
    def whiten(self) -> bool:
        """``whiten_advantages`` resolved for the estimator."""
        return self.whiten_advantages if self.whiten_advantages is not None else self.advantage in ("gae", "reinforce_pp")

    @property
    def num_chunks(self) -> int:
        """Experience chunks per iteration: one per minibatch of train_batch_size."""
        return self.rollout_batch_size // self.train_batch_size


def resolve_placement(cfg: PPOConfig, gpus: float) -> PPOConfig:
    """``cfg`` with every unset ``gpus_per_worker`` / ``colocate`` chosen for ``gpus`` GPUs (a pure
    function; values written in the config are kept, and ``check_gpu_fit`` judges them).

    No GPU: 0 everywhere, not colocated (as on CPU). As many GPUs as started role workers: one
    whole GPU per worker. Fewer: every role colocated, each worker 1/(k*c) of a GPU, with k the
    started roles and c = ceil(max num_workers / gpus): bundle i (worker i of every role) then
    holds <= 1/c GPU, and c bundles share each GPU. Roles that are not started (a shared reference's `initial`, a reward model the critic serves) get 0.
    """
    started = cfg.started_roles
    workers = sum(cfg.role(r).num_workers for r in started)
    if gpus <= 0:
        share, colocate = 0.0, False
    elif workers <= gpus:
        share, colocate = 1.0, False
    else:
        per_gpu = math.ceil(max(cfg.role(r).num_workers for r in started) / gpus)
        share, colocate = math.floor(1e4 / (len(started) * per_gpu)) / 1e4, True  # Ray keeps 4 decimals
    data = cfg.model_dump()
    for r in ROLES:
        if data[r]["gpus_per_worker"] is None:
            data[r]["gpus_per_worker"] = share if r in started else 0.0
    if data["colocate"] is None:
        data["colocate"] = colocate
    return PPOConfig.model_validate(data)


def resolve_learner_weights(cfg: PPOConfig, model_dtype: str) -> PPOConfig:
    """``cfg`` with ``learner_weights`` 'auto' made 'fp32' where model.dtype is 'float32' /
    'float16' (the learners keep the weights' dtype the user chose; ColossalAI's plugins train
    bf16 whatever it says); else ``cfg`` itself."""
    if cfg.learner_weights == "auto" and model_dtype in ("float32", "float16") and not cfg.strategy.startswith("colossalai"):
        return cfg.model_copy(update={"learner_weights": "fp32"})
    return cfg


def gpus_needed(cfg: PPOConfig) -> int:
    """Whole GPUs the roles' reservations need as Ray places them (``cfg`` resolved): a colocated
    bundle (worker i of every role) or a worker is one item; items of 1 GPU or more take whole
    GPUs, fractions pack first-fit-decreasing onto shared ones. 0 when no role asks for a GPU."""
    if cfg.colocate:
        n = max(cfg.role(r).num_workers for r in ROLES)
        items = [sum(cfg.role(r).gpus_per_worker for r in ROLES if cfg.role(r).num_workers > i) for i in range(n)]
    else:
        items = [cfg.role(r).gpus_per_worker for r in ROLES for _ in range(cfg.role(r).num_workers)]
    whole = sum(math.ceil(g - 1e-9) for g in items if g >= 1 - 1e-9)
    bins: list[float] = []
    for g in sorted((g for g in items if 0 < g < 1 - 1e-9), reverse=True):
        fit = next((i for i, used in enumerate(bins) if used + g <= 1 + 1e-9), None)
        if fit is None:
            bins.append(g)
        else:
            bins[fit] += g
    return whole + len(bins)


def check_gpu_fit(cfg: PPOConfig, gpus: float, where: str) -> None:
    """The resolved roles' GPU reservations fit on ``gpus`` GPUs (``where`` names them)."""
    if cfg.colocate:
        for i in range(max(cfg.role(r).num_workers for r in ROLES)):
            b = sum(cfg.role(r).gpus_per_worker for r in ROLES if cfg.role(r).num_workers > i)
            if b > 1 and b != int(b):
                raise ValueError(
                    f"ppo.colocate: bundle {i} (worker {i} of every role) asks for {b:g} GPUs, which is neither a "
                    "fraction of one GPU nor whole GPUs: make ppo.<role>.gpus_per_worker of the roles sum to <= 1 "
                    "(e.g. 0.25 each), or leave them unset to have them chosen")
    need = gpus_needed(cfg)
    if need > gpus:
        asked = ", ".join(f"{r} {cfg.role(r).num_workers}x{cfg.role(r).gpus_per_worker:g}" for r in ROLES)
        raise ValueError(
            f"ppo roles need {need} GPU(s) as placed ({asked}; colocate={cfg.colocate}; fractions sharing a GPU "
            f"sum to <= 1) but {where} has {gpus:g}: lower ppo.<role>.gpus_per_worker or ppo.<role>.num_workers, "
            f"or leave gpus_per_worker and colocate unset to have them chosen for {gpus:g} GPU(s)")


def weight_memory_gib(cfg: PPOConfig, lm_params: int, body_params: int, fast_copy: bool) -> dict[str, float]:
    """A lower bound of the GPU memory of one worker of each started GPU role, in GiB: weights,
    gradients and optimizer state only (activations, KV cache and the CUDA context come on top).
    Bases bf16 (2 bytes a parameter; ``lm_params`` the causal LM's, ``body_params`` the reward
    model's body); a full-parameter critic fp32 with fp32 gradients and two Adam moments (16); the
    separate reward model fp32 as loaded (4); ``fast_copy``: the actor's packed bf16 decode copy (2).
    LoRA weights and their state are left out (well under 1%). Sharded learners divide by ranks."""
    full_critic = cfg.critic_lora_rank == 0
    per = {"actor": lm_params * (2 + (2 if fast_copy else 0)), "initial": lm_params * 2,
           "critic": body_params * (16 if full_critic else 2), "reward": body_params * 4}
    out = {}
    for r in cfg.started_roles:
        if cfg.role(r).gpus_per_worker:
            shard = cfg.role(r).num_workers if r in LEARNERS and cfg.strategy != "ddp" else 1
            out[r] = per[r] / shard / 2**30
    return out


def check_gpu_memory(cfg: PPOConfig, per_worker_gib: dict[str, float], gpus: float, gib_per_gpu: float) -> None:
    """The started roles' lower-bound memory (``weight_memory_gib``) fits on the GPUs they share."""
    need = sum(cfg.role(r).num_workers * g for r, g in per_worker_gib.items())
    have = gpus * gib_per_gpu
    if need <= have:
        return
    roles = ", ".join(f"{r} {cfg.role(r).num_workers}x{g:.1f}" for r, g in per_worker_gib.items())
    fix = ("set ppo.critic_lora_rank (e.g. 16): a LoRA critic keeps the reward model's body in bf16 with no gradients or "
           "optimizer state for it, and serves the reward model too (ppo.reward_model shared); or "
           if cfg.critic_lora_rank == 0 and "critic" in per_worker_gib else "")
    raise ValueError(f"ppo roles need at least {need:.0f} GiB of GPU memory for weights and optimizer state alone "
                     f"({roles} GiB per worker) but {gpus:g} GPU(s) of {gib_per_gpu:.0f} GiB hold {have:.0f}: {fix}"
                     "use more GPUs (more num_workers with ppo.strategy fsdp shard the learners), or a smaller model")


def _multiple(n: int, k: int) -> int:
    return max(k, round(n / k) * k)
