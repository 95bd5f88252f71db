"""The four PPO roles as Ray actor classes (the experience they learn from: tasks/ppo/experience.py).

Each class is a plain Python class with typed methods; ``RoleGroup`` turns it into Ray actors
and the driver calls ``worker.method.remote(...)``. Tensors travel as ``Rollout`` /
``Experience`` NamedTuples inside Ray object refs. Shapes: B rows, L = P + N tokens (left-padded
prompt + N = max_new_tokens response columns).

Scoring (``logprobs``, ``reference_logprobs``, ``values``, ``score``) takes any number of rollout
chunks and gives one Ray return per chunk: the driver sends each worker all of its chunks of an
iteration in one call, and the worker scores them in as few forwards as fit
(``tasks.ppo.padding.score_together``): the actor and the reference ``logit_rows`` rows a forward,
the critic and the reward model every row in one.

Rollouts: with ``ppo.fast_generate`` (default 'auto': CUDA, Llama-family, DDP / ZeRO-2 / Gemini)
the actor decodes with ``FastGenerator`` (static KV cache, the whole decode step as a CUDA graph)
over a packed copy of its weights with the LoRA adapter merged in, re-filled in place before every
rollout, so an optimizer step is seen by the next rollout; else the plain loop. Under Gemini it
reads a ``plain_copy`` of the actor whose trainable weights are loaded from Gemini's gathered
state before each rollout.

The KL reference with ``ppo.reference`` 'shared' (default): the actor loads the SFT adapter a
second time, frozen, as adapter ``reference`` on its own base, and ``reference_logprobs`` runs
the forward with that adapter active (``_active_adapter``): the base weights are in memory once
and only the adapter's weights are doubled. Before the first update the two adapters are equal
and the forward is the same code, so the KL is exactly 0. (Disabling the adapter, as TRL does,
would give the pretrained base, not the SFT policy this pipeline starts PPO from.)

Learners run in eval mode: dropout (the SFT adapter's LoRA dropout) stays off, so log-probs at
learning time match the rollout's (TRL disables dropout in PPO for the same reason).

On CUDA the scoring and learning forwards run under bf16 autocast; the learners' weights are
bf16 with fp32 masters of the trainable ones in the optimizer (``ppo.learner_weights`` 'auto' / 'bf16',
``group.wrap_learner``) or fp32 ('fp32'); generation runs in the weights' dtype. With
``ppo.compile`` the learners' transformer blocks are ``torch.compile``d.
"""

from __future__ import annotations

import logging
import random
from contextlib import contextmanager
from typing import Callable

import torch
from torch import Tensor

from storage.store import ArtifactRef
from tasks.common.loop import autocast
from tasks.common.model import checkpoint_blocks
from tasks.ppo.config import PPOConfig
from tasks.ppo.experience import NONFINITE_ADVICE, Experience
from tasks.ppo.fast_generate import fast_generate_applies
from tasks.ppo.group import (DistributedWorker, agree_finished, as_returns, compile_blocks, full_state, load_full_state, load_trainable,
                             plain_copy, prime_cpu_adam, wants_compile, wrap_learner)
from tasks.ppo.packing import action_positions, forward_packed, pack, unpack
from tasks.ppo.padding import attended_span, cut, logit_rows, pad_actions, score_together


def _chunks(rollout, n: int):
    """Split a Rollout into ``n`` equal row chunks (each a Rollout)."""
    size = rollout.sequences.shape[0] // n
    return [type(rollout)(*(t[i * size:(i + 1) * size] for t in rollout)) for i in range(n)]


def _rng_state(*generators: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "generators": [g.get_state() for g in generators]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, *generators: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    for g, s in zip(generators, state["generators"]):
        g.set_state(s)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _digest(weights: dict) -> float:
    """A number that differs when any trainable weight differs (for cross-rank checks)."""
    return float(sum((v.double() * (i + 1)).sum() for i, (_, v) in enumerate(sorted(weights.items()))))


REFERENCE_ADAPTER = "reference"


@contextmanager
def active_adapter(model, name: str):
    """Run ``model``'s LoRA layers with adapter ``name`` only, leaving ``requires_grad`` as it is
    (PEFT's ``set_adapter`` would make that adapter trainable and freeze the others)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = [name]
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._active_adapter = b


def _nonfinite_report(model, inputs: dict[str, Tensor]) -> str:
    """Which gradient tensors and loss inputs hold non-finite numbers, for the learners' stop."""
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    total = sum(p.grad is not None for p in model.parameters())
    parts = [f"{len(bad)} of {total} gradient tensors not finite: {', '.join(bad[:3])}{' ... ' + ', '.join(bad[-3:]) if len(bad) > 6 else ''}"
             if bad else "every gradient tensor finite"]
    for name, t in inputs.items():
        n = int((~torch.isfinite(t.detach())).sum())
        parts.append(f"{name}: {n} of {t.numel()} not finite, max |x| {float(t.detach().float().nan_to_num(0, 0, 0).abs().max()):.3g}")
    return "; ".join(parts)


def _nonfinite_loss(role: str, rank: int, loss: Tensor) -> str:
    return f"ppo: the {role}'s loss is {float(loss.detach())} (rank {rank}); the step was not taken, and {NONFINITE_ADVICE}"


class _LearnerMixin:
    """Shared by the two learners: optimizer step and state for checkpoints."""

    def _step(self, loss: Tensor, inputs: Callable[[], dict[str, Tensor]] = dict) -> None:
        """One optimizer step on ``loss``; stops before it on a non-finite loss or gradient norm,
        naming the gradient tensors and the loss inputs that are not finite (``inputs()`` -> name ->
        tensor, called only then). The loss and the norm are read together after the backward: one
        host sync a step, so the GPU is not left idle while the host issues the backward."""
        colossalai = self.strategy.startswith("colossalai")
        # ZeRO's backward, and anomaly mode's (it would name the loss's own backward op), need the loss checked first
        if (colossalai or torch.is_anomaly_enabled()) and not bool(torch.isfinite(loss.detach())):
            raise FloatingPointError(_nonfinite_loss(self.role, self.rank, loss))
        if colossalai:
            self.optim.backward(loss)  # ZeRO's backward reduces the gradients; the plugin clips (wrap_learner)
            prime_cpu_adam(self.optim)  # exact resume (tasks/ppo/group.py)
        else:
            loss.backward()  # on a non-finite loss too: the check below stops the run before any step
            # the norm first, clipping after the check: clipping by a NaN norm makes every gradient NaN
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
            # read after the backward and the norm are queued: the host waits once, for all of them
            if not bool(torch.isfinite(loss.detach())):  # a step on it would make every weight NaN
                raise FloatingPointError(_nonfinite_loss(self.role, self.rank, loss))
            if not bool(torch.isfinite(norm)):
                raise FloatingPointError(  # a finite loss, a non-finite gradient: same stop, before the step
                    f"ppo: the {self.role}'s gradient norm is {float(norm)} (rank {self.rank}; {_nonfinite_report(self.model, inputs())}); "
                    f"the step was not taken, and {NONFINITE_ADVICE}. To name the backward op that made it, rerun with "
                    "ppo.detect_anomaly true and ppo.compile 'off'")
            torch.nn.utils.clip_grads_with_norm_(self.params, self.ppo.max_grad_norm, norm)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def save_checkpoint(self, store, key: str, iteration: int) -> dict:
        """Write this rank's shard of the checkpoint straight to the store (``tasks.ppo.checkpoint``):
        rank 0 the full trainable weights and optimizer state (collective for sharded strategies:
        every rank calls it), every rank its RNG states. Returns the shard's ref as a dict."""
        from tasks.ppo.checkpoint import write_shard

        weights, optim = full_state(self.model, self.optim, self.strategy)
        ref = write_shard(store, key, iteration, self.role, self.rank, weights if self.rank == 0 else None,
                          optim if self.rank == 0 else None, _rng_state(*self._generators()))
        return ref.model_dump(mode="json")

    def load_checkpoint(self, store, full: ArtifactRef, mine: ArtifactRef) -> None:
        """Restore from rank 0's shard (weights, optimizer) and this rank's (RNG), read from the store."""
        from tasks.ppo.checkpoint import read_shard

        self.load_state(**read_shard(store, full, mine))

    def load_state(self, weights: dict, optim: dict, rng: dict) -> None:
        load_full_state(self.model, weights, self.optim, optim, self.strategy)
        _set_rng_state(rng, *self._generators())

    def local_digest(self) -> float:
        """Digest of this rank's own copy of the trainable weights (DDP: a full replica)."""
        return _digest({n: p.detach() for n, p in self.infer_model.named_parameters() if p.requires_grad})


class PolicyWorker(_LearnerMixin, DistributedWorker):
    """Actor: base model + SFT LoRA adapter (trainable); samples rollouts and learns with PPO."""

    def load(self, model_cfg, store, sft: ArtifactRef, data: ArtifactRef, ppo: PPOConfig, pad_id: int, stop_ids: list[int]) -> None:
        """``stop_ids``: every id that ends a response (``tasks.ppo.train.resolve_stop_ids``)."""
        from peft import PeftModel

        from tasks.common.model import load_causal_lm
        from tasks.data.dataset import read_jsonl

        self.ppo, self.pad_id, self.stop_ids = ppo, pad_id, stop_ids
        base = load_causal_lm(model_cfg, self.device)
        if ppo.pack_tokens and self.rank == 0:
            from tasks.ppo.generation import packs

            if not packs(base):
                logging.getLogger("rlhf.ppo").info(
                    "ppo.pack_tokens %d: %s (%s) cannot take packed rows (remote code, no position_ids, or attention sinks), so every "
                    "forward of this run is unpacked", ppo.pack_tokens, type(base).__name__, type(base).__module__)
        adapter = str(store.fetch(sft) / "adapter")
        peft = PeftModel.from_pretrained(base, adapter, is_trainable=True).eval()
        if ppo.reference == "shared":  # the frozen SFT policy for the KL, on the same base (module docstring)
            peft.load_adapter(adapter, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        checkpoint_blocks(peft, ppo.gradient_checkpointing, self.device)
        torch.autograd.set_detect_anomaly(ppo.detect_anomaly, check_nan=True)  # process-wide: this learner's backward
        # compiled blocks: the log-probs' head compiled too (generation.action_head)
        self.compiled_blocks = wants_compile(ppo.compile, self.device, peft, self.strategy)
        if self.compiled_blocks:
            compile_blocks(peft)
        self.model, self.optim, self.infer_model = wrap_learner(peft, ppo.actor_lr, self.strategy, self.device, ppo.max_grad_norm,
                                                                      ppo.colossalai_offload, ppo.bf16_learners(self.device))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.all_finished = agree_finished(self.strategy, self.device)
        # sampling draws on the device the logits are on (torch.multinomial needs a generator there)
        self.sample_gen = torch.Generator(self.device).manual_seed(self.seed * 7919 + self.rank)
        self.learn_gen = torch.Generator().manual_seed(self.seed * 7919 + 101 + self.rank)
        self.ptx = read_jsonl(store.fetch(data) / "ptx_train.jsonl") if ppo.ptx_coef > 0 else []
        self.fast = fast_generate_applies(ppo.fast_generate, self.strategy, self.device, base.config)
        # what rollouts decode with: Gemini's own forward cannot feed FastGenerator (group.plain_copy)
        self.rollout_model = plain_copy(self.infer_model.module, self.device) \
            if self.fast and self.strategy == "colossalai_gemini" else self.infer_model
        self.rows = logit_rows(ppo.train_batch_size, ppo.max_new_tokens, base.config.vocab_size)
        self.fast_gen = None  # built at the first rollout, sized to it

    def _generators(self):
        return self.sample_gen, self.learn_gen

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], split: int = 1, greedy: bool = False, seed: int | None = None):
        """Responses to ``prompts`` (token ids), returned as ``split`` Rollout chunks (one Ray
        return each). ``seed``: a fresh generator (evaluation) instead of the training one."""
        from tasks.data.dataset import collate_prompts
        from tasks.ppo.generation import generate

        batch = collate_prompts([{"prompt_ids": p} for p in prompts], self.pad_id)
        gen = self.sample_gen if seed is None else torch.Generator(self.device).manual_seed(seed + self.rank)
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        kw = dict(max_new_tokens=self.ppo.max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                  temperature=self.ppo.temperature, top_k=self.ppo.top_k, top_p=self.ppo.top_p,
                  generator=gen, greedy=greedy, all_finished=self.all_finished)
        if self.fast:
            if self.rollout_model is not self.infer_model:  # the trainable weights as Gemini's forward has them
                load_trainable(self.rollout_model, full_state(self.model, self.optim, self.strategy, with_optimizer=False)[0])
            ro = self._fast_generator(*ids.shape).generate(ids, mask, **kw)
        else:
            ro = generate(self.infer_model, ids, mask, **kw)
        return as_returns(_chunks(type(ro)(*(t.cpu() for t in ro)), split))

    def _fast_generator(self, batch: int, prompt_len: int):
        """The FastGenerator over the actor's model (it re-reads the weights at every rollout);
        rebuilt larger when a rollout does not fit its cache."""
        from tasks.ppo.fast_generate import FastGenerator

        fg, need = self.fast_gen, prompt_len + self.ppo.max_new_tokens
        if fg is None or batch > fg.max_batch or need > fg.max_len:
            per_worker = self.ppo.rollout_batch_size // self.world_size
            rows = max(batch, per_worker, fg.max_batch if fg else 0)
            cols = max(-(-need // 64) * 64, fg.max_len if fg else 0)  # round up: fewer rebuilds as prompts vary
            self.fast_gen = fg = None  # free the old cache and graphs first
            self.fast_gen = FastGenerator(self.rollout_model, max_batch=rows, max_len=cols, attention=self.ppo.decode_attention,
                                         linear=self.ppo.decode_linear)
        return self.fast_gen

    def rollout_info(self) -> dict:
        """Which decode path rollouts take: {'fast_generate', 'cuda_graphs', 'graph_batch_sizes',
        'weight_copy_gib', 'compiled', 'attention', 'linear', 'compact'} (see ``FastGenerator.info``; attention and
        linear None: the plain loop's)."""
        info = {"fast_generate": self.fast, "cuda_graphs": False, "graph_batch_sizes": [], "weight_copy_gib": 0.0, "compiled": False,
                "attention": None, "linear": None, "compact": False}
        return info | (self.fast_gen.info() if self.fast_gen else {})

    def _forward_actions(self, rollout) -> tuple[Tensor, Tensor]:
        """(log-probs, entropy) of the rollout's actions under the active adapter: (B, N) each."""
        from tasks.ppo.generation import forward_actions

        with autocast(self.device):
            logp, ent = forward_actions(self.infer_model, rollout.sequences, rollout.attention_mask, rollout.action_mask.shape[1],
                                        self.ppo.temperature, self.ppo.pack_tokens, self.device, self.compiled_blocks)
        return logp.cpu(), ent.cpu()

    @torch.no_grad()
    def logprobs(self, *rollouts):
        """(log-probs, entropy) of each rollout's actions under the current policy: (B_j, N) each,
        one return per rollout."""
        return as_returns(score_together(self._forward_actions, rollouts, self.rows))

    @torch.no_grad()
    def reference_logprobs(self, *rollouts):
        """Log-probs (B_j, N) of each rollout's actions under the frozen SFT adapter (``ppo.reference``
        'shared'), one return per rollout."""
        with active_adapter(self.infer_model, REFERENCE_ADAPTER):
            return as_returns([logp for logp, _ in score_together(self._forward_actions, rollouts, self.rows)])

    def learn(self, kl_coef: float, *experience: Experience) -> dict[str, float]:
        """ppo_epochs passes over this rank's minibatches, one optimizer step each. ``kl_coef``:
        the weight of the KL loss term (``ppo.kl_penalty`` 'loss'; unused with 'reward')."""
        from tasks.ppo.experience import loss_aggregation
        from tasks.ppo.generation import action_logprobs
        from tasks.ppo.losses import kl_loss, ppo_clip_loss

        aggregate = loss_aggregation(self.ppo)
        kl_in_loss = self.ppo.kl_penalty == "loss"
        stats = {"policy_loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "ptx_loss": 0.0, **({"kl_loss": 0.0} if kl_in_loss else {})}
        steps = 0
        for _ in range(self.ppo.ppo_epochs):
            for i in torch.randperm(len(experience), generator=self.learn_gen).tolist():
                e = Experience(*(t.to(self.device, non_blocking=True) for t in experience[i]))
                with autocast(self.device):  # the batch's layout from its CPU copy: tasks/ppo/packing.py
                    logp = action_logprobs(self.model, experience[i].sequences, experience[i].attention_mask, e.action_mask.shape[1],
                                           self.ppo.temperature, self.ppo.pack_tokens, self.device, self.compiled_blocks)
                    pl = ppo_clip_loss(logp, e.logprobs, e.advantages, e.action_mask, self.ppo.eps_clip, aggregate)
                    loss = pl.loss
                    if kl_in_loss:
                        kl = kl_loss(logp, e.ref_logprobs, e.action_mask, aggregate)
                        loss = loss + kl_coef * kl
                        stats["kl_loss"] += kl.detach().float()
                    if self.ppo.ptx_coef > 0:
                        ptx = self._ptx_loss()
                        loss = loss + self.ppo.ptx_coef * ptx
                        stats["ptx_loss"] += ptx.detach().float()
                self._step(loss, lambda: {"log-probs": logp, "old log-probs": e.logprobs, "advantages": e.advantages,
                                          "log-ratio": logp - e.logprobs})
                stats["policy_loss"] += pl.loss.detach().float()  # summed on the device, read once after the epochs
                stats["clip_fraction"] += pl.clip_fraction.float()
                stats["approx_kl"] += pl.approx_kl.float()
                steps += 1
        return {k: float(v) / steps for k, v in stats.items()}

    def _ptx_loss(self) -> Tensor:
        from tasks.data.dataset import collate_lm

        idx = torch.randint(len(self.ptx), (self.ppo.ptx_batch_size,), generator=self.learn_gen).tolist()
        b = {k: v.to(self.device) for k, v in collate_lm([self.ptx[i] for i in idx], self.pad_id).items()}
        return self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"], use_cache=False).loss

    def adapter_files(self) -> dict[str, bytes] | None:
        """The adapter as ``save_pretrained`` writes it (rank 0; collective when sharded)."""
        import tempfile
        from pathlib import Path

        weights, _ = full_state(self.model, self.optim, self.strategy, with_optimizer=False)
        if self.rank != 0:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            from tasks.common.lora import save_adapter

            # the base weights stay untouched (as in SFT's adapter): no embedding copy
            peft = self.infer_model.module if self.strategy == "colossalai_gemini" else self.infer_model  # GeminiDDP wraps the PeftModel
            save_adapter(peft, tmp, state_dict=weights, selected_adapters=["default"], save_embedding_layers=False)
            return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


class ReferenceWorker(DistributedWorker):
    """Initial policy: base + the same SFT adapter, frozen; log-probs for the KL penalty."""

    def load(self, model_cfg, store, sft: ArtifactRef, ppo: PPOConfig) -> None:
        from peft import PeftModel

        from tasks.common.model import load_causal_lm

        self.ppo = ppo
        base = load_causal_lm(model_cfg, self.device)
        self.model = PeftModel.from_pretrained(base, str(store.fetch(sft) / "adapter")).eval().requires_grad_(False)
        if ppo.bf16_learners(self.device):  # as the actor's weights (group.wrap_learner): no KL before the first step
            from tasks.common.optim import params_to_bf16

            params_to_bf16(self.model)
        self.rows = logit_rows(ppo.train_batch_size, ppo.max_new_tokens, base.config.vocab_size)

    def _logprobs(self, rollout) -> Tensor:
        from tasks.ppo.generation import action_logprobs

        with autocast(self.device):
            return action_logprobs(self.model, rollout.sequences, rollout.attention_mask, rollout.action_mask.shape[1],
                                   self.ppo.temperature, self.ppo.pack_tokens, self.device).cpu()

    @torch.no_grad()
    def reference_logprobs(self, *rollouts):
        """Log-probs (B_j, N) of each rollout's actions, one return per rollout."""
        return as_returns(score_together(self._logprobs, rollouts, self.rows))


class RewardWorker(DistributedWorker):
    """Frozen reward model: one score per sequence."""

    def load(self, store, rm: ArtifactRef, ppo: PPOConfig) -> None:
        from tasks.rm.model import load_reward_model

        self.ppo = ppo
        self.model = load_reward_model(str(store.fetch(rm)), device=self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, *rollouts):
        """The score (B_j,) of each rollout's rows, one return per rollout (all in one forward)."""
        return as_returns(score_together(self._score, rollouts))

    def _score(self, rollout) -> Tensor:
        # the reward model reads the last token of the attention mask — the first stop token, or
        # the last one of a truncated response — and takes positions from the mask, so left-padded
        # rollouts score as the right-padded pairs it was trained on (pad == eos changes nothing)
        with autocast(self.device):
            return score_rows(self.model, rollout, self.ppo.pack_tokens, self.device)


def score_rows(rm, rollout, pack_tokens: int, device: str, head=None) -> Tensor:
    """``rm``'s score (B,) of each rollout row at its last attended token, fp32 on the CPU: the real
    tokens packed (tasks/ppo/packing.py, ``ppo.pack_tokens``) or the attended columns only
    (tasks/ppo/padding.py)."""
    from tasks.ppo.generation import packs

    seqs, attn = rollout.sequences, rollout.attention_mask
    if pack_tokens and packs(rm.body):
        p = pack(seqs, attn, pack_tokens, device=device)
        last = p.index.amax(1).to(device, non_blocking=True)
        with forward_packed(rm.config, p) as kw:
            return rm.values(p.input_ids, None, head, **kw).reshape(-1)[last].float().cpu()
    span = attended_span(attn, rollout.action_mask.shape[1])  # no forward on all-pad columns
    return rm(cut(seqs, span).to(device), cut(attn, span).to(device), head=head).float().cpu()


class _Values(torch.nn.Module):
    """The critic's forward: per-token values of the reward model's head, so DDP/FSDP hook it."""

    def __init__(self, rm, pack_tokens: int = 0):
        super().__init__()
        self.rm, self.pack_tokens = rm, pack_tokens

    def inputs(self, input_ids: Tensor, attention_mask: Tensor, num_actions: int, device) -> tuple:
        """The forward's arguments for a batch (B, L), laid out where the batch is: given on the
        CPU (as Ray hands it), the GPU waits for nothing (tasks/ppo/packing.py). Only the real
        tokens go through the body, packed, or the attended columns (tasks/ppo/padding.py)."""
        from tasks.ppo.generation import packs

        dev = torch.device(device)
        if self.pack_tokens and packs(self.rm.body):
            p = pack(input_ids, attention_mask, self.pack_tokens, device=dev)
            states = action_positions(p, attention_mask, num_actions).to(dev, non_blocking=True)
            return p.input_ids, None, num_actions, (p._replace(index=None), states)  # index: CPU-side, not the forward's
        span = attended_span(attention_mask, num_actions)
        return cut(input_ids, span).to(dev, non_blocking=True), cut(attention_mask, span).to(dev, non_blocking=True), num_actions, span

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, num_actions: int, layout=None) -> Tensor:
        """Values (B, N) of the states before the actions: values[t] estimates the return after
        token t, so the state before action a_t is t - 1. Without ``layout``, of the batch
        (``inputs`` on its device); with it, the arguments are ``inputs``' own: the cut columns
        (``layout`` a Span) or the bins (attention_mask None, ``layout`` their Packed and the (B, N)
        places of the states)."""
        if layout is None:
            input_ids, attention_mask, num_actions, layout = self.inputs(input_ids, attention_mask, num_actions, input_ids.device)
        if attention_mask is None:
            p, states = layout
            with forward_packed(self.rm.config, p) as kw:
                return unpack(self.rm.values(input_ids, None, **kw).float(), states)
        values = self.rm.values(input_ids, attention_mask)
        return pad_actions(values[:, -layout.actions - 1:-1].float(), layout)


class CriticWorker(_LearnerMixin, DistributedWorker):
    """Value model initialised from the reward model; learns the returns. Full parameters, or with
    ``ppo.critic_lora_rank`` a LoRA adapter on the frozen body (bf16 on CUDA) + the value head;
    then with ``ppo.reward_model`` 'shared' it also serves the reward model's scores (``score``)."""

    def load(self, store, rm: ArtifactRef, ppo: PPOConfig) -> None:
        import copy

        from tasks.rm.model import load_reward_model

        self.ppo = ppo
        # built on the CPU and moved once: an 8B body is cast to bf16 before it reaches the GPU
        rm = load_reward_model(str(store.fetch(rm)), device="cpu").eval()
        if ppo.critic_lora_rank:
            from peft import LoraConfig, get_peft_model

            from tasks.common.lora import resolve_target_modules

            self.reward_head = copy.deepcopy(rm.head).requires_grad_(False).to(self.device)  # fp32, as trained
            rm.requires_grad_(False)
            if self.device == "cuda":
                rm.body.to(torch.bfloat16)
            targets = resolve_target_modules("auto", rm.body, field="ppo.critic_lora_rank")
            rm.body = get_peft_model(rm.body, LoraConfig(r=ppo.critic_lora_rank, lora_alpha=ppo.critic_lora_alpha,
                                                         target_modules=targets, task_type="FEATURE_EXTRACTION"))
            rm.head.requires_grad_(True)
        else:
            rm.requires_grad_(True)
        rm.to(self.device)
        checkpoint_blocks(rm, ppo.gradient_checkpointing, self.device)
        torch.autograd.set_detect_anomaly(ppo.detect_anomaly, check_nan=True)  # process-wide: this learner's backward
        if wants_compile(ppo.compile, self.device, rm, self.strategy):
            compile_blocks(rm)
        self.values_module = _Values(rm, ppo.pack_tokens)  # unwrapped: its ``inputs`` lays out the forwards on the CPU
        self.model, self.optim, self.infer_model = wrap_learner(self.values_module, ppo.critic_lr, self.strategy, self.device, ppo.max_grad_norm,
                                                                      ppo.colossalai_offload, ppo.bf16_learners(self.device))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.learn_gen = torch.Generator().manual_seed(self.seed * 7919 + 202 + self.rank)

    @torch.no_grad()
    def score(self, *rollouts):
        """The frozen reward model's score (B_j,) of each rollout's rows (``ppo.reward_model``
        'shared'), one return per rollout (all in one forward): this worker's body with the LoRA
        adapter disabled, which is the reward model's body, and its head as loaded."""
        return as_returns(score_together(self._score, rollouts))

    def _score(self, rollout) -> Tensor:
        rm = self.infer_model.rm
        with rm.body.disable_adapter(), autocast(self.device):
            return score_rows(rm, rollout, self.ppo.pack_tokens, self.device, head=self.reward_head)

    def _generators(self):
        return (self.learn_gen,)

    @torch.no_grad()
    def values(self, *rollouts):
        """Values (B_j, N) of each rollout's states, one return per rollout (all in one forward)."""
        return as_returns(score_together(self._values, rollouts))

    def _values(self, rollout) -> Tensor:
        with autocast(self.device):
            return self.infer_model(*self._inputs(rollout.sequences, rollout.attention_mask, rollout.action_mask.shape[1])).cpu()

    def _inputs(self, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> tuple:
        """The critic forward's arguments for a batch on the CPU (``_Values.inputs``)."""
        return self.values_module.inputs(sequences, attention_mask, num_actions, self.device)

    def learn(self, *experience: Experience) -> dict[str, float]:
        from tasks.ppo.losses import value_loss

        loss_sum, clip_sum, steps = 0.0, 0.0, 0
        for _ in range(self.ppo.ppo_epochs):
            for i in torch.randperm(len(experience), generator=self.learn_gen).tolist():
                e = Experience(*(t.to(self.device, non_blocking=True) for t in experience[i]))
                with autocast(self.device):  # the forward's layout from the batch's CPU copy
                    v = self.model(*self._inputs(experience[i].sequences, experience[i].attention_mask, e.action_mask.shape[1]))
                    vl = value_loss(v, e.values, e.returns, e.action_mask, self.ppo.value_clip)
                self._step(vl.loss, lambda: {"values": v, "old values": e.values, "returns": e.returns})
                # summed on the device, read once after the epochs
                loss_sum, clip_sum, steps = loss_sum + vl.loss.detach().float(), clip_sum + vl.clip_fraction.float(), steps + 1
        return {"value_loss": float(loss_sum) / steps, "value_clip_fraction": float(clip_sum) / steps}
