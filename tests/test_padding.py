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
from tasks.ppo.padding import Span, attended_span, cut, length_order, pad_actions


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


def tiny_llama(V: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def rollout_chunk(P: int, N: int, plen: list[int], rlen: list[int], V: int, seed: int):
    """A Rollout of len(plen) rows: prompts of ``plen`` tokens left-padded to P, responses of
    ``rlen`` tokens in N columns."""
    from tasks.ppo.generation import Rollout

    g = torch.Generator().manual_seed(seed)
    cols = torch.arange(P + N)[None]
    attn = ((cols >= P - torch.tensor(plen)[:, None]) & (cols < P + torch.tensor(rlen)[:, None])).long()
    seqs = torch.randint(1, V, (len(plen), P + N), generator=g).masked_fill(attn == 0, 0)
    return Rollout(seqs, attn, attn[:, P:].float(), torch.tensor(rlen) < N)


def test_scoring_chunks_together_equals_scoring_each_alone():
    """Chunks of widths 11, 17, 14 (one generating worker's prompt padding each), fused into
    forwards of whole chunks: each chunk's log-probs and entropy equal its own forward's, under a
    row cap below the total (two forwards), at the total and with none (one), and below a chunk
    (one forward per chunk: a chunk is never split)."""
    from tasks.ppo.padding import score_together

    V, N = 64, 6
    model = tiny_llama(V)
    chunks = [rollout_chunk(5, N, [3, 5, 1, 4], [2, 6, 1, 3], V, 0),
              rollout_chunk(11, N, [9, 11, 2, 6], [1, 2, 2, 1], V, 1),  # every row stops early: a trailing cut alone
              rollout_chunk(8, N, [8, 7, 3, 5], [6, 4, 5, 6], V, 2)]
    calls = []

    def fn(ro):
        calls.append(len(ro.sequences))
        return forward_actions(model, ro.sequences, ro.attention_mask, ro.action_mask.shape[1])

    with torch.no_grad():
        alone = [fn(c) for c in chunks]
        for rows, forwards in [(8, [8, 4]), (12, [12]), (None, [12]), (2, [4, 4, 4])]:
            calls.clear()
            fused = score_together(fn, chunks, rows)
            assert calls == forwards, (rows, calls)
            for c, (lp, ent), (lp0, ent0) in zip(chunks, fused, alone):
                m = c.action_mask.bool()  # after a row's stop the numbers are meaningless (and 0 when cut alone)
                assert lp.shape == ent.shape == (4, N)
                torch.testing.assert_close(lp[m], lp0[m], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ent[m], ent0[m], rtol=1e-5, atol=1e-5)
                assert lp.untyped_storage().nbytes() == lp.nbytes  # its own copy, not a view of the fused batch
        # a single-tensor fn gives one tensor per chunk; per-row outputs (B,) split the same way
        ends = score_together(lambda ro: ro.attention_mask.sum(1), chunks)
    assert [e.tolist() for e in ends] == [c.attention_mask.sum(1).tolist() for c in chunks]


def test_critic_values_and_reward_scores_of_chunks_together_equal_each_alone(rlhf_cache):
    """The critic's per-action values and the reward model's per-row scores on chunks of
    different widths in one forward, against each chunk alone."""
    from tasks.ppo.padding import score_together
    from tasks.ppo.roles import _Values
    from tasks.rm.model import build_reward_model

    cfg = ModelConfig()
    torch.manual_seed(0)
    rm = build_reward_model(cfg).eval()
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    V, N = len(load_tokenizer(cfg)), 6
    chunks = [rollout_chunk(5, N, [3, 5, 1], [2, 6, 1], V, 0), rollout_chunk(12, N, [9, 12, 2], [1, 2, 6], V, 1)]
    values = lambda ro: _Values(rm)(ro.sequences, ro.attention_mask, N)  # noqa: E731
    score = lambda ro: rm(*(cut(t, attended_span(ro.attention_mask, N)) for t in ro[:2]))  # noqa: E731
    with torch.no_grad():
        for fn in (values, score):
            for c, together, alone in zip(chunks, score_together(fn, chunks), map(fn, chunks)):
                m = c.action_mask.bool() if together.dim() == 2 else slice(None)
                torch.testing.assert_close(together[m], alone[m], rtol=1e-5, atol=1e-5)
    assert alone.std() > 0  # the head is not constant


def test_logit_rows_caps_the_actors_scoring_forward_in_whole_chunks():
    from tasks.ppo.padding import logit_rows

    assert logit_rows(16, 64, 32000) == 128  # 2**28 / (64 * 32000) = 131 rows, down to whole chunks
    assert logit_rows(16, 64, 151936) == 16  # 27 rows: one chunk
    assert logit_rows(3, 1024, 2**20) == 3  # not even one row fits: still the chunk
    assert logit_rows(16, 8, 96) == 349520 and logit_rows(16, 8, 96) % 16 == 0  # a small vocab: every row at once


def test_length_order_puts_rows_of_similar_length_into_one_minibatch():
    """A minibatch computes its longest prompt plus its longest response. By hand: responses of
    2 33 2 30 tokens under prompts of 3 -> minibatches of two {33, 30} and {2, 2} (48 + 16 columns
    instead of 48 + 48); equal rows keep their order. Ragged batches of 64 rows in minibatches of
    16: fewer columns than in rollout order, never more in groups, and groups stay whole."""
    P, N = 8, 40
    cols = torch.arange(P + N)[None]
    m = ((cols >= P - 3) & (cols < P + torch.tensor([2, 33, 2, 30])[:, None])).long()
    assert length_order(m, N, 2).tolist() == [1, 3, 0, 2]
    assert length_order(torch.ones(4, 7, dtype=torch.long), 3, 2).tolist() == [0, 1, 2, 3]

    g = torch.Generator().manual_seed(3)
    for P, N, lo in ((256, 256, 20), (128, 128, 100), (512, 128, 16), (48, 64, 4)):
        B = 64
        plen, rlen = torch.randint(lo, P + 1, (B,), generator=g), torch.randint(1, N + 1, (B,), generator=g)
        cols = torch.arange(P + N)[None]
        attn = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()
        width = lambda a: sum(s.stop - s.start for s in (attended_span(c, N) for c in a.split(16)))  # noqa: E731
        order = length_order(attn, N, 16)
        assert sorted(order.tolist()) == list(range(B))
        assert width(attn[order]) < 0.95 * width(attn), (P, N, width(attn[order]), width(attn))
        for grp in (2, 4, 8):  # groups of consecutive rows stay consecutive and whole
            o = length_order(attn, N, 16, grp)
            assert width(attn[o]) <= width(attn)
            o = o.view(-1, grp)
            assert torch.equal(o - o[:, :1], torch.arange(grp).expand_as(o)) and bool((o[:, 0] % grp == 0).all())
