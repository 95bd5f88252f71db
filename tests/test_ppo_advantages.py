"""tasks/ppo/advantages.py (critic-free estimators, loss aggregations), the KL loss term and
tasks/ppo/experience.py's composition, tested three ways: hand-computed cases, invariants, loops."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.ppo.advantages import (
    constant_normalizer,
    grpo_advantages,
    grpo_advantages_reference,
    returns_to_go,
    returns_to_go_reference,
    rloo_advantages,
    rloo_advantages_reference,
    sequence_mean,
    token_mean,
)
from tasks.ppo.config import PPOConfig
from tasks.ppo.experience import make_experience
from tasks.ppo.generation import Rollout
from tasks.ppo.losses import gae, kl_k3, kl_loss, masked_mean, ppo_clip_loss
from tests.test_ppo_math import D, ragged_mask, t


# ============================================================================ hand-computed

def test_grpo_hand():
    s = t([1.0, 0.0, 0.0, 3.0, 3.0, 3.0])  # two groups of 3
    # group 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    a = grpo_advantages(s, 3, eps=0.0)
    assert a.tolist()[:3] == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std])
    assert a.tolist()[3:] == [0.0, 0.0, 0.0]  # all equal: no signal, and no division by ~0
    dr = grpo_advantages(s, 3, normalize_std=False)  # Dr. GRPO
    assert dr.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])


def test_rloo_hand():
    s = t([1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 6.0, 0.0])  # two groups of 4; A_i = s_i - mean of the other three
    assert rloo_advantages(s, 4).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, -8 / 3, 16 / 3, -8 / 3])


def test_returns_to_go_hand():
    r, m = t([[1.0, 2.0, 4.0, 99.0], [0.0, 0.0, 0.0, 0.0]]), t([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = returns_to_go(r, m, 1.0).tolist()
    assert out[0] == pytest.approx([7.0, 6.0, 4.0, 0.0]) and out[1] == [0.0] * 4
    assert returns_to_go(r, m, 0.5).tolist()[0] == pytest.approx([1 + 0.5 * (2 + 0.5 * 4), 2 + 0.5 * 4, 4.0, 0.0])


def test_aggregations_hand():
    x = t([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    m = t([[1, 1, 0], [1, 0, 0]])
    assert token_mean(x, m).item() == pytest.approx(3.0)          # (1 + 3 + 5) / 3
    assert sequence_mean(x, m).item() == pytest.approx(3.5)       # (2 + 5) / 2
    assert constant_normalizer(4)(x, m).item() == pytest.approx(9 / 8)  # 9 / (2 rows x 4)


def test_kl_loss_hand():
    lp, ref = t([[math.log(0.5), math.log(0.2), 0.0]]), t([[math.log(0.25), math.log(0.4), 5.0]])
    m = t([[1, 1, 0]])
    k3 = [0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1]
    assert kl_loss(lp, ref, m).item() == pytest.approx(sum(k3) / 2)
    assert kl_loss(lp, ref, m, sequence_mean).item() == pytest.approx(sum(k3) / 2)
    assert kl_loss(lp, ref, m, constant_normalizer(4)).item() == pytest.approx(sum(k3) / 4)


def test_ppo_clip_loss_takes_the_aggregation():
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = t([[1.0, 1.0, 0.0], [4.0, 0.0, 0.0]])
    m = t([[1, 1, 0], [1, 0, 0]])
    # ratio 1: per-token loss -A; token mean -(1+1+4)/3 = -2, sequence mean -(1 + 4)/2 = -2.5
    assert ppo_clip_loss(old, old, adv, m).loss.item() == pytest.approx(-2.0)
    assert ppo_clip_loss(old, old, adv, m, aggregate=sequence_mean).loss.item() == pytest.approx(-2.5)
    assert ppo_clip_loss(old, old, adv, m, aggregate=constant_normalizer(3)).loss.item() == pytest.approx(-1.0)


# ============================================================================ invariants

def test_group_advantages_sum_to_zero_per_group_and_ignore_other_groups():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(24, generator=g, dtype=D)
    for fn in (lambda x: grpo_advantages(x, 4), lambda x: grpo_advantages(x, 4, normalize_std=False), lambda x: rloo_advantages(x, 4)):
        a = fn(s)
        assert torch.allclose(a.reshape(6, 4).sum(1), torch.zeros(6, dtype=D), atol=1e-12)
        s2 = s.clone()
        s2[4:] += torch.randn(20, generator=g, dtype=D) * 10  # other groups change: group 0 does not
        assert torch.allclose(fn(s2)[:4], a[:4])
        assert torch.allclose(fn(s + 7.0), a, atol=1e-12)  # a constant shift of every score changes nothing
    # GRPO is scale-free; RLOO and Dr. GRPO scale with the scores
    assert torch.allclose(grpo_advantages(s * 5, 4, eps=0.0), grpo_advantages(s, 4, eps=0.0))
    assert torch.allclose(rloo_advantages(s * 5, 4), 5 * rloo_advantages(s, 4))
    # RLOO = n / (n - 1) x Dr. GRPO
    assert torch.allclose(rloo_advantages(s, 4), 4 / 3 * grpo_advantages(s, 4, normalize_std=False))


def test_group_size_must_divide_and_be_at_least_two():
    with pytest.raises(ValueError, match="multiple of the group size"):
        grpo_advantages(t([1.0, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match=">= 2"):
        rloo_advantages(t([1.0, 2.0]), 1)


def test_returns_to_go_masked_positions_contribute_nothing():
    g = torch.Generator().manual_seed(1)
    m = ragged_mask(6, 8, g)
    r = torch.randn(6, 8, generator=g, dtype=D)
    noisy = torch.where(m.bool(), r, torch.full_like(r, float("nan")))
    assert torch.equal(returns_to_go(r, m), returns_to_go(noisy, m))
    assert torch.all(returns_to_go(r, m)[m == 0] == 0)


def test_aggregations_ignore_masked_entries_and_sequence_mean_weighs_rows_equally():
    g = torch.Generator().manual_seed(2)
    m = ragged_mask(5, 7, g)
    x = torch.randn(5, 7, generator=g, dtype=D)
    junk = torch.where(m.bool(), x, torch.full_like(x, float("inf")))
    for agg in (token_mean, sequence_mean, constant_normalizer(7)):
        assert torch.equal(agg(x, m), agg(junk, m))
    # a row's tokens all equal c: sequence_mean is the mean of the c's whatever the lengths
    c = torch.randn(5, 1, generator=g, dtype=D).expand(5, 7)
    assert sequence_mean(c, m).item() == pytest.approx(c[:, 0].mean().item())
    assert constant_normalizer(7)(x, torch.ones_like(m)).item() == pytest.approx(x.mean().item())


def test_kl_loss_is_zero_at_the_reference_and_its_gradient_too():
    g = torch.Generator().manual_seed(3)
    m = ragged_mask(4, 6, g)
    lp = torch.randn(4, 6, generator=g, dtype=D, requires_grad=True)
    loss = kl_loss(lp, lp.detach(), m)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(lp.grad == 0)
    lp.grad = None
    kl_loss(lp, lp.detach() + 0.3, m).backward()
    assert torch.all(lp.grad[m == 0] == 0) and torch.all(lp.grad[m == 1] < 0)  # raise logp towards ref: k3 falls


# ============================================================================ two implementations

@pytest.mark.parametrize("n", [2, 3, 8])
def test_group_estimators_match_loops(n):
    g = torch.Generator().manual_seed(4 + n)
    s = torch.randn(n * 5, generator=g, dtype=D)
    assert torch.allclose(grpo_advantages(s, n), grpo_advantages_reference(s, n), atol=1e-12)
    assert torch.allclose(grpo_advantages(s, n, False), grpo_advantages_reference(s, n, False), atol=1e-12)
    assert torch.allclose(rloo_advantages(s, n), rloo_advantages_reference(s, n), atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_returns_to_go_matches_loop_and_gae_without_values(gamma):
    g = torch.Generator().manual_seed(5)
    m = ragged_mask(9, 11, g)
    m[2] = 0
    m[4] = t([1, 0, 1, 1, 0, 1] + [0] * 5)  # holes are skipped
    r = torch.randn(9, 11, generator=g, dtype=D)
    fast = returns_to_go(r, m, gamma)
    assert torch.allclose(fast, returns_to_go_reference(r, m, gamma), atol=1e-12)
    assert torch.allclose(fast, gae(r, torch.zeros_like(r), m, gamma, 1.0).advantages, atol=1e-12)


# ============================================================================ experience making

def _chunks(B=8, N=5, seed=6):
    g = torch.Generator().manual_seed(seed)
    mask = ragged_mask(B, N, g).float()
    seq = torch.randint(0, 50, (B, 3 + N), generator=g)
    ro = Rollout(seq, torch.ones_like(seq), mask, torch.ones(B, dtype=torch.bool))
    logp = torch.randn(B, N, generator=g) * 0.1 - 1
    ref = logp + torch.randn(B, N, generator=g) * 0.05
    score = torch.randn(B, generator=g)
    halves = lambda x: list(x.split(B // 2))  # noqa: E731
    ros = [Rollout(*(x[i * B // 2:(i + 1) * B // 2] for x in ro)) for i in range(2)]
    return ros, halves(logp), halves(ref), halves(score), mask, logp, ref, score


def test_make_experience_grpo_hand_composition():
    """grpo with the KL in the loss: every token of a response carries its group-normalised score."""
    ros, lps, refs, scores, mask, logp, ref, score = _chunks()
    cfg = PPOConfig(advantage="grpo", n_samples_per_prompt=4, rollout_batch_size=8, train_batch_size=4, kl_penalty="loss",
                    rewards=[{"kind": "function", "function": "tasks.common.builtin:sentiment_reward"}])
    *exps, stats = make_experience(cfg, 0.5, 2, *ros, *[(p, torch.zeros_like(p)) for p in lps], *refs, *scores)
    adv = torch.cat([e.advantages for e in exps])
    expected = grpo_advantages(score, 4)[:, None] * mask
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.equal(torch.cat([e.ref_logprobs for e in exps]), ref) and torch.all(torch.cat([e.values for e in exps]) == 0)
    assert stats["reward_mean"] == pytest.approx(float(score.mean()))


def test_make_experience_reinforce_pp_and_rloo_with_kl_in_reward():
    ros, lps, refs, scores, mask, logp, ref, score = _chunks()
    pol = [(p, torch.zeros_like(p)) for p in lps]
    kl = (logp - ref) * mask
    last = torch.zeros_like(mask).scatter_(1, (mask.sum(1).long() - 1)[:, None], 1.0)
    fn = [{"kind": "function", "function": "tasks.common.builtin:sentiment_reward", "weight": 2.0}]
    for adv_name, base in (("reinforce_pp", 2 * score), ("rloo", rloo_advantages(2 * score, 2))):
        cfg = PPOConfig(advantage=adv_name, n_samples_per_prompt=2, rollout_batch_size=8, train_batch_size=4, rewards=fn)
        *exps, stats = make_experience(cfg, 0.1, 2, *ros, *pol, *refs, *scores)
        rewards = -0.1 * kl + last * base[:, None]
        # returns to go by a reversed cumulative sum (gamma 1)
        ret = rewards.flip(1).cumsum(1).flip(1) * mask
        assert torch.allclose(torch.cat([e.returns for e in exps]), ret, atol=1e-5), adv_name
        adv = torch.cat([e.advantages for e in exps])
        if adv_name == "reinforce_pp":  # whitened over the batch
            assert masked_mean(adv, mask).abs().item() < 1e-5
            mu, sd = masked_mean(ret, mask), ((ret - masked_mean(ret, mask)) ** 2 * mask).sum() / (mask.sum() - 1)
            assert torch.allclose(adv, (ret - mu) / sd.sqrt() * mask, atol=1e-4)
        else:
            assert torch.allclose(adv, ret, atol=1e-6)


def test_make_experience_sums_weighted_terms():
    ros, lps, refs, scores, mask, logp, ref, score = _chunks()
    pol = [(p, torch.zeros_like(p)) for p in lps]
    other = [s * 0 + 1.0 for s in scores]
    cfg = PPOConfig(advantage="reinforce_pp", rollout_batch_size=8, train_batch_size=4, rewards=[
        {"kind": "function", "function": "tasks.common.builtin:sentiment_reward", "weight": 0.5},
        {"kind": "http", "url": "http://127.0.0.1:1/score", "version": "v1", "weight": -2.0}])
    *_, stats = make_experience(cfg, 0.1, 2, *ros, *pol, *refs, *scores, *other)
    assert stats["reward_mean"] == pytest.approx(float(0.5 * score.mean() - 2.0))
    assert stats["reward_0_function_mean"] == pytest.approx(float(score.mean()))
    assert stats["reward_1_http_mean"] == pytest.approx(1.0)
    assert kl_k3(logp, logp).abs().max() == 0


def test_make_experience_stops_on_a_non_finite_number_at_an_action_position_only():
    """A role's NaN where the action mask is 1 stops the iteration with the role named; garbage
    after a row's stop token (mask 0) is not an error (masked statistics select it away)."""
    ros, lps, refs, scores, mask, logp, ref, score = _chunks()
    cfg = PPOConfig(rollout_batch_size=8, train_batch_size=4)  # gae: a critic, a reward model term
    values = [torch.zeros_like(p) for p in lps]
    pol = [(p, torch.zeros_like(p)) for p in lps]
    masked = (mask[: 4] == 0).nonzero()[0]  # a post-stop position of the first chunk
    junk = values[0].clone()
    junk[tuple(masked)] = float("nan")
    *exps, _ = make_experience(cfg, 0.1, 2, *ros, *pol, *refs, junk, values[1], *scores)
    assert all(torch.isfinite(e.advantages).all() and torch.isfinite(e.returns).all() for e in exps)
    for where, parts, what in [
        ("values", (*pol, *refs, values[0].index_put((torch.tensor([1]), torch.tensor([0])), torch.tensor(float("nan"))), values[1], *scores),
         "the critic's values are not finite (nan) at 1 action positions in 1 of 8 rows"),
        ("score", (*pol, *refs, *values, scores[0], scores[1].index_put((torch.tensor([2]),), torch.tensor(float("inf")))),
         "the reward scores are not finite (inf) at 1 rows in 1 of 8 rows"),
        ("logp", ((lps[0].index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("-inf"))), pol[0][1]), pol[1], *refs, *values, *scores),
         "the actor's log-probs are not finite (-inf)"),
    ]:
        with pytest.raises(FloatingPointError, match=r"no learner trained on them") as e:
            make_experience(cfg, 0.1, 2, *ros, *parts)
        assert what in str(e.value), where


def test_a_learner_refuses_a_non_finite_loss_before_its_optimizer_step():
    from types import SimpleNamespace

    from tasks.ppo.roles import _LearnerMixin

    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    # the optimizer is never reached; the loss is read with the gradient norm, after the backward
    w = SimpleNamespace(role="critic", rank=0, strategy="ddp", optim=None, params=[p])
    with pytest.raises(FloatingPointError, match=r"critic.s loss is nan .*step was not taken.*ppo.critic_lr"):
        _LearnerMixin._step(w, (p * float("nan")).sum())
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0]))
    with torch.autograd.set_detect_anomaly(True), pytest.raises(FloatingPointError, match=r"critic.s loss is nan"):
        _LearnerMixin._step(w, (p * float("nan")).sum())  # anomaly mode: checked before the backward, which would raise first


def test_a_learner_refuses_a_non_finite_gradient_and_leaves_the_weights_as_they_were():
    from types import SimpleNamespace

    from tasks.ppo.roles import _LearnerMixin

    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optim = torch.optim.Adam([w], lr=0.1)
    learner = SimpleNamespace(role="actor", rank=0, strategy="ddp", optim=optim, params=[w], model=torch.nn.ParameterList([w]),
                              ppo=SimpleNamespace(max_grad_norm=1.0))
    w.register_hook(lambda g: g * float("inf"))  # a finite loss whose backward overflows
    loss = w.sum()
    with pytest.raises(FloatingPointError, match=r"actor.s gradient norm is (inf|nan) .*1 of 1 gradient tensors not finite: 0;.*step was not taken") as e:
        _LearnerMixin._step(learner, loss, lambda: {"old log-probs": torch.tensor([0.0, float("-inf")])})
    assert "old log-probs: 1 of 2 not finite" in str(e.value)
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))


def test_ppo_detect_anomaly_names_the_backward_op_that_made_the_nan():
    """What ``ppo.detect_anomaly`` gives a learner (its ``load`` turns autograd's anomaly mode on
    in its process): the first backward op that returns a NaN stops the step, named."""
    from types import SimpleNamespace

    from tasks.ppo.config import PPOConfig
    from tasks.ppo.roles import _LearnerMixin

    assert PPOConfig().detect_anomaly is False and PPOConfig(detect_anomaly=True).detect_anomaly
    w = torch.nn.Parameter(torch.tensor([0.0, 4.0]))
    optim = torch.optim.Adam([w], lr=0.1)
    learner = SimpleNamespace(role="actor", rank=0, strategy="ddp", optim=optim, params=[w], model=torch.nn.ParameterList([w]),
                              ppo=SimpleNamespace(max_grad_norm=1.0))
    loss = torch.where(w > 0, torch.sqrt(w), torch.zeros_like(w)).sum()  # finite; sqrt's backward at 0 is 0 * inf
    with torch.autograd.set_detect_anomaly(True, check_nan=True):
        with pytest.raises(RuntimeError, match="SqrtBackward0.* returned nan"):
            _LearnerMixin._step(learner, loss)
    assert torch.equal(w.detach(), torch.tensor([0.0, 4.0]))


def test_make_experience_minibatches_of_similar_length_carry_each_row_whole():
    """ppo.bucket_by_length: the learners' chunks hold rows of similar length (fewer columns to
    compute), every row once, each with its own log-probs, advantages and returns; off: rollout
    order. Chunks of two widths (two generating workers) come out at the wider one."""
    from tasks.ppo.padding import attended_span, left_pad_cat

    g = torch.Generator().manual_seed(11)
    N, sizes, ros, lps = 40, 4, [], []
    for P in (6, 9):  # two workers' chunks of 2 x 4 rows with their own prompt widths
        for _ in range(2):
            plen, rlen = torch.randint(1, P + 1, (sizes,), generator=g), torch.randint(1, N + 1, (sizes,), generator=g)
            cols = torch.arange(P + N)[None]
            attn = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()
            ros.append(Rollout(torch.randint(3, 50, (sizes, P + N), generator=g) * attn, attn,
                               attn[:, P:].float(), torch.ones(sizes, dtype=torch.bool)))
            lps.append(torch.randn(sizes, N, generator=g))
    scores = [torch.randn(sizes, generator=g) for _ in ros]
    parts = (*ros, *[(p, torch.zeros_like(p)) for p in lps], *lps, *[torch.zeros_like(p) for p in lps], *scores)
    whole = left_pad_cat(ros)
    width = lambda exps: sum(attended_span(e.attention_mask, N).stop - attended_span(e.attention_mask, N).start for e in exps)  # noqa: E731
    runs = {}
    for bucket in (False, True):
        cfg = PPOConfig(rollout_batch_size=16, train_batch_size=4, bucket_by_length=bucket)
        *exps, _ = make_experience(cfg, 0.1, 4, *parts)
        seqs = torch.cat([e.sequences for e in exps])
        assert seqs.shape == whole.sequences.shape
        rows = [next(i for i in range(16) if torch.equal(s, whole.sequences[i])) for s in seqs]  # where each row came from
        assert sorted(rows) == list(range(16))
        assert torch.equal(torch.cat([e.logprobs for e in exps]), torch.cat(lps)[rows])
        runs[bucket] = rows, torch.cat([e.advantages for e in exps]), width(exps)
    assert runs[False][0] == list(range(16)) and runs[True][0] != runs[False][0]
    assert torch.allclose(runs[True][1], runs[False][1][runs[True][0]])  # the same advantages, reordered
    assert runs[True][2] < runs[False][2], (runs[True][2], runs[False][2])
