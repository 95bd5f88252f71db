"""tasks/ppo/generation.py on the built-in tiny Llama: the decode loop against HF generate, masks,
sampling filters, and log-probs recomputed with left padding."""

from __future__ import annotations

import copy

import pytest
import torch

from tasks.common.model import ModelConfig, load_causal_lm, load_tokenizer
from tasks.ppo.generation import action_head, action_logprobs, forward_actions, generate, sample_next
from tasks.ppo.losses import entropy_from_logits

PROMPTS = [
    "Human: Describe the river.\nAssistant:",
    "Human: Hi\nAssistant:",
    "Human: What is the cat like? Tell me about it.\nAssistant:",
    "Human: Tell me about the storm.\nAssistant:",
]
N = 12


def tiny_gpt2(tok):
    """A random tiny GPT-2, built here (nothing downloaded). Llama's RoPE only sees relative
    positions, so wrong position ids under left padding go unnoticed there; GPT-2's learned
    absolute position embeddings make every position-id mistake change the logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=2, n_head=2, initializer_range=0.1,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    return GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module", params=["llama-rope", "gpt2-absolute-positions"])
def lm(request, rlhf_cache):
    cfg = ModelConfig()
    tok = load_tokenizer(cfg)
    tok.padding_side = "left"
    model = load_causal_lm(cfg) if request.param == "llama-rope" else tiny_gpt2(tok)
    return model.eval(), tok


@pytest.fixture(scope="module")
def batch(lm):
    _, tok = lm
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert len(set(enc.attention_mask.sum(-1).tolist())) > 1  # prompts of different lengths
    return enc.input_ids, enc.attention_mask


class Recorder(torch.nn.Module):
    """Calls the real model and keeps each forward's last-position logits (DDP-like ``.module``)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.step_logits: list[torch.Tensor] = []
        self.train(module.training)  # a new Module is in train mode; generate restores it after

    def forward(self, **kw):
        out = self.module(**kw)
        self.step_logits.append(out.logits[:, -1, :].detach().clone())
        return out


def gen(model, tok, ids, mask, eos, **kw):
    return generate(model, ids, mask, max_new_tokens=N, eos_token_id=eos, pad_token_id=tok.pad_token_id, **kw)


@pytest.fixture(scope="module")
def eos_mid(lm, batch):
    """An EOS id that greedy decoding emits mid-response in some rows but not all.

    The tiny model is untrained and rarely emits its real EOS, so we pick one of its tokens
    (HF generate and ours both take eos_token_id as a parameter)."""
    model, tok = lm
    free = gen(model, tok, *batch, eos=-1, greedy=True).sequences[:, -N:]
    for tok_id in free[0, 1:-1].tolist():
        rows = [(r == tok_id).any().item() for r in free]
        if not all(rows):
            return tok_id
    pytest.fail(f"no token of row 0 is missing from another row: {free.tolist()}")


def first_eos(row: list[int], eos: int) -> int | None:
    return row.index(eos) if eos in row else None


# ============================================================================ vs Hugging Face

def test_greedy_matches_hf_generate(lm, batch, eos_mid):
    model, tok = lm
    ids, mask = batch
    ours = gen(model, tok, ids, mask, eos_mid, greedy=True)
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N,
                        eos_token_id=eos_mid, pad_token_id=tok.pad_token_id)
    assert ours.sequences.shape == (len(PROMPTS), ids.shape[1] + N)
    assert torch.equal(ours.sequences[:, : ids.shape[1]], ids)
    for b in range(len(PROMPTS)):
        hf_row = hf[b, ids.shape[1]:].tolist()
        our_row = ours.sequences[b, ids.shape[1]:].tolist()
        e = first_eos(hf_row, eos_mid)
        upto = len(hf_row) if e is None else e + 1
        assert our_row[:upto] == hf_row[:upto], b
    assert ours.ended_with_eos.any() and not ours.ended_with_eos.all()


def test_masks_and_eos_flags(lm, batch, eos_mid):
    model, tok = lm
    ids, mask = batch
    P = ids.shape[1]
    r = gen(model, tok, ids, mask, eos_mid, greedy=True)
    assert r.action_mask.dtype == torch.float32 and r.action_mask.shape == (len(PROMPTS), N)
    for b in range(len(PROMPTS)):
        row = r.sequences[b, P:].tolist()
        e = first_eos(row, eos_mid)
        n_act = N if e is None else e + 1
        assert r.action_mask[b].tolist() == [1.0] * n_act + [0.0] * (N - n_act)
        assert row[n_act:] == [tok.pad_token_id] * (N - n_act)
        assert bool(r.ended_with_eos[b]) == (e is not None)
    assert torch.equal(r.attention_mask[:, :P], mask)
    assert torch.equal(r.attention_mask[:, P:].float(), r.action_mask)


def test_always_n_columns_and_fixed_step_count_with_all_finished(lm, batch):
    model, tok = lm
    ids, mask = batch
    # one row whose first greedy token is taken as EOS: it is finished after one step
    one_ids, one_mask = ids[:1], mask[:1]
    eos0 = int(gen(model, tok, one_ids, one_mask, eos=-1, greedy=True).sequences[0, ids.shape[1]])
    rec = Recorder(model)
    local = gen(rec, tok, one_ids, one_mask, eos0, greedy=True)
    assert local.sequences.shape[1] == ids.shape[1] + N
    assert local.action_mask[0].tolist() == [1.0] + [0.0] * (N - 1)
    assert len(rec.step_logits) == 1  # prefill only: stopped after the first token

    calls = []
    rec = Recorder(model)
    others_busy = gen(rec, tok, one_ids, one_mask, eos0, greedy=True, all_finished=lambda d: calls.append(d) or False)
    assert len(rec.step_logits) == N  # prefill + N-1 decode steps, like a rank whose peers are busy
    assert calls == [True] * (N - 1)
    assert all(torch.equal(a, b) for a, b in zip(local, others_busy))


# ============================================================================ sampling

def test_seeded_sampling_is_reproducible(lm, batch):
    model, tok = lm
    kw = dict(temperature=1.3, top_k=50, top_p=0.95)
    a = gen(model, tok, *batch, eos=tok.eos_token_id, generator=torch.Generator().manual_seed(7), **kw)
    b = gen(model, tok, *batch, eos=tok.eos_token_id, generator=torch.Generator().manual_seed(7), **kw)
    c = gen(model, tok, *batch, eos=tok.eos_token_id, generator=torch.Generator().manual_seed(8), **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a.sequences, c.sequences)


def test_top_k_one_and_tiny_top_p_equal_greedy(lm, batch, eos_mid):
    model, tok = lm
    greedy = gen(model, tok, *batch, eos_mid, greedy=True)
    k1 = gen(model, tok, *batch, eos_mid, temperature=2.0, top_k=1, generator=torch.Generator().manual_seed(0))
    p0 = gen(model, tok, *batch, eos_mid, temperature=2.0, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(k1.sequences, greedy.sequences)
    assert torch.equal(p0.sequences, greedy.sequences)


def test_sample_next_draws_what_multinomial_draws():
    """The exponential race is torch.multinomial's own one-sample path: same generator, same tokens."""
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(1)) * 3
    for temp in (1.0, 0.6):
        ours = sample_next(logits, temperature=temp, generator=torch.Generator().manual_seed(2))
        ref = torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=torch.Generator().manual_seed(2))[:, 0]
        assert torch.equal(ours, ref), temp


def test_sample_next_filters():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(4000, 1)
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, greedy=True), torch.zeros(4000, dtype=torch.long))
    s = sample_next(logits, top_k=2, generator=g)
    assert set(s.tolist()) == {0, 1}
    assert (s == 0).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)
    # top_p=0.75: token 1 is needed to reach 0.75, token 2 is not
    assert set(sample_next(logits, top_p=0.75, generator=g).tolist()) == {0, 1}
    assert set(sample_next(logits, top_p=0.85, generator=g).tolist()) == {0, 1, 2}
    assert set(sample_next(logits, generator=g).tolist()) == {0, 1, 2, 3}
    # temperature sharpens: at T=0.25, p ~ p^4 -> token 0 has 0.5^4 / sum(p^4) of the mass
    p4 = probs[0] ** 4
    s = sample_next(logits, temperature=0.25, generator=g)
    assert (s == 0).float().mean().item() == pytest.approx((p4[0] / p4.sum()).item(), abs=0.03)


# ============================================================================ log-probs

def test_action_logprobs_match_decoding_step_logits(lm, batch):
    model, tok = lm
    ids, mask = batch
    temp = 0.7
    rec = Recorder(model)
    r = gen(rec, tok, ids, mask, tok.eos_token_id, temperature=temp, generator=torch.Generator().manual_seed(3))
    steps = torch.stack(rec.step_logits[:N], dim=1)  # (B, N, V): logits that sampled each action
    assert steps.shape[1] == N  # nobody finished early with the real EOS of an untrained model
    actions = r.sequences[:, -N:]
    seen = torch.log_softmax(steps / temp, -1).gather(-1, actions[..., None])[..., 0]
    with torch.no_grad():
        lp = action_logprobs(model, r.sequences, r.attention_mask, N, temperature=temp)
        lp2, ent = forward_actions(model, r.sequences, r.attention_mask, N, temperature=temp)
    m = r.action_mask.bool()
    assert torch.allclose(lp[m], seen[m], atol=1e-4)
    assert torch.allclose(lp2, lp)
    assert torch.allclose(ent[m], entropy_from_logits(steps / temp)[m], atol=1e-4)


def test_compiled_head_matches_the_eager_one():
    """``action_head(compiled=True)`` (the compiled learners' head: one graph over every position,
    the logits read in bf16) gives the eager fp32 pieces' log-probs, entropy and logit gradient,
    for (B, n, V) and (K, V) logits."""
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 5, 300), (7, 300)]:
        logits = (torch.randn(*shape, generator=g) * 3).bfloat16()
        actions = torch.randint(0, shape[-1], shape[:-1], generator=g)
        w = torch.randn(shape[:-1], generator=g)
        out = {}
        for compiled in (False, True):
            x = logits.clone().requires_grad_()
            logp, _ = action_head(x, actions, 0.7, compiled=compiled)
            (logp * w).sum().backward()
            with torch.no_grad():
                lp2, ent = action_head(logits, actions, 0.7, entropy=True, compiled=compiled)
            out[compiled] = logp.detach(), x.grad, lp2, ent
        (a, ga, a2, ea), (b, gb, b2, eb) = out[False], out[True]
        assert a.shape == b.shape == ea.shape == eb.shape == actions.shape and gb.dtype == torch.bfloat16
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b2, a2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(eb, ea, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gb.float(), ga.float(), rtol=1e-2, atol=1e-3)  # both rounded once to bf16


def test_left_padding_does_not_change_logprobs(lm, batch):
    model, tok = lm
    ids, mask = batch
    r = gen(model, tok, ids, mask, tok.eos_token_id, generator=torch.Generator().manual_seed(4))
    extra = 5
    pad = torch.full((ids.shape[0], extra), tok.pad_token_id)
    seq_more = torch.cat([pad, r.sequences], 1)
    mask_more = torch.cat([torch.zeros_like(pad), r.attention_mask], 1)
    with torch.no_grad():
        a = action_logprobs(model, r.sequences, r.attention_mask, N)
        b = action_logprobs(model, seq_more, mask_more, N)
    m = r.action_mask.bool()
    assert torch.allclose(a[m], b[m], atol=1e-4)
    # and generation itself: greedy from the more-padded prompt gives the same tokens
    g1 = gen(model, tok, ids, mask, -1, greedy=True)
    g2 = gen(model, tok, torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad), mask], 1), -1, greedy=True)
    assert torch.equal(g1.sequences[:, -N:], g2.sequences[:, -N:])


def test_logprobs_have_grad_and_generate_restores_mode(lm, batch):
    model, tok = lm
    model.train()
    try:
        r = gen(model, tok, *batch, tok.eos_token_id, greedy=True)
        assert model.training
        lp = action_logprobs(model, r.sequences, r.attention_mask, N)
        assert lp.requires_grad and lp.shape == (len(PROMPTS), N)
    finally:
        model.eval()


def test_generate_through_peft_lora(lm, batch, eos_mid):
    from peft import LoraConfig, get_peft_model

    model, tok = lm
    base = gen(model, tok, *batch, eos_mid, greedy=True)
    targets = ["c_attn"] if model.config.model_type == "gpt2" else ["q_proj", "v_proj"]
    # get_peft_model returns its wrapper in train mode: GPT-2's dropout would make logprobs noisy
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=targets)).eval()
    out = gen(peft_model, tok, *batch, eos_mid, greedy=True)  # LoRA B starts at 0: same model
    assert torch.equal(out.sequences, base.sequences)
    with torch.no_grad():
        assert torch.allclose(action_logprobs(peft_model, out.sequences, out.attention_mask, N),
                              action_logprobs(model, base.sequences, base.attention_mask, N), atol=1e-5)
