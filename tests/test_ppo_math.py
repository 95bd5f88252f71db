"""tasks/ppo/losses.py, tested three ways: hand-computed cases, invariants, two implementations."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.ppo.losses import (
    AdaptiveKLController,
    FixedKLController,
    apply_missing_eos_penalty,
    entropy_from_logits,
    gae,
    gae_reference,
    kl_k1,
    kl_k3,
    last_action_index,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_clip_loss,
    token_rewards,
    value_loss,
)

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def ragged_mask(B, T, g, min_len=1):
    """Action masks as generation makes them: a prefix of 1s of random length per row."""
    lens = torch.randint(min_len, T + 1, (B,), generator=g)
    return (torch.arange(T)[None, :] < lens[:, None]).to(D)


# ============================================================================ hand-computed

def test_masked_mean_var_hand():
    x = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    m = t([[1, 1, 1], [1, 0, 0]])
    assert masked_mean(x, m).item() == pytest.approx(2.5)  # (1+2+3+4)/4
    assert masked_mean(x, m, dim=1).tolist() == pytest.approx([2.0, 4.0])
    assert masked_mean(x, m, dim=0).tolist() == pytest.approx([2.5, 2.0, 3.0])
    # deviations from 2.5: -1.5 -0.5 0.5 1.5 -> squares sum 5.0
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(5.0 / 4)
    assert masked_var(x, m).item() == pytest.approx(5.0 / 3)
    assert masked_mean(x, torch.zeros_like(m), dim=1).tolist() == [0.0, 0.0]


def test_masked_var_too_few_tokens_raises():
    with pytest.raises(ValueError, match="unbiased"):
        masked_var(t([[1.0, 2.0]]), t([[1, 0]]))
    assert masked_var(t([[1.0, 2.0]]), t([[1, 0]]), unbiased=False).item() == 0.0


def test_masked_whiten_hand():
    x = t([[1.0, 3.0, 9.0]])
    m = t([[1, 1, 0]])
    # mean 2, unbiased var ((1)^2 + (1)^2) / 1 = 2
    w = masked_whiten(x, m)
    s = math.sqrt(2.0 + 1e-8)
    assert w.tolist()[0] == pytest.approx([-1 / s, 1 / s, 0.0])
    w2 = masked_whiten(x, m, shift_mean=False)
    assert w2.tolist()[0] == pytest.approx([-1 / s + 2, 1 / s + 2, 0.0])


def test_kl_estimators_hand():
    logp, ref = t([[math.log(0.5), math.log(0.2)]]), t([[math.log(0.25), math.log(0.4)]])
    assert kl_k1(logp, ref).tolist()[0] == pytest.approx([math.log(2), math.log(0.5)])
    # k3 = q/p - log(q/p) - 1 with q/p = 0.5 and 2
    assert kl_k3(logp, ref).tolist()[0] == pytest.approx([0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1])
    assert kl_k3(ref, ref).abs().max().item() == 0.0


def test_token_rewards_hand():
    score = t([1.0, -2.0, 5.0])
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5], [1.0, 2.0, 3.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    r = token_rewards(score, kl, mask, kl_coef=0.5)
    expected = [[-0.05, -0.1 + 1.0, 0.0], [-0.25, -0.25, -0.25 - 2.0], [0.0, 0.0, 0.0]]
    for row, e in zip(r.tolist(), expected):
        assert row == pytest.approx(e)
    assert last_action_index(mask).tolist() == [1, 2, -1]


def test_missing_eos_penalty_hand():
    out = apply_missing_eos_penalty(t([1.0, 1.0, -0.5]), torch.tensor([True, False, False]), 2.0)
    assert out.tolist() == pytest.approx([1.0, -1.0, -2.5])


def test_gae_hand():
    # one row, 3 tokens then padding; gamma=0.9, lam=0.8
    r, v, m = t([[0.0, 0.0, 1.0, 7.0]]), t([[0.5, 0.4, 0.3, 9.0]]), t([[1, 1, 1, 0]])
    g, l = 0.9, 0.8
    d2 = 1.0 + 0 - 0.3                 # 0.7 (value after the last token is 0)
    d1 = 0.0 + g * 0.3 - 0.4           # -0.13
    d0 = 0.0 + g * 0.4 - 0.5           # -0.14
    a2 = d2
    a1 = d1 + g * l * a2
    a0 = d0 + g * l * a1
    out = gae(r, v, m, g, l)
    assert out.advantages.tolist()[0] == pytest.approx([a0, a1, a2, 0.0])
    assert out.returns.tolist()[0] == pytest.approx([a0 + 0.5, a1 + 0.4, a2 + 0.3, 0.0])


def test_ppo_clip_loss_hand():
    # ratios 1.5 (A=+1: clipped at 1.2), 0.5 (A=+1: unclipped, min wins), 0.5 (A=-1: clipped at 0.8)
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = torch.log(t([[1.5, 0.5, 0.5, 3.0]]))
    adv = t([[1.0, 1.0, -1.0, 9.0]])
    m = t([[1, 1, 1, 0]])
    out = ppo_clip_loss(logp, old, adv, m, eps_clip=0.2)
    # per token max(-A r, -A clip(r)): max(-1.5,-1.2)=-1.2 ; max(-0.5,-0.8)=-0.5 ; max(0.5,0.8)=0.8
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3)
    assert out.clip_fraction.item() == pytest.approx(2 / 3)
    kl = [(r - 1) - math.log(r) for r in (1.5, 0.5, 0.5)]
    assert out.approx_kl.item() == pytest.approx(sum(kl) / 3)
    assert out.ratio_mean.item() == pytest.approx((1.5 + 0.5 + 0.5) / 3)


def test_value_loss_hand():
    v, old, R = t([[1.0, 0.0, 2.0]]), t([[0.0, 0.0, 0.0]]), t([[0.0, 1.0, 2.0]])
    m = t([[1, 1, 0]])
    # token0: v-old=1 clipped to 0.4: max((1-0)^2, (0.4-0)^2)=1 ; token1: v=old=0: (0-1)^2 = 1
    out = value_loss(v, old, R, m, value_clip=0.4)
    assert out.loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert out.clip_fraction.item() == 0.0
    # clipping binds when the clipped value is further from R: v=1, old=0, R=1 -> clip 0.4: (0.6)^2 > 0
    out2 = value_loss(t([[1.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), value_clip=0.4)
    assert out2.loss.item() == pytest.approx(0.5 * 0.36)
    assert out2.clip_fraction.item() == 1.0
    out3 = value_loss(t([[1.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), value_clip=None)
    assert out3.loss.item() == 0.0 and out3.clip_fraction.item() == 0.0


def test_logprobs_and_entropy_hand():
    logits = torch.log(t([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))  # (1, 2, 3), already normalised
    lp = logprobs_from_logits(logits, torch.tensor([[1, 2]]))
    assert lp.tolist()[0] == pytest.approx([math.log(0.25), math.log(0.8)])
    h = entropy_from_logits(logits + 3.0)  # shift invariance
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    h1 = -(2 * 0.1 * math.log(0.1) + 0.8 * math.log(0.8))
    assert h.tolist()[0] == pytest.approx([h0, h1])


def test_logprobs_bf16_matches_fp32():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 50, generator=g)
    labels = torch.randint(0, 50, (2, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    assert torch.allclose(logprobs_from_logits(logits, labels), ref, atol=1e-5)
    assert torch.allclose(logprobs_from_logits(logits.bfloat16(), labels).float(), ref, atol=5e-2)


def test_kl_controllers_hand():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(current_kl=9.0, n_steps=100)   # err = clip(0.5) = 0.2 -> *1.002
    assert c.value == pytest.approx(0.1 * 1.002)
    c.update(current_kl=4.5, n_steps=1000)  # err = -0.25 -> -0.2 -> *0.98
    assert c.value == pytest.approx(0.1 * 1.002 * 0.98)
    c.update(current_kl=6.6, n_steps=5000)  # err = 0.1 -> *1.05
    assert c.value == pytest.approx(0.1 * 1.002 * 0.98 * 1.05)
    c2 = AdaptiveKLController(1.0, target=1.0, horizon=1)
    c2.load_state_dict(c.state_dict())
    assert (c2.value, c2.target, c2.horizon) == (c.value, 6.0, 10000)
    f = FixedKLController(0.05)
    f.update(100.0, 10)
    assert f.value == 0.05
    f2 = FixedKLController(1.0)
    f2.load_state_dict(f.state_dict())
    assert f2.value == 0.05
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


# ============================================================================ invariants

def test_masked_positions_contribute_nothing():
    g = torch.Generator().manual_seed(1)
    B, T = 5, 7
    m = ragged_mask(B, T, g)
    x = torch.randn(B, T, generator=g, dtype=D)
    junk = torch.where(m.bool(), x, torch.full_like(x, float("nan")))
    junk2 = torch.where(m.bool(), x, torch.randn(B, T, generator=g, dtype=D) * 1e6)
    for y in (junk, junk2):
        assert torch.equal(masked_mean(x, m), masked_mean(y, m))
        assert torch.equal(masked_mean(x, m, dim=1), masked_mean(y, m, dim=1))
        assert torch.equal(masked_var(x, m), masked_var(y, m))
        assert torch.equal(masked_whiten(x, m), masked_whiten(y, m))

    v, r = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    noise = lambda z: torch.where(m.bool(), z, torch.randn(B, T, generator=g, dtype=D) * 100)
    a, b = gae(r, v, m, 0.99, 0.95), gae(noise(r), noise(v), m, 0.99, 0.95)
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)
    assert torch.all(a.advantages[m == 0] == 0) and torch.all(a.returns[m == 0] == 0)

    score, kl = torch.randn(B, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    assert torch.equal(token_rewards(score, kl, m, 0.1), token_rewards(score, noise(kl), m, 0.1))

    old = torch.randn(B, T, generator=g, dtype=D) * 0.1
    lp = old + torch.randn(B, T, generator=g, dtype=D) * 0.3
    p1, p2 = ppo_clip_loss(lp, old, x, m), ppo_clip_loss(noise(lp), noise(old), noise(x), m)
    assert all(torch.equal(u, w) for u, w in zip(p1, p2))
    v1, v2 = value_loss(v, old, r, m), value_loss(noise(v), noise(old), noise(r), m)
    assert all(torch.equal(u, w) for u, w in zip(v1, v2))


def test_masked_loss_gradient_is_zero_under_mask():
    g = torch.Generator().manual_seed(2)
    m = ragged_mask(4, 6, g)
    lp = torch.randn(4, 6, generator=g, dtype=D, requires_grad=True)
    v = torch.randn(4, 6, generator=g, dtype=D, requires_grad=True)
    ppo_clip_loss(lp, lp.detach() + 0.1, torch.randn(4, 6, generator=g, dtype=D), m).loss.backward()
    value_loss(v, v.detach() * 0.5, torch.randn(4, 6, generator=g, dtype=D), m).loss.backward()
    assert torch.all(lp.grad[m == 0] == 0) and torch.all(v.grad[m == 0] == 0)
    assert lp.grad[m == 1].abs().sum() > 0


def test_per_rank_means_weighted_by_counts_equal_global_mean():
    g = torch.Generator().manual_seed(3)
    m = ragged_mask(12, 9, g)
    x = torch.randn(12, 9, generator=g, dtype=D)
    shards = [slice(0, 3), slice(3, 8), slice(8, 12)]  # uneven ranks
    counts = [m[s].sum() for s in shards]
    weighted = sum(masked_mean(x[s], m[s]) * c for s, c in zip(shards, counts)) / sum(counts)
    assert torch.allclose(weighted, masked_mean(x, m))


def test_whitened_has_mean_zero_std_one():
    g = torch.Generator().manual_seed(4)
    m = ragged_mask(6, 10, g)
    x = torch.randn(6, 10, generator=g, dtype=D) * 3 + 5
    w = masked_whiten(x, m)
    assert abs(masked_mean(w, m).item()) < 1e-10
    assert masked_var(w, m).item() == pytest.approx(1.0, abs=1e-6)
    ws = masked_whiten(x, m, shift_mean=False)
    assert masked_mean(ws, m).item() == pytest.approx(masked_mean(x, m).item())


def test_kl_estimators_on_known_categoricals():
    p = t([0.5, 0.3, 0.15, 0.05])
    q = t([0.25, 0.25, 0.25, 0.25])
    true_kl = float((p * (p / q).log()).sum())  # KL(p || q), samples drawn from p
    g = torch.Generator().manual_seed(5)
    idx = torch.multinomial(p, 200_000, replacement=True, generator=g)
    logp, logq = p.log()[idx][None], q.log()[idx][None]
    k1, k3 = kl_k1(logp, logq), kl_k3(logp, logq)
    assert torch.all(k3 >= 0)
    assert k1.mean().item() == pytest.approx(true_kl, abs=0.01)
    assert k3.mean().item() == pytest.approx(true_kl, abs=0.01)
    rnd = torch.randn(3, 50, generator=g, dtype=D) * 5
    assert torch.all(kl_k3(rnd, rnd.flip(-1)) >= 0)


def test_ratio_one_gives_minus_mean_advantage():
    g = torch.Generator().manual_seed(6)
    m = ragged_mask(4, 5, g)
    A = torch.randn(4, 5, generator=g, dtype=D)
    lp = torch.randn(4, 5, generator=g, dtype=D)
    out = ppo_clip_loss(lp, lp.clone(), A, m)
    assert out.loss.item() == pytest.approx(-masked_mean(A, m).item())
    assert out.clip_fraction.item() == 0.0
    assert out.approx_kl.item() == 0.0 and out.ratio_mean.item() == 1.0


def test_entropy_matches_definition_and_bounds():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 4, 11, generator=g, dtype=D) * 2
    p = torch.softmax(logits, -1)
    assert torch.allclose(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    assert entropy_from_logits(torch.zeros(1, 1, 11, dtype=D)).item() == pytest.approx(math.log(11))


# ============================================================================ two implementations

@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_vectorised_matches_reference(gamma, lam):
    g = torch.Generator().manual_seed(8)
    B, T = 16, 13
    m = ragged_mask(B, T, g)
    m[3] = 0                        # an empty row
    m[5] = torch.tensor([1, 1, 1, 0, 1, 1, 0, 1] + [0] * (T - 8), dtype=D)  # holes are skipped, not breaks
    r, v = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    fast, slow = gae(r, v, m, gamma, lam), gae_reference(r, v, m, gamma, lam)
    assert torch.allclose(fast.advantages, slow.advantages, atol=1e-12)
    assert torch.allclose(fast.returns, slow.returns, atol=1e-12)
    assert torch.allclose(fast.returns, (fast.advantages + v) * m)


def test_gae_gamma_one_lambda_one_is_returns_to_go_minus_values():
    g = torch.Generator().manual_seed(9)
    B, T = 8, 10
    m = ragged_mask(B, T, g)
    r, v = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    out = gae(r, v, m, 1.0, 1.0)
    for b in range(B):
        n = int(m[b].sum())
        for s in range(n):
            rtg = sum(float(r[b, u]) for u in range(s, n))
            assert out.advantages[b, s].item() == pytest.approx(rtg - float(v[b, s]))
            assert out.returns[b, s].item() == pytest.approx(rtg)


def test_gae_float32_bool_mask():
    g = torch.Generator().manual_seed(10)
    m = ragged_mask(4, 6, g).bool()
    r, v = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    fast, slow = gae(r, v, m, 0.99, 0.95), gae_reference(r, v, m, 0.99, 0.95)
    assert fast.advantages.dtype == torch.float32
    assert torch.allclose(fast.advantages, slow.advantages, atol=1e-5)


def test_token_rewards_match_loop():
    g = torch.Generator().manual_seed(11)
    B, T = 7, 9
    m = ragged_mask(B, T, g)
    score, kl = torch.randn(B, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    r = token_rewards(score, kl, m, 0.2)
    for b in range(B):
        last = max(u for u in range(T) if m[b, u])
        for u in range(T):
            e = (-0.2 * float(kl[b, u]) + (float(score[b]) if u == last else 0.0)) if m[b, u] else 0.0
            assert r[b, u].item() == pytest.approx(e)
    assert masked_sum_of(r, m) == pytest.approx(float(score.sum() - 0.2 * (kl * m).sum()))


def masked_sum_of(x, m):
    return float((x * m).sum())
