"""tasks/ppo/packing.py: the learners' and scorers' forwards on the rows' real tokens, packed.

Three ways: a hand-computed first-fit packing, invariants over random ragged batches (every real
token at its place with its position, transformers reading one sequence per row and tail), and
the real forwards (policy log-probs, entropy and their gradients; critic values; reward scores)
packed equal to the padded forwards on Llama (RoPE), Qwen2, Mistral, Gemma 2 (sliding-window
layers, softcapping) and GPT-2 (absolute positions)."""

from __future__ import annotations

import pytest
import torch

from tasks.ppo.generation import action_logprobs, forward_actions, packs, position_ids_from_mask
from tasks.ppo.packing import action_positions, bins_first_fit, head_on, pack, unpack
from tests.test_padding import rollout_chunk


def ragged(B: int, P: int, N: int, V: int, seed: int, min_resp: int = 1):
    """Left-padded prompts of 1..P tokens, responses of min_resp..N: a Rollout."""
    g = torch.Generator().manual_seed(seed)
    plen, rlen = torch.randint(1, P + 1, (B,), generator=g), torch.randint(min_resp, N + 1, (B,), generator=g)
    return rollout_chunk(P, N, plen.tolist(), rlen.tolist(), V, seed)


def test_first_fit_decreasing_by_hand():
    # longest first: 8 -> bin 0; 6 -> bin 1; 5 fits neither -> bin 2; 3 -> bin 1 (6 + 3); 2 -> bin 0 (8 + 2)
    where, offset, fill = bins_first_fit([5, 3, 8, 2, 6], 10)
    assert where == [2, 1, 0, 0, 1] and offset == [0, 6, 0, 8, 0] and fill == [10, 9, 5]
    assert bins_first_fit([4, 4], 4) == ([0, 1], [0, 0], [4, 4])


def test_pack_invariants_on_random_batches():
    from transformers.masking_utils import find_packed_sequence_indices

    for seed in range(40):
        ro = ragged(B=int(torch.randint(1, 12, (1,))), P=9, N=7, V=50, seed=seed, min_resp=0)
        capacity = int(torch.randint(1, 40, (1,)))
        p = pack(ro.sequences, ro.attention_mask, capacity, multiple=4)
        R, C = p.input_ids.shape
        m = ro.attention_mask.bool()
        longest = -(-int(m.sum(1).max()) // 4) * 4
        assert C % 4 == 0 and longest <= C <= max(-(-capacity // 4) * 4, longest)
        assert R == len(bins_first_fit(m.sum(1).tolist(), max(-(-capacity // 4) * 4, longest))[2])  # as few bins as the full width
        places = p.index[m]
        assert places.unique().numel() == places.numel() and 0 <= int(places.min()) and int(places.max()) < R * C
        assert torch.equal(unpack(p.input_ids, p.index), ro.sequences * m)  # every token at its place
        assert torch.equal(unpack(p.position_ids, p.index), position_ids_from_mask(ro.attention_mask) * m)
        assert bool((p.index == -1).eq(~m).all())
        # transformers reads each bin as its rows' sequences plus, where the bin is not full, one tail sequence
        seg = find_packed_sequence_indices(p.position_ids)
        seg = torch.zeros_like(p.position_ids) if seg is None else seg
        rows_per_bin = torch.zeros(R, dtype=torch.long).index_add_(0, p.index.amax(1)[m.any(1)] // C, torch.ones(int(m.any(1).sum()), dtype=torch.long))
        used = torch.zeros(R * C, dtype=torch.bool)
        used[places] = True
        tail = (~used.view(R, C)).any(1).long()
        assert torch.equal(seg[:, -1] + 1, rows_per_bin + tail)
        # a row's tokens are one run in one bin
        for b in range(len(m)):
            if m[b].any():
                run = p.index[b][m[b]]
                assert torch.equal(run, torch.arange(int(run[0]), int(run[0]) + len(run))) and int(run[0]) // C == int(run[-1]) // C
        # the sequences' starts for the varlen attention: each position 0 (rows' and tails'), then R * C
        cu = p.cu_seqlens.long()
        assert int(cu[0]) == 0 and int(cu[-1]) == R * C and bool((cu.diff() > 0).all()) and p.max_len == int(cu.diff().max())
        assert torch.equal(cu[:-1], (p.position_ids.flatten() == 0).nonzero().squeeze(1)) and len(cu) - 1 == int((seg[:, -1] + 1).sum())
        # the places that predict actions: the token before each attended action
        a = action_positions(p, ro.attention_mask, 7)
        act = ro.attention_mask[:, -7:].bool()
        assert bool((a[~act] == -1).all()) and torch.equal(a[act] + 1, p.index[:, -7:][act])


def tiny(arch: str, V: int = 64):
    import transformers as T

    torch.manual_seed(0)
    if arch == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.1,
                                              bos_token_id=0, eos_token_id=0)).eval()
    cls, cfg = {"llama": (T.LlamaForCausalLM, T.LlamaConfig), "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config),
                "mistral": (T.MistralForCausalLM, T.MistralConfig), "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config)}[arch]
    extra = {"head_dim": 8, "sliding_window": 6} if arch == "gemma2" else {}  # a window shorter than the rows: the sliding layers' masks too
    return cls(cfg(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, **extra)).eval()


@pytest.mark.parametrize("arch, attn", [(a, i) for a in ("llama", "qwen2", "mistral", "gpt2") for i in ("sdpa", "eager")]
                         + [("gemma2", "eager")])  # Gemma 2's logit softcapping: transformers refuses SDPA
def test_policy_forward_and_gradients_packed_equal_padded(arch, attn):
    model = tiny(arch)
    model.config._attn_implementation = attn
    N = 8
    ro = ragged(B=9, P=12, N=N, V=64, seed=3)
    act = ro.action_mask.bool()
    assert packs(model)
    out = {}
    for pack_tokens in (0, 32):
        model.zero_grad()
        logp, ent = forward_actions(model, ro.sequences, ro.attention_mask, N, 0.7, pack_tokens)
        (logp * ro.action_mask).sum().backward()
        out[pack_tokens] = logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]
    (lp0, e0, g0), (lp, e, g) = out[0], out[32]
    torch.testing.assert_close(lp[act], lp0[act], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e[act], e0[act], rtol=1e-5, atol=1e-5)
    assert not lp[~act].any() and not e[~act].any()  # nothing computed after a row's stop
    for a, b in zip(g, g0):
        # packed and padded matmuls sum in other orders: GPT-2 eager's gradients part by 2.4e-6 on
        # elements near 0.013 (transformers 5.25, torch 2.13 CPU); a token attending the wrong
        # sequence or position moves them by orders of magnitude more
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(action_logprobs(model, ro.sequences, ro.attention_mask, N, 0.7, 32).detach(), lp)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2", "gpt2"])
def test_packed_forwards_attend_through_the_varlen_function(arch):
    """Every architecture above sends its attention to tasks/ppo/varlen.py in a packed forward:
    without the sequences' starts that function refuses, so a model that silently kept its own
    attention (and, with no mask built, attended across sequences) would fail here."""
    from tasks.ppo.varlen import attend_packed

    model = tiny(arch)
    ro = ragged(B=5, P=8, N=4, V=64, seed=4)
    p = pack(ro.sequences, ro.attention_mask, 16)
    with attend_packed(model.config), pytest.raises(RuntimeError, match="runs only on packed rows"):
        model(input_ids=p.input_ids, position_ids=p.position_ids)


def test_lm_head_reads_only_the_positions_that_predict_actions():
    model = tiny("llama")
    ro = ragged(B=6, P=10, N=5, V=64, seed=5)
    seen = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        action_logprobs(model, ro.sequences, ro.attention_mask, 5, pack_tokens=16)
    assert seen == [(1, int(ro.action_mask.sum()), 32)]
    # no module: the context does nothing
    with head_on(None, torch.tensor([0])) as ran:
        assert ran == []


def test_remote_code_models_run_unpacked():
    """A model class outside transformers (trust_remote_code) may build its own masks from
    ``attention_mask``: ``pack_tokens`` leaves it on the padded path, same numbers; so does a
    model with attention sinks."""
    import transformers as T

    class RemoteLlama(T.LlamaForCausalLM):
        pass

    model = RemoteLlama(tiny("llama").config).eval()
    assert not packs(model) and packs(tiny("llama"))
    # attention sinks (gpt-oss's s_aux): the packed attention has none, so such a model runs padded too
    sinks = T.GptOssForCausalLM(T.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                               num_experts_per_tok=1, max_position_embeddings=64, pad_token_id=0)).eval()
    assert not packs(sinks)
    ro = ragged(B=4, P=8, N=4, V=64, seed=1)
    with torch.no_grad():
        assert torch.equal(action_logprobs(model, ro.sequences, ro.attention_mask, 4, pack_tokens=16),
                           action_logprobs(model, ro.sequences, ro.attention_mask, 4))


def test_critic_values_and_reward_scores_packed_equal_padded(rlhf_cache):
    from tasks.common.model import ModelConfig, load_tokenizer
    from tasks.ppo.roles import _Values, score_rows
    from tasks.rm.model import build_reward_model

    cfg = ModelConfig()
    torch.manual_seed(0)
    rm = build_reward_model(cfg).eval()
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    N = 6
    ro = ragged(B=7, P=11, N=N, V=len(load_tokenizer(cfg)), seed=2)
    act = ro.action_mask.bool()
    with torch.no_grad():
        v0, v = _Values(rm, 0)(ro.sequences, ro.attention_mask, N), _Values(rm, 32)(ro.sequences, ro.attention_mask, N)
        s0, s = score_rows(rm, ro, 0, "cpu"), score_rows(rm, ro, 32, "cpu")
    torch.testing.assert_close(v[act], v0[act], rtol=1e-5, atol=1e-5)
    assert not v[~act].any()
    torch.testing.assert_close(s, s0, rtol=1e-5, atol=1e-5)
    assert s0.std() > 0  # the head is not constant, so the comparison means something


def test_bin_width_narrows_the_bins_to_the_fewest_that_fit():
    from tasks.ppo.packing import bin_width

    # 2,300 tokens in bins of up to 1,024 columns: 3 bins; 800 columns still hold them in 3, 784 do not
    lengths = [200] * 10 + [150] * 2
    C, (where, offset, fill) = bin_width(lengths, 1024)
    assert len(fill) == 3 and C < 1024 and max(fill) <= C and len(bins_first_fit(lengths, C - 16)[2]) > 3
    assert bin_width([300, 10], 256)[0] == 304  # a row longer than the capacity: its own width, rounded up
    assert bin_width([16, 16], 1024)[0] == 32
