"""Experience making: from a rollout's log-probs, reward terms (and the critic's values) to the
advantages the learners train on, for every estimator (``ppo.advantage``). Runs as a Ray task.

Shapes: chunks of ``B_j`` rows each, ``N`` action columns (the same for every chunk, so the batch
is their concatenation along rows); the groups of ``n_samples_per_prompt`` rows never straddle a
chunk (the config makes train_batch_size a multiple of the group for grpo / rloo).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tasks.ppo.config import PPOConfig


class Experience(NamedTuple):
    sequences: Tensor       # (B, L) long
    attention_mask: Tensor  # (B, L) long
    action_mask: Tensor     # (B, N) float
    logprobs: Tensor        # (B, N) actor log-probs at rollout time
    values: Tensor          # (B, N) critic values at rollout time (0 without a critic)
    advantages: Tensor      # (B, N) (whitened over the rollout batch when configured)
    returns: Tensor         # (B, N)
    ref_logprobs: Tensor    # (B, N) reference log-probs (the KL loss term, ppo.kl_penalty 'loss')


def loss_aggregation(ppo: PPOConfig):
    """The ``(x, mask) -> scalar`` of ``ppo.loss_aggregation`` (tasks/ppo/advantages.py)."""
    from tasks.ppo.advantages import constant_normalizer, sequence_mean, token_mean

    if ppo.loss_aggregation == "constant":
        return constant_normalizer(ppo.max_new_tokens)
    return sequence_mean if ppo.loss_aggregation == "sequence_mean" else token_mean


# what to try when a role computes a non-finite number (check_finite, and the learners' loss check)
NONFINITE_ADVICE = ("the checkpoints written so far are kept. model.dtype 'float32' tells bf16's range from the rest, "
                    "and a lower ppo.actor_lr / ppo.critic_lr helps when it appears only after some iterations")


def check_finite(named: dict[str, Tensor], mask: Tensor) -> None:
    """Stop before any learner trains on a non-finite number a role computed: ``named`` maps what
    it is ('the critic's values', ...) to (B, N) per-action tensors (checked where ``mask`` is 1)
    or (B,) per-row ones. A NaN advantage turns every weight NaN in one step, and the run would go
    on to publish them (seen on the H200: value_loss nan from the first iteration)."""
    m = mask.bool()
    for what, x in named.items():
        bad = ~torch.isfinite(x) & (m if x.shape == m.shape else torch.ones_like(x, dtype=torch.bool))
        if bad.any():
            rows = bad.reshape(len(x), -1).any(-1)
            raise FloatingPointError(
                f"ppo: {what} are not finite ({', '.join(sorted({str(v) for v in x[bad].tolist()}))}) at {int(bad.sum())} "
                f"{'action positions' if x.dim() > 1 else 'rows'} in {int(rows.sum())} of {len(x)} rows of this rollout batch; "
                f"no learner trained on them, and {NONFINITE_ADVICE}")


def sequence_baseline(ppo: PPOConfig, score: Tensor) -> Tensor:
    """The per-response signal a critic-free estimator spreads over its tokens: (B,) -> (B,)."""
    from tasks.ppo.advantages import grpo_advantages, rloo_advantages

    if ppo.advantage == "grpo":
        return grpo_advantages(score, ppo.n_samples_per_prompt, ppo.grpo_normalize_std)
    if ppo.advantage == "rloo":
        return rloo_advantages(score, ppo.n_samples_per_prompt)
    return score  # reinforce_pp: the batch whitening after the returns is its baseline


def make_experience(ppo: PPOConfig, kl_coef: float, n: int, *parts) -> tuple:
    """Rewards, advantages and returns for ``n`` chunks; runs as a Ray task (not on the driver).

    ``parts`` (Ray resolves them: top-level arguments): n rollouts, n (logp, entropy), n reference
    log-probs, n critic values (only with 'gae'), then n (B_j,) scores per ``ppo.rewards`` term.
    Returns n Experience (the learners' minibatches: with ``ppo.bucket_by_length`` rows of similar
    length together, not in rollout order) + a stats dict.
    """
    from tasks.ppo.advantages import returns_to_go
    from tasks.ppo.losses import apply_missing_eos_penalty, gae, kl_k1, kl_k3, masked_mean, masked_whiten, token_rewards
    from tasks.ppo.padding import left_pad_cat, length_order

    chunks = [parts[i * n:(i + 1) * n] for i in range(len(parts) // n)]
    rollouts, policy, ref = chunks[0], chunks[1], chunks[2]
    values = chunks[3] if ppo.uses_critic else None
    terms = chunks[4:] if ppo.uses_critic else chunks[3:]
    assert len(terms) == len(ppo.rewards), (len(terms), len(ppo.rewards))
    sizes = [ro.action_mask.shape[0] for ro in rollouts]
    mask = torch.cat([ro.action_mask for ro in rollouts])
    logp, ent = torch.cat([p[0] for p in policy]), torch.cat([p[1] for p in policy])
    ref_logp = torch.cat(list(ref))
    term_scores = [torch.cat([s.float() for s in t]) for t in terms]
    score = sum(src.weight * s for src, s in zip(ppo.rewards, term_scores))
    if ppo.missing_eos_penalty is not None:
        score = apply_missing_eos_penalty(score, torch.cat([ro.ended_with_eos for ro in rollouts]), ppo.missing_eos_penalty)
    v = torch.cat(list(values)) if ppo.uses_critic else torch.zeros_like(logp)
    check_finite({"the actor's log-probs": logp, "the reference log-probs": ref_logp, "the reward scores": score,
                  **({"the critic's values": v} if ppo.uses_critic else {})}, mask)
    kl = (kl_k1 if ppo.kl_estimator == "k1" else kl_k3)(logp, ref_logp)
    reward_kl_coef = kl_coef if ppo.kl_penalty == "reward" else 0.0
    if ppo.uses_critic:
        adv, ret = gae(token_rewards(score, kl, mask, reward_kl_coef), v, mask, ppo.gamma, ppo.lam)
    else:
        ret = returns_to_go(token_rewards(sequence_baseline(ppo, score), kl, mask, reward_kl_coef), mask, ppo.gamma)
        adv = ret
    if ppo.whiten:
        adv = masked_whiten(adv, mask)
    # the learners' minibatches: the chunks' rows as one batch (chunks of different widths left-padded
    # to the widest), ordered by length with ppo.bucket_by_length, cut into chunks of the same sizes
    batch = left_pad_cat(rollouts)
    order = (length_order(batch.attention_mask, mask.shape[1], sizes[0], ppo.n_samples_per_prompt) if ppo.bucket_by_length
             else torch.arange(len(mask)))
    take = lambda x: x[order].split(sizes)  # noqa: E731
    exps = tuple(Experience(*fields) for fields in zip(*(take(x) for x in (batch.sequences, batch.attention_mask, mask, logp, v,
                                                                          adv, ret, ref_logp))))
    stats = {
        "reward_mean": float(score.mean()), "reward_std": float(score.std()) if len(score) > 1 else 0.0,
        "kl": float((masked_mean(kl, mask, dim=1) * mask.sum(1)).mean()), "entropy": float(masked_mean(ent, mask)),
        "response_length": float(mask.sum(1).mean()),
        "tokens": float(batch.attention_mask.sum()),  # real tokens, prompts and responses: what the learners' forwards compute
        "eos_fraction": float(torch.cat([ro.ended_with_eos for ro in rollouts]).float().mean()),
        "return_mean": float(masked_mean(ret, mask)),
    }
    if ppo.uses_critic:
        stats["value_mean"] = float(masked_mean(v, mask))
    if len(ppo.rewards) > 1:
        for i, (src, s) in enumerate(zip(ppo.rewards, term_scores)):
            stats[f"reward_{i}_{src.kind}_mean"] = float(s.mean())
    return (*exps, stats)
