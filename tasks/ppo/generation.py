"""Sampling responses from a causal LM and scoring them token by token, for PPO rollouts.

A plain decode loop instead of ``model.generate`` because PPO needs three things generate does
not give: an action mask that stops at the first stop token, a fixed number of columns on every rank,
and the same number of forward steps on every rank of a sharded group (``all_finished``), so
that FSDP / ZeRO collectives inside ``forward`` never wait for a rank that already stopped.

Prompts are LEFT-padded: (B, P) ids with an attention mask. Position ids come from the mask
(``cumsum - 1``), so a row's positions do not depend on how much padding it got, and the same
rule is used in ``action_logprobs``, so the log-probs recomputed for learning match the ones the
sampler saw.

Stop tokens: ``eos_token_id`` is one id or a list of them, as in Hugging Face's ``generate``
(chat models end a turn with ``<|im_end|>`` or ``<|eot_id|>`` as well as ``eos_token``); a row
finishes at the first of any. "EOS" below means any stop id. Whether a row finished comes from
the sampled tokens, never from comparing ids to ``pad_token_id``, which may itself be a stop id
(``pad_token == eos_token`` tokenizers).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from tasks.ppo.losses import entropy_from_logits, logprobs_from_logits
from tasks.ppo.padding import attended_span, cut, pad_actions


class Rollout(NamedTuple):
    sequences: Tensor       # (B, P + N) long: prompt (left-padded) + response (pad after the stop token)
    attention_mask: Tensor  # (B, P + N) long: 1 on real prompt tokens and on actions
    action_mask: Tensor     # (B, N) float: 1 on generated tokens up to and including the first stop token
    ended_with_eos: Tensor  # (B,) bool: the response ended with a stop token (False: truncated at N tokens)


def stop_ids(eos_token_id: int | Sequence[int]) -> list[int]:
    """``eos_token_id`` (one id or several) as a list of ints."""
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """``cumsum(mask) - 1`` clamped at 0: (B, L) -> (B, L) long; left padding gets position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def sample_next(
    logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None, greedy: bool = False,
) -> Tensor:
    """One token per row from ``logits`` (B, V) -> (B,) long.

    Order as in Hugging Face's sampler: divide by ``temperature``, keep the ``top_k`` largest
    (0: all; ties at the k-th value are kept), then the smallest set whose probability reaches
    ``top_p`` (the most likely token always stays), then sample. ``greedy``: argmax, no filtering.

    The draw is ``argmax(p / q)`` with ``q ~ Exp(1)`` per entry: the same random numbers and the
    same tokens as ``torch.multinomial(p, 1, generator=g)`` (which does exactly this for one
    sample), minus its host-side validity checks, so the function can be captured in a CUDA graph
    (``tasks/ppo/fast_generate.py``): no host sync, no tensor built from a Python number.
    """
    if greedy:
        return race(logits)
    p = sample_probs(logits, temperature, top_k, top_p)
    return race(p, exp_draws(p, generator))


def exp_draws(p: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One Exp(1) number per entry of ``p``, from ``generator``: ``torch.multinomial``'s draws."""
    return torch.empty_like(p).exponential_(1.0, generator=generator)


def race(w: Tensor, q: Tensor | None = None) -> Tensor:
    """The token of each row: ``argmax(w / q)`` (the exponential race over probabilities ``w``
    and draws ``q``), or ``argmax(w)`` with no draws (greedy)."""
    return w.argmax(-1) if q is None else (w / q).argmax(-1)


def check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"sample_next: temperature ({temperature}) must be > 0; use greedy=True for argmax")


def sample_probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``sample_next``'s distribution: (B, V) logits -> (B, V) fp32 probabilities after the
    temperature, top-k and top-p (no random numbers: a compiled decode step fuses it)."""
    check_temperature(temperature)
    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return torch.softmax(x, -1)


def _unwrap(model):
    """The Hugging Face model under DDP (``.module``) and PEFT (``get_base_model``) wrappers."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model


@functools.cache
def _forward_params(cls: type) -> frozenset[str]:
    """The argument names of a model class's forward: asked on every forward, inspected once a class."""
    return frozenset(inspect.signature(cls.forward).parameters)


def _cache_kwarg(model) -> str:
    # transformers 5.x renamed forward's ``past_key_values`` to ``cache`` (old name deprecated)
    params = _forward_params(type(_unwrap(model)))
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


@torch.no_grad()
def generate(
    model, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int, eos_token_id: int | Sequence[int],
    pad_token_id: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None, greedy: bool = False,
    all_finished: Callable[[bool], bool] | None = None,
) -> Rollout:
    """Sample up to ``max_new_tokens`` (N) tokens per row with the model's KV cache.

    input_ids, attention_mask: (B, P), LEFT-padded. ``eos_token_id``: the stop id(s). Finished
    rows (a stop id emitted) emit ``pad_token_id`` with attention 0. Stops when every row is finished — as decided by
    ``all_finished(local_done) -> bool`` when given (e.g. an all_reduce over the group), so all
    ranks run the same number of forwards. The result always has N response columns.
    The model runs in eval mode (no dropout while sampling) and its mode is restored after.
    """
    from transformers import DynamicCache

    B, P = input_ids.shape
    N = max_new_tokens
    device = input_ids.device
    attn = attention_mask.long()
    responses = torch.full((B, N), pad_token_id, dtype=torch.long, device=device)
    resp_attn = torch.zeros((B, N), dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(stop_ids(eos_token_id), dtype=torch.long, device=device)
    config = getattr(_unwrap(model), "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    cache_kw = _cache_kwarg(model)

    was_training = model.training
    model.eval()
    # compiled blocks (ppo.compile) run eagerly here: the KV cache's per-layer index would make
    # them recompile once per layer
    with torch.compiler.set_stance("force_eager"):
        try:
            out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids_from_mask(attn),
                        use_cache=True, **{cache_kw: cache})
            next_pos = attn.sum(-1, keepdim=True)  # (B, 1): position of the first response token
            for step in range(N):
                token = sample_next(out.logits[:, -1, :], temperature, top_k, top_p, generator, greedy)
                token = torch.where(finished, torch.full_like(token, pad_token_id), token)
                responses[:, step] = token
                resp_attn[:, step] = (~finished).long()
                finished = finished | torch.isin(token, stops)
                if step == N - 1:
                    break
                done = bool(finished.all())
                if all_finished is not None:
                    done = bool(all_finished(done))
                if done:
                    break
                full_attn = torch.cat([attn, resp_attn[:, : step + 1]], dim=1)
                out = model(input_ids=token[:, None], attention_mask=full_attn, position_ids=next_pos,
                            use_cache=True, **{cache_kw: cache})
                next_pos = next_pos + 1
        finally:
            model.train(was_training)

    return Rollout(
        sequences=torch.cat([input_ids, responses], dim=1),
        attention_mask=torch.cat([attn, resp_attn], dim=1),
        action_mask=resp_attn.float(),
        ended_with_eos=finished,
    )


def packs(model) -> bool:
    """Whether ``model``'s forward honours packed sequences (tasks/ppo/packing.py): a transformers
    model that takes ``position_ids`` and whose attention layers call the attention function its
    config names (``ALL_ATTENTION_FUNCTIONS``: tasks/ppo/varlen.py serves there), without
    attention sinks (gpt-oss's ``s_aux``, which that function has not). Remote code,
    position-free models (bloom's alibi) and models with sinks run padded."""
    cls = type(_unwrap(model))
    return (cls.__module__.startswith("transformers.models.") and "position_ids" in _forward_params(cls)
            and _packable_attention(cls.__module__))


@functools.cache
def _packable_attention(module: str) -> bool:
    """A transformers modeling module whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` and
    passes it no attention sinks (``s_aux``): read once a module."""
    mod = sys.modules[module]
    return hasattr(mod, "ALL_ATTENTION_FUNCTIONS") and "s_aux" not in inspect.getsource(mod)


def _per_position(fn: Callable, logits: Tensor, *rest: Tensor, rows: int = 1024) -> Tensor:
    """``fn`` (a (1, k, V) -> (1, k) helper of tasks/ppo/losses.py) over ``logits`` (..., V) and
    ``rest`` (...) in pieces of ``rows`` positions, -> (...): each piece's (k, V) temporaries
    (log-softmax, softmax) stay small however many positions a forward scores."""
    flat, rest = logits.reshape(-1, logits.shape[-1]), [r.reshape(-1) for r in rest]
    out = torch.cat([fn(lg[None], *(r[None] for r in rs))[0] for lg, *rs in zip(flat.split(rows), *(r.split(rows) for r in rest))])
    return out.view(logits.shape[:-1])


def _action_logits(model, sequences: Tensor, attention_mask: Tensor, num_actions: int, pack_tokens: int = 0, device: torch.device | str | None = None) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """Logits that predicted the actions (as the model returns them), the actions, and the map
    from per-action values back to (B, N) (zeros where nothing was computed). The forward runs on
    ``device`` (default: the sequences'); give the batch on the CPU, as it comes from Ray, and the
    layout is worked out there without making the GPU wait.

    ``pack_tokens`` > 0 (``ppo.pack_tokens``) and a model that ``packs``: the rows' real tokens
    packed into bins of up to that many columns (tasks/ppo/packing.py), the LM head on the K
    positions that predict attended actions: ((K, V), (K,)). Else the forward runs on the attended
    columns (tasks/ppo/padding.py), the LM head on the last n + 1 of them: ((B, n, V), (B, n)),
    n <= N when every row stopped early."""
    dev = sequences.device if device is None else torch.device(device)
    if pack_tokens and packs(model):
        from tasks.ppo.packing import action_positions, forward_packed, head_on, pack

        p = pack(sequences, attention_mask, pack_tokens, device=dev)
        places = action_positions(p, attention_mask, num_actions)  # (B, N) on the CPU
        valid = places >= 0
        which = valid.flatten().nonzero().squeeze(1).to(dev, non_blocking=True)  # the flat (row * N + action) of each kept action
        keep = places[valid].to(dev, non_blocking=True)
        actions = sequences[:, -num_actions:].to(dev, non_blocking=True).flatten()[which]
        base = _unwrap(model)
        with head_on(base.get_output_embeddings(), keep) as ran, forward_packed(base.config, p) as kw:
            logits = model(input_ids=p.input_ids, use_cache=False, **kw).logits
        logits = logits[0] if ran else logits.reshape(-1, logits.shape[-1])[keep]

        def restore(x: Tensor) -> Tensor:
            return torch.zeros(valid.numel(), dtype=x.dtype, device=x.device).index_copy(0, which, x).view(valid.shape)
        return logits, actions, restore
    span = attended_span(attention_mask, num_actions)
    sequences, attention_mask = (cut(t, span).to(dev, non_blocking=True) for t in (sequences, attention_mask))
    n = span.actions
    # position t's logits predict token t+1: the n actions are predicted by positions -n-1 .. -2,
    # so only those n+1 positions go through the LM head (``logits_to_keep``; the prompt's do not)
    kw = {"logits_to_keep": n + 1} if "logits_to_keep" in _forward_params(type(_unwrap(model))) else {}
    out = model(input_ids=sequences, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False, **kw)
    return out.logits[:, -n - 1 : -1, :], sequences[:, -n:], lambda x: pad_actions(x, span)


def action_logprobs(model, sequences: Tensor, attention_mask: Tensor, num_actions: int, temperature: float = 1.0,
                    pack_tokens: int = 0, device: torch.device | str | None = None, compiled: bool = False) -> Tensor:
    """log pi(a_t | prefix) of the last ``num_actions`` (N) tokens of ``sequences`` (B, L) -> (B, N).

    One forward (with grad if enabled), positions from the attention mask. Logits are divided by
    ``temperature`` so the numbers match the distribution ``generate`` sampled from (before
    top-k / top-p). Values after a row's EOS are meaningless (0 when packed); mask them with the
    action mask. ``pack_tokens``, ``device``: see ``_action_logits``; ``compiled``: see ``action_head``.
    The model's mode is left alone: PPO ratios need deterministic forwards, so turn dropout off
    (``eval()`` or dropout 0 in the config; a fresh ``get_peft_model`` is in train mode).
    """
    logits, actions, restore = _action_logits(model, sequences, attention_mask, num_actions, pack_tokens, device)
    return restore(action_head(logits, actions, temperature, compiled=compiled)[0])


def forward_actions(model, sequences: Tensor, attention_mask: Tensor, num_actions: int, temperature: float = 1.0,
                    pack_tokens: int = 0, device: torch.device | str | None = None, compiled: bool = False) -> tuple[Tensor, Tensor]:
    """``action_logprobs`` plus the entropy of each action's distribution: ((B, N), (B, N))."""
    logits, actions, restore = _action_logits(model, sequences, attention_mask, num_actions, pack_tokens, device)
    logp, ent = action_head(logits, actions, temperature, entropy=True, compiled=compiled)
    return restore(logp), restore(ent)


def action_head(logits: Tensor, actions: Tensor, temperature: float, entropy: bool = False,
                compiled: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log softmax(logits / T) at ``actions``, the entropy of softmax(logits / T) or None):
    (..., V), (...) long -> (...) fp32 each, by tasks/ppo/losses.py's helpers on an fp32 copy.

    Eager: the copy whole, the helpers in pieces of 1024 positions. ``compiled`` (the learners
    that compile their blocks, ``ppo.compile``): the helpers over all positions as one
    ``torch.compile``d graph, which reads the logits in their own dtype (on an H100, 4-8k actions
    of a 32k-152k vocabulary: 4.4-5.7x the eager speed, half the memory beside the logits;
    bench/logprob_head.py, bench/RESULTS.md)."""
    if compiled:
        out = _compiled_head(entropy)(logits.reshape(-1, logits.shape[-1]), actions.reshape(-1), temperature)
        return tuple(o.view(actions.shape) for o in out) if entropy else (out.view(actions.shape), None)
    x = logits.float() / temperature
    return _per_position(logprobs_from_logits, x, actions), _per_position(entropy_from_logits, x) if entropy else None


@functools.cache
def _compiled_head(entropy: bool) -> Callable:
    """``action_head``'s compiled graph for (K, V) logits and (K,) actions (built on first use;
    dynamic sizes, so every K shares it)."""
    def head(logits: Tensor, actions: Tensor, temperature: float):
        x = (logits.float() / temperature)[None]  # one (1, K, V) piece
        logp = logprobs_from_logits(x, actions[None])[0]
        return (logp, entropy_from_logits(x)[0]) if entropy else logp
    return torch.compile(head, dynamic=True)
