"""PPO math: masked statistics, KL estimators, per-token rewards, GAE, the clipped losses and the
KL-coefficient controllers. Pure torch, no distributed code: callers reduce the returned stats.

Shapes: ``B`` rows (sequences), ``T`` action (response) tokens. Every ``mask`` is ``(B, T)``,
float or bool, 1 on real action tokens (generated tokens up to and including the first stop token).
Values under mask 0 never reach an output: they are selected away with ``torch.where`` rather
than multiplied by 0, so a NaN or inf in padding cannot leak in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def _bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


# ----------------------------------------------------------------------------- masked statistics

def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x * mask)`` over ``dim`` (all when None); masked entries are dropped, not multiplied."""
    xm = torch.where(_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim`` (all elements when None).

    x, mask: same shape, e.g. (B, T). Returns a scalar, or the shape with ``dim`` removed.
    A slice with no unmasked entry gives 0 (not NaN), so an all-padding row is harmless.
    """
    m = _bool(mask)
    n = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / n.clamp_min(1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the unmasked entries: ``mean((x - mean)^2)``, times ``n / (n - 1)`` if unbiased.

    x, mask: (B, T) (any shape). Returns a scalar. Raises ValueError when there are too few
    unmasked entries (0, or 1 with ``unbiased``) because the variance is then undefined.
    """
    m = _bool(mask)
    n = int(m.sum())
    if n == 0 or (unbiased and n == 1):
        raise ValueError(
            f"masked_var: the mask selects {n} element(s); an {'unbiased ' if unbiased else ''}variance "
            f"needs at least {2 if unbiased else 1}: use a larger batch, or unbiased=False for one token"
        )
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the unmasked entries; 0 where mask is 0.

    With ``shift_mean=False`` the mean is added back (scale only), as for rewards.
    x, mask: (B, T). Returns (B, T). Statistics are those of this tensor only; to whiten over a
    sharded batch, all-reduce ``masked_sum`` and counts first.
    """
    m = _bool(mask)
    mean, var = masked_mean(x, m), masked_var(x, m)
    w = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        w = w + mean
    return torch.where(m, w, torch.zeros((), dtype=w.dtype, device=w.device))


# ----------------------------------------------------------------------------- KL estimators
# Estimators of KL(pi || ref) from samples of pi: http://joschu.net/blog/kl-approx.html

def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = ``logp - ref_logp``: unbiased, high variance, can be negative per token. (B, T) -> (B, T)."""
    return logp - ref_logp


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = ``exp(d) - d - 1`` with ``d = ref_logp - logp``: unbiased, always >= 0. (B, T) -> (B, T)."""
    d = ref_logp - logp
    return torch.expm1(d) - d


# ----------------------------------------------------------------------------- rewards

def apply_missing_eos_penalty(score: Tensor, ended_with_eos: Tensor, penalty: float) -> Tensor:
    """``score - penalty`` on rows that ended without a stop token (truncated), unchanged elsewhere.

    score: (B,) float; ended_with_eos: (B,) bool. Returns (B,). ``penalty`` >= 0 lowers the score.
    """
    return score - penalty * (~ended_with_eos.bool()).to(score.dtype)


def last_action_index(action_mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of ``action_mask`` (B, T) -> (B,) long; -1 for an empty row."""
    m = _bool(action_mask)
    T = m.shape[-1]
    idx = torch.arange(T, device=m.device).expand_as(m)
    return torch.where(m, idx, torch.full_like(idx, -1)).amax(-1)


def token_rewards(score: Tensor, kl: Tensor, action_mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token reward ``r_t = -kl_coef * kl_t + [t == last action token] * score``.

    score: (B,) sequence score (reward model, after any missing-EOS penalty); kl: (B, T) per-token
    KL estimate (e.g. ``kl_k1``); action_mask: (B, T). Returns (B, T), 0 where the mask is 0.
    The score lands on the last action token: the first stop token, or the last generated token
    when the response was truncated — found from the mask, never by comparing ids to a pad id. A row with no action token gets no score.
    """
    m = _bool(action_mask)
    r = torch.where(m, -kl_coef * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    last = last_action_index(m)
    has = last >= 0
    bonus = torch.zeros_like(r).scatter_(1, last.clamp_min(0)[:, None], torch.where(has, score.to(r.dtype), 0.0)[:, None])
    return r + bonus


# ----------------------------------------------------------------------------- advantages

class Advantages(NamedTuple):
    advantages: Tensor  # (B, T), 0 where mask is 0
    returns: Tensor     # (B, T) = advantages + values, 0 where mask is 0


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Advantages:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's action tokens.

        delta_t = r_t + gamma * V_{t'} - V_t          (t' = next unmasked position; V = 0 past the end)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t

    rewards, values, mask: (B, T). Vectorised over B, a reverse loop over T. Positions with mask 0
    are skipped (they neither receive nor pass on value), so a row's result equals GAE over the
    sequence of its unmasked tokens; the value after the last action token is 0 (episode ends).
    """
    m = _bool(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(m, rewards.to(values.dtype), zero)
    v = torch.where(m, values, zero)
    B, T = v.shape
    next_value = v.new_zeros(B)
    next_adv = v.new_zeros(B)
    adv = torch.zeros_like(v)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, zero)
        next_value = torch.where(mt, v[:, t], next_value)
        next_adv = torch.where(mt, a, next_adv)
    return Advantages(adv, torch.where(m, adv + v, zero))


def gae_reference(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Advantages:
    """``gae`` as a plain Python loop per row over its unmasked indices; for tests."""
    adv = torch.zeros(values.shape, dtype=torch.float64)
    ret = torch.zeros(values.shape, dtype=torch.float64)
    for b in range(values.shape[0]):
        idx = [t for t in range(values.shape[1]) if bool(mask[b, t])]
        last_adv, next_v = 0.0, 0.0
        for t in reversed(idx):
            rt, vt = float(rewards[b, t]), float(values[b, t])
            last_adv = rt + gamma * next_v - vt + gamma * lam * last_adv
            next_v = vt
            adv[b, t] = last_adv
            ret[b, t] = last_adv + vt
    return Advantages(adv.to(values.dtype), ret.to(values.dtype))


# ----------------------------------------------------------------------------- losses

class PolicyLoss(NamedTuple):
    loss: Tensor           # scalar, differentiable
    clip_fraction: Tensor  # scalar, detached: share of tokens where the clipped term is the max
    approx_kl: Tensor      # scalar, detached: k3 estimate of KL(old || new) on these tokens
    ratio_mean: Tensor     # scalar, detached


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_clip: float = 0.2,
                  aggregate=masked_mean) -> PolicyLoss:
    """PPO clipped surrogate (Schulman et al. 2017), aggregated over the mask (token mean by default).

        r_t  = exp(logp_t - old_logp_t)
        loss = aggregate( max(-A_t * r_t, -A_t * clip(r_t, 1 - eps, 1 + eps)) )

    logp (with grad), old_logp, advantages, mask: (B, T). ``aggregate(x, mask) -> scalar``: one of
    ``tasks.ppo.advantages``' token_mean / sequence_mean / constant_normalizer(T) (the statistics
    stay token means). ``approx_kl = masked_mean((r - 1) - log r)``.
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    loss = aggregate(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).to(logp.dtype), mask)
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, mask)
        ratio_mean = masked_mean(ratio, mask)
    return PolicyLoss(loss, clip_fraction, approx_kl, ratio_mean)


def kl_loss(logp: Tensor, ref_logp: Tensor, mask: Tensor, aggregate=masked_mean) -> Tensor:
    """KL to the reference as a loss term (GRPO, ``ppo.kl_penalty`` 'loss'): ``aggregate(k3)``.

        k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (>= 0; the estimator GRPO's loss uses)

    logp (with grad), ref_logp, mask: (B, T) -> scalar (differentiable).
    """
    return aggregate(kl_k3(logp, ref_logp), mask)


class ValueLoss(NamedTuple):
    loss: Tensor           # scalar, differentiable
    clip_fraction: Tensor  # scalar, detached: share of tokens where the clipped error is larger


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, value_clip: float | None = 0.4) -> ValueLoss:
    """Clipped value loss (as in the PPO2 baselines):

        v_clip = old + clamp(v - old, -c, c)
        loss   = 0.5 * masked_mean( max((v - R)^2, (v_clip - R)^2) )

    values (with grad), old_values, returns, mask: (B, T). ``value_clip=None``: plain
    ``0.5 * masked_mean((v - R)^2)`` and clip fraction 0.
    """
    err = (values - returns) ** 2
    if value_clip is None:
        return ValueLoss(0.5 * masked_mean(err, mask), values.new_zeros(()))
    v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    err_clipped = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((err_clipped > err).to(values.dtype), mask)
    return ValueLoss(loss, clip_fraction)


# ----------------------------------------------------------------------------- from logits
# Both loop over rows so that only one row's (T, V) softmax is alive at a time: with V ~ 50k a
# full (B, T, V) log_softmax is the largest tensor of the PPO step.

def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log_softmax(logits)[..., labels]``: (B, T, V), (B, T) long -> (B, T)."""
    if logits.dtype in (torch.float32, torch.float64):
        # logsumexp is exact enough in fp32/fp64 and never materialises the (B, T, V) result
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    # bf16/fp16: logsumexp loses precision; per-row log_softmax is stable
    return torch.stack([
        torch.gather(torch.log_softmax(row, -1), -1, lab.unsqueeze(-1)).squeeze(-1)
        for row, lab in zip(logits, labels)
    ])


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits): ``H = logsumexp(l) - sum(softmax(l) * l)``. (B, T, V) -> (B, T)."""
    out = []
    for row in logits:
        p = torch.softmax(row, -1)
        out.append(torch.logsumexp(row, -1) - (p * row).sum(-1))
    return torch.stack(out)


# ----------------------------------------------------------------------------- KL controllers

class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593, section 2.2):

        e     = clip(current_kl / target - 1, -0.2, 0.2)
        value = value * (1 + e * n_steps / horizon)

    ``n_steps``: samples (or steps) since the last update; ``horizon``: how many of them it takes
    to move the coefficient by about e.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController: target ({target}) and horizon ({horizon}) must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))
