"""Critic-free advantage estimators and loss aggregations: GRPO, RLOO, REINFORCE++, Dr. GRPO.

Pure torch, like ``tasks.ppo.losses`` (whose ``gae`` is the critic's estimator). Shapes: ``B``
rows, ``T`` action tokens; scores are ``(B,)``. Group estimators take the rows of one prompt as
``n`` consecutive rows (``ppo.n_samples_per_prompt``): rows ``[g*n, (g+1)*n)`` are group ``g``,
which is how the driver lays out a rollout (each prompt repeated ``n`` times in place).

How an estimator becomes per-token advantages (``tasks.ppo.roles.make_experience``):

    gae           token rewards (score + KL penalty) -> GAE with the critic's values
    grpo / rloo   score -> group baseline (below) -> token rewards (+ KL penalty) -> returns-to-go
    reinforce_pp  score -> token rewards (+ KL penalty) -> returns-to-go -> whitened over the batch

References: GRPO (Shao et al. 2024, arXiv:2402.03300), Dr. GRPO (Liu et al. 2025,
arXiv:2503.20783: no std division, loss summed over tokens / a constant), RLOO (Ahmadian et al.
2024, arXiv:2402.14740), REINFORCE++ (Hu 2025, arXiv:2501.03262).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tasks.ppo.losses import _bool, masked_mean, masked_sum


def _groups(scores: Tensor, n: int) -> Tensor:
    """(B,) -> (B / n, n); a ValueError when ``n`` does not divide B."""
    if scores.dim() != 1 or n < 1 or scores.shape[0] % n:
        raise ValueError(f"group estimators need (B,) scores with B a multiple of the group size: got shape "
                         f"{tuple(scores.shape)} and n_samples_per_prompt {n}")
    return scores.reshape(-1, n)


def grpo_advantages(scores: Tensor, n: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO's group-normalised score per row: ``(s_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased std over the ``n`` rows of the group (as in the GRPO paper and TRL);
    ``normalize_std=False`` is Dr. GRPO's ``s_i - mean_g``. A group whose rows all score the
    same gets 0 (no signal, no division by ~0). scores: (B,) -> (B,). Needs n >= 2.
    """
    if n < 2:
        raise ValueError(f"grpo_advantages: a group of {n} has no baseline; n_samples_per_prompt must be >= 2")
    g = _groups(scores, n)
    centred = g - g.mean(1, keepdim=True)
    if normalize_std:
        std = g.std(1, keepdim=True)
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.reshape(-1)


def rloo_advantages(scores: Tensor, n: int) -> Tensor:
    """RLOO: each row's score minus the mean of the *other* ``n - 1`` rows of its group.

        A_i = s_i - (sum_g - s_i) / (n - 1)  =  n / (n - 1) * (s_i - mean_g)

    scores: (B,) -> (B,). Unbiased (the baseline does not depend on the row's own sample). n >= 2.
    """
    if n < 2:
        raise ValueError(f"rloo_advantages: leave-one-out needs n_samples_per_prompt >= 2, got {n}")
    g = _groups(scores, n)
    return (g - (g.sum(1, keepdim=True) - g) / (n - 1)).reshape(-1)


def returns_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted return from each action token to the end of its row:

        G_t = r_t + gamma * G_{t'}     (t' = the next unmasked position; G = 0 past the end)

    rewards, mask: (B, T) -> (B, T), 0 where the mask is 0 (values there never reach the output).
    This is ``gae`` with zero values and lambda 1: REINFORCE's Monte-Carlo return.
    """
    m = _bool(mask)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    r = torch.where(m, rewards, zero)
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        g = r[:, t] + gamma * running
        out[:, t] = torch.where(m[:, t], g, zero)
        running = torch.where(m[:, t], g, running)
    return out


def returns_to_go_reference(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``returns_to_go`` as a plain loop per row over its unmasked indices; for tests."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if bool(mask[b, t])]):
            running = float(rewards[b, t]) + gamma * running
            out[b, t] = running
    return out.to(rewards.dtype)


def grpo_advantages_reference(scores: Tensor, n: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """``grpo_advantages`` as Python loops over each group; for tests."""
    out = []
    for g in range(scores.shape[0] // n):
        xs = [float(v) for v in scores[g * n:(g + 1) * n]]
        mean = sum(xs) / n
        std = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5
        out += [(x - mean) / (std + eps) if normalize_std else x - mean for x in xs]
    return torch.tensor(out, dtype=scores.dtype)


def rloo_advantages_reference(scores: Tensor, n: int) -> Tensor:
    """``rloo_advantages`` by its definition (mean of the others), as loops; for tests."""
    out = []
    for g in range(scores.shape[0] // n):
        xs = [float(v) for v in scores[g * n:(g + 1) * n]]
        out += [x - sum(xs[:i] + xs[i + 1:]) / (n - 1) for i, x in enumerate(xs)]
    return torch.tensor(out, dtype=scores.dtype)


# ----------------------------------------------------------------------------- loss aggregation
# How a per-token loss (B, T) becomes the scalar that is minimised. Each is (x, mask) -> scalar, so
# ``ppo_clip_loss(..., aggregate=...)`` takes any of them; ``ppo.loss_aggregation`` picks one.

def token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over every action token of the minibatch (DAPO, PPO here): long responses weigh more."""
    return masked_mean(x, mask)


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over rows of each row's token mean (the GRPO paper): every response weighs the same,
    so a token of a short response weighs more. Rows with no action token count as 0."""
    m = _bool(mask)
    rows = m.any(1)
    per_row = masked_mean(x, m, dim=1)
    return masked_sum(per_row, rows) / rows.sum().clamp_min(1).to(x.dtype)


def constant_normalizer(num_tokens: int):
    """Dr. GRPO: sum over the minibatch's action tokens / (rows x ``num_tokens``), a constant
    (``ppo.max_new_tokens``), so neither length nor the batch's own token count biases the step."""
    def sum_over_constant(x: Tensor, mask: Tensor) -> Tensor:
        return masked_sum(x, mask) / (x.shape[0] * num_tokens)
    return sum_over_constant
