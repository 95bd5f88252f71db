"""tasks/ppo/padding.py: the learners' and scorers' forwards skip columns no row attends.

Three ways: hand-computed spans, invariants over random masks, and the real forwards (policy
log-probs and entropy, critic values, reward scores) on cut batches equal to the same forwards
on the whole batch, on a Llama (RoPE) and a GPT-2 (absolute positions: a wrong position after the
cut would change every logit)."""

from __future__ import annotations

import pytest
import torch

from tasks.common.model import ModelConfig, load_causal_lm, load_tokenizer
from tasks.ppo.generation import action_logprobs, forward_actions, position_ids_from_mask
from tasks.ppo.losses import logprobs_from_logits
from tasks.ppo.padding import Span, attended_span, cut, pad_actions


def mask(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[int(c) for c in r] for r in rows])


def test_hand_computed_spans():
    # L = 10, N = 4: prompt columns 0-5, action columns 6-9
    m = mask(["0011111100",
              "0001111110"])
    assert attended_span(m, 4, multiple=1) == Span(2, 9, 3, 4)  # 2 left-pad columns, the last action column empty
    assert attended_span(m, 4, multiple=4) == Span(1, 9, 3, 4)  # width 8: widened on the left
    assert attended_span(m, 4, multiple=16) == Span(0, 10, 4, 4)  # wider than the batch: all of it
    # every row stopped at its first action: the first action column stays, and the last prompt column
    assert attended_span(mask(["0000011000", "0000111000"]), 4, multiple=1) == Span(4, 7, 1, 4)
    # the first action is predicted by the last prompt column, even when no prompt token is there
    assert attended_span(mask(["0000001111"]), 4, multiple=1) == Span(5, 10, 4, 4)
    assert attended_span(mask(["1111111111"]), 4, multiple=1) == Span(0, 10, 4, 4)
    with pytest.raises(ValueError, match=r"num_actions \(10\) must be in 1..9"):
        attended_span(m, 10)


def test_span_invariants_on_random_masks():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        B, P, N = (int(torch.randint(1, n, (1,), generator=g)) for n in (6, 12, 12))
        L = P + N
        plen = torch.randint(1, P + 1, (B,), generator=g)
        rlen = torch.randint(0, N + 1, (B,), generator=g)
        cols = torch.arange(L)[None]
        m = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()
        multiple = int(torch.randint(1, 9, (1,), generator=g))
        s = attended_span(m, N, multiple)
        assert 0 <= s.start <= P - 1 < P + 1 <= s.stop <= L
        assert m[:, :s.start].sum() == 0 and m[:, s.stop:].sum() == 0  # nothing attended is cut
        assert s.actions == s.stop - P and 1 <= s.actions <= N
        assert (s.stop - s.start) % multiple == 0 or (s.start, s.stop) == (0, L) or s.stop - s.start == L
        x = torch.randn(B, s.actions, 3)
        padded = pad_actions(x, s)
        assert padded.shape == (B, N, 3) and torch.equal(padded[:, :s.actions], x) and not padded[:, s.actions:].any()


def tiny_gpt2(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=2, n_head=2, initializer_range=0.1,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    return GPT2LMHeadModel(cfg).eval()


def padded_batch(tok, B: int = 4, P: int = 40, N: int = 24):
    """Left-padded prompts of 5-12 tokens in P = 40 columns (28+ all-pad columns on the left) and
    responses that stop after 2-6 tokens (18+ all-pad columns on the right): the kept span is 32
    columns of 64 (18 attended, widened to a multiple of 16)."""
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(3, len(tok), (B, P + N), generator=g)
    plen, rlen = torch.tensor([5, 12, 9, 7]), torch.tensor([2, 6, 4, 3])
    cols = torch.arange(P + N)[None]
    attn = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()
    seqs = seqs.masked_fill(attn == 0, tok.pad_token_id)
    return seqs, attn, N


@pytest.mark.parametrize("arch", ["llama-rope", "gpt2-absolute-positions"])
def test_policy_logprobs_on_the_cut_batch_equal_the_whole_batch(arch, rlhf_cache):
    tok = load_tokenizer(ModelConfig())
    model = load_causal_lm(ModelConfig()).eval() if arch == "llama-rope" else tiny_gpt2(tok)
    seqs, attn, N = padded_batch(tok)
    span = attended_span(attn, N)
    assert span.stop - span.start < seqs.shape[1] and span.actions < N  # the batch really is cut on both sides
    with torch.no_grad():
        whole = model(input_ids=seqs, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits[:, -N - 1:-1].float()
        ref = logprobs_from_logits(whole, seqs[:, -N:])
        logp = action_logprobs(model, seqs, attn, N)
        logp2, ent = forward_actions(model, seqs, attn, N)
    act = attn[:, -N:].bool()
    assert logp.shape == ent.shape == (4, N) and span == Span(14, 46, 6, N)
    torch.testing.assert_close(logp[act], ref[act], rtol=1e-5, atol=1e-5)
    assert torch.equal(logp, logp2) and not logp[:, span.actions:].any() and not ent[:, span.actions:].any()


def test_critic_values_and_reward_scores_on_the_cut_batch_equal_the_whole_batch(rlhf_cache):
    from tasks.ppo.roles import _Values
    from tasks.rm.model import build_reward_model

    cfg = ModelConfig()
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    rm = build_reward_model(cfg).eval()
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    seqs, attn, N = padded_batch(tok)
    with torch.no_grad():
        values = _Values(rm)(seqs, attn, N)
        whole = rm.values(seqs, attn)[:, -N - 1:-1]
        span = attended_span(attn, N)
        score_cut, score_whole = rm(cut(seqs, span), cut(attn, span)), rm(seqs, attn)
    act = attn[:, -N:].bool()
    torch.testing.assert_close(values[act], whole[act], rtol=1e-5, atol=1e-5)
    assert not values[:, span.actions:].any()
    torch.testing.assert_close(score_cut, score_whole, rtol=1e-5, atol=1e-5)
    assert score_whole.std() > 0  # the head is not constant, so the comparison means something
