"""tasks/ppo/fast_generate.py against the plain decode loop and HF generate.

Tiny random-weight Llama (grouped-query attention) and Qwen2 (q/k/v biases) models, fp32, left
padding. On a machine with CUDA the same tests run on the GPU with the decode step captured in a
CUDA graph; on CPU (CI) the same static-cache code runs eagerly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tasks.ppo.fast_generate import FastGenerator
from tasks.ppo.generation import generate, position_ids_from_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD, V, N = 0, 96, 12
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD)


def tiny(kind: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    with torch.no_grad():  # larger than init so that greedy rows differ and ties are rare
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
        for layer in model.model.layers:
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, name).weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
    return model.to(DEVICE).eval()


def left_padded(lengths=(7, 3, 10, 5), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), P), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, P - n:] = torch.randint(1, V, (n,), generator=g)
        mask[b, P - n:] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def plain(model, ids, mask, eos, **kw):
    return generate(model, ids, mask, max_new_tokens=N, eos_token_id=eos, pad_token_id=PAD, **kw)


def fast(fg, ids, mask, eos, **kw):
    return fg.generate(ids, mask, max_new_tokens=N, eos_token_id=eos, pad_token_id=PAD, **kw)


def eos_mid(model, ids, mask) -> int:
    """A token that greedy decoding emits mid-response in some rows but not all (used as EOS)."""
    free = plain(model, ids, mask, eos=-1, greedy=True).sequences[:, -N:]
    for t in free[0, 1:-2].tolist():
        if not all((r == t).any() for r in free):
            return t
    raise AssertionError(f"no token of row 0 is missing from another row: {free.tolist()}")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    model = tiny(request.param)
    ids, mask = left_padded()
    return model, ids, mask, eos_mid(model, ids, mask)


def test_greedy_equals_hf_generate(setup):
    model, ids, mask, eos = setup
    ours = fast(FastGenerator(model, max_batch=8, max_len=32), ids, mask, eos, greedy=True)
    assert ours.ended_with_eos.any() and not ours.ended_with_eos.all()
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N,
                        eos_token_id=eos, pad_token_id=PAD)
    P = ids.shape[1]
    for b in range(len(ids)):
        n = int(ours.action_mask[b].sum())
        assert ours.sequences[b, P:P + n].tolist() == hf[b, P:P + n].tolist(), b


def test_greedy_equals_plain_loop(setup):
    model, ids, mask, eos = setup
    ours = fast(FastGenerator(model, max_batch=8, max_len=32), ids, mask, eos, greedy=True)
    ref = plain(model, ids, mask, eos, greedy=True)
    for field in ("sequences", "attention_mask", "action_mask", "ended_with_eos"):
        assert torch.equal(getattr(ours, field), getattr(ref, field)), field


def test_masks_and_per_row_eos_stop(setup):
    model, ids, mask, eos = setup
    P = ids.shape[1]
    r = fast(FastGenerator(model, max_batch=4, max_len=P + N), ids, mask, eos, greedy=True)
    assert r.sequences.shape == (4, P + N) and r.action_mask.dtype == torch.float32
    for b in range(4):
        row = r.sequences[b, P:].tolist()
        n = row.index(eos) + 1 if eos in row else N
        assert r.action_mask[b].tolist() == [1.0] * n + [0.0] * (N - n)
        assert row[n:] == [PAD] * (N - n)  # nothing after the first EOS
        assert bool(r.ended_with_eos[b]) == (eos in row)
    assert torch.equal(r.attention_mask[:, :P], mask)
    assert torch.equal(r.attention_mask[:, P:].float(), r.action_mask)


def test_logits_match_the_model_forward(setup):
    """Each step's logits equal a full forward of the model over the sequence so far."""
    model, ids, mask, _ = setup
    fg = FastGenerator(model, max_batch=4, max_len=32)
    seq = fast(fg, ids, mask, eos=-1, greedy=True).sequences
    full = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)
    with torch.no_grad():
        want = model(input_ids=seq, attention_mask=full, position_ids=position_ids_from_mask(full)).logits
        fg.refresh_weights()
        got_prefill = fg._prefill(ids, mask)
    torch.testing.assert_close(got_prefill, want[:, ids.shape[1] - 1], rtol=1e-4, atol=1e-4)


def test_sampling_equals_plain_loop_with_same_generator(setup):
    model, ids, mask, eos = setup
    fg = FastGenerator(model, max_batch=4, max_len=32)
    for kw in (dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8, top_k=20)):
        a = fast(fg, ids, mask, eos, generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        b = plain(model, ids, mask, eos, generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        assert torch.equal(a.sequences, b.sequences), kw
        assert torch.equal(a.action_mask, b.action_mask), kw


def test_smaller_batches_and_repeated_calls_reuse_the_cache(setup):
    model, ids, mask, eos = setup
    fg = FastGenerator(model, max_batch=4, max_len=32)
    for sl in (slice(0, 4), slice(1, 3), slice(0, 4), slice(2, 3)):
        a = fast(fg, ids[sl], mask[sl], eos, greedy=True)
        assert torch.equal(a.sequences, plain(model, ids[sl], mask[sl], eos, greedy=True).sequences), sl


def test_in_place_weight_update_is_picked_up():
    """An optimizer step changes parameters in place: the next (graph) decode must use them."""
    model = tiny("llama", seed=4)
    ids, mask = left_padded(seed=5)
    fg = FastGenerator(model, max_batch=4, max_len=32)
    before = fast(fg, ids, mask, eos=-1, greedy=True).sequences
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    opt.step()
    model.eval()
    after, ref = fast(fg, ids, mask, eos=-1, greedy=True).sequences, plain(model, ids, mask, eos=-1, greedy=True).sequences
    assert not torch.equal(after, before)  # the update mattered
    assert torch.equal(after, ref)
    with torch.no_grad():  # replaced (not in-place) tensors: graphs are re-captured
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    assert torch.equal(fast(fg, ids, mask, eos=-1, greedy=True).sequences, plain(model, ids, mask, eos=-1, greedy=True).sequences)


def test_low_precision_shadow_weights_follow_updates():
    """fp32 master weights decoded in bf16: the cast copy is refreshed on every call."""
    model = tiny("llama", seed=6)
    ids, mask = left_padded(seed=7)
    fg = FastGenerator(model, max_batch=4, max_len=32, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    ref_model = tiny("llama", seed=6)
    ref_model.load_state_dict(model.state_dict())
    ref = plain(ref_model.to(torch.bfloat16), ids, mask, eos=-1, greedy=True).sequences
    got = fast(fg, ids, mask, eos=-1, greedy=True).sequences
    assert (got == ref).float().mean() > 0.9  # bf16 kernels differ in rounding: near-ties may flip
    assert next(model.parameters()).dtype == torch.float32


def test_lora_adapter_is_part_of_the_decode():
    from peft import LoraConfig, get_peft_model

    model = tiny("llama", seed=8)
    ids, mask = left_padded(seed=9)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    peft_model.eval()
    a = fast(FastGenerator(peft_model, max_batch=4, max_len=32), ids, mask, eos=-1, greedy=True)
    assert torch.equal(a.sequences, plain(peft_model, ids, mask, eos=-1, greedy=True).sequences)
    with peft_model.disable_adapter():
        base = plain(peft_model, ids, mask, eos=-1, greedy=True).sequences
    assert not torch.equal(a.sequences, base)  # the adapter changed the output


def test_errors_name_the_sizes_and_the_model():
    model = tiny("llama")
    ids, mask = left_padded()
    fg = FastGenerator(model, max_batch=2, max_len=16)
    with pytest.raises(ValueError, match=r"batch 4 .*max_batch=2"):
        fast(fg, ids, mask, eos=-1, greedy=True)
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="GPT2LMHeadModel is not a Llama-style decoder"):
        FastGenerator(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=V)), 2, 16)
