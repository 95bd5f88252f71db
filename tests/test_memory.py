"""Memory for real sizes, the CPU-testable parts: activation checkpointing keeps fewer
activations and changes no number; 'auto' leaves CPU runs as they were."""

from __future__ import annotations

import copy

import torch

from tasks.common.model import checkpoint_blocks


def _policy():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()


def test_checkpointed_blocks_keep_fewer_activations_and_give_the_same_gradients():
    """Eval mode, as the PPO learners run: HF's own checkpointing would be off there, ours is on."""
    from tasks.ppo.generation import action_logprobs, generate

    plain, ckpt = _policy(), None
    ckpt = copy.deepcopy(plain)
    assert checkpoint_blocks(ckpt, "auto", "cpu") is False  # auto: CUDA and > 1B parameters only
    assert checkpoint_blocks(ckpt, "on", "cpu") is True
    ids = torch.randint(1, 64, (4, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    out = {}
    for name, m in (("plain", plain), ("ckpt", ckpt)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            logp = action_logprobs(m, ids, mask, 6)
        (logp * torch.linspace(-1, 1, 6)).sum().backward()
        out[name] = (logp.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}, sum(saved))
    print(f"\nsaved activation elements: plain {out['plain'][2]}, checkpointed {out['ckpt'][2]}")
    assert out["ckpt"][2] < out["plain"][2] / 2
    assert torch.equal(out["ckpt"][0], out["plain"][0])
    for n, g in out["plain"][1].items():
        torch.testing.assert_close(out["ckpt"][1][n], g, rtol=1e-6, atol=1e-7, msg=n)
    # SFT's forward: train mode, the model's default use_cache (True: a KV cache is made and must not be appended twice)
    grads = []
    for m in (plain, ckpt):
        m.train()
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad})
        m.eval()
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7, msg=n)
    # no-grad forwards (generation with a KV cache) run the blocks as they are
    a = generate(plain, ids, mask, max_new_tokens=4, eos_token_id=-1, pad_token_id=0, greedy=True).sequences
    b = generate(ckpt, ids, mask, max_new_tokens=4, eos_token_id=-1, pad_token_id=0, greedy=True).sequences
    assert torch.equal(a, b)
