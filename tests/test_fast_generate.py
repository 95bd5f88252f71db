"""tasks/ppo/fast_generate.py against the plain decode loop and HF generate.

Tiny random-weight Llama (grouped-query attention) and Qwen2 (q/k/v biases) models, fp32, left
padding. On a machine with CUDA the same tests run on the GPU with the decode step captured in a
CUDA graph; on CPU (CI) the same static-cache code runs eagerly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tasks.ppo.fast_generate import GREEDY, FastGenerator, _record
from tasks.ppo.generation import generate, position_ids_from_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD, V, N = 0, 96, 12
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD)


def tiny(kind: str = "llama", seed: int = 0, **shape):
    torch.manual_seed(seed)
    shape = {**SHAPE, **shape}
    model = LlamaForCausalLM(LlamaConfig(**shape)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape))
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
    """Every step's logits (prefill and each decode step) equal a full forward of the model over
    the sequence so far: positions, cache columns, masks and the packed weights are right."""
    model, ids, mask, _ = setup
    fg = FastGenerator(model, max_batch=4, max_len=32)
    seq = fast(fg, ids, mask, eos=-1, greedy=True).sequences
    b, P = ids.shape
    full = torch.cat([mask, torch.ones_like(seq[:, P:])], 1)
    got, finish = [], fg._decode_finish

    def record(w, *rest):  # a greedy step's end sees its logits
        got.append(w.clone())
        finish(w, *rest)

    fg._decode_finish = record
    with torch.no_grad():
        want = model(input_ids=seq, attention_mask=full, position_ids=position_ids_from_mask(full)).logits
        fg._reset(b, mask)
        got.append(fg._prefill(ids, mask))
        _record(seq[:, P], *fg._state(b))
        for s in range(1, N):
            fg._decode(b, GREEDY)  # greedy, as ``seq`` was made: the tokens fed are seq's
    assert len(got) == N
    for s, logits in enumerate(got):
        torch.testing.assert_close(logits, want[:, P - 1 + s], rtol=1e-4, atol=1e-4, msg=f"step {s}")
    assert torch.equal(fg._resp[:b, :N], seq[:, P:])  # the bookkeeping recorded the fed tokens


def test_sampling_equals_plain_loop_with_same_generator(setup):
    model, ids, mask, eos = setup
    fg = FastGenerator(model, max_batch=4, max_len=32)
    for kw in (dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8, top_k=20)):
        a = fast(fg, ids, mask, eos, generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        b = plain(model, ids, mask, eos, generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        assert torch.equal(a.sequences, b.sequences), kw
        assert torch.equal(a.action_mask, b.action_mask), kw


@pytest.mark.parametrize("scope", ["layer", "forward"])
def test_compiled_decode_equals_plain_loop(scope):
    """The torch.compile'd layer, or the whole decoder as one graph (``compile_scope``; what runs
    on CUDA, here through Inductor's CPU backend) traces with no graph break (fullgraph) and
    decodes the same greedy and seeded tokens."""
    model = tiny("llama", seed=12)
    ids, mask = left_padded(seed=13)
    fg = FastGenerator(model, max_batch=4, max_len=32, compile=True, compile_scope=scope)
    assert fg.info()["compiled"]
    assert torch.equal(fast(fg, ids, mask, eos=-1, greedy=True).sequences, plain(model, ids, mask, eos=-1, greedy=True).sequences)
    kw = dict(temperature=0.8, top_k=30)
    a = fast(fg, ids, mask, eos=-1, generator=torch.Generator(DEVICE).manual_seed(5), **kw)
    b = plain(model, ids, mask, eos=-1, generator=torch.Generator(DEVICE).manual_seed(5), **kw)
    assert torch.equal(a.sequences, b.sequences)
    with pytest.raises(ValueError, match="compile_scope 'model' is not 'layer' or 'forward'"):
        FastGenerator(model, max_batch=4, max_len=32, compile_scope="model")


def test_compiled_top_p_over_a_32k_vocabulary_at_a_second_batch_size_equals_plain_loop():
    """Top-p's cumsum over a real vocabulary's width, with the generator compiled, at two batch
    sizes: Inductor splits that scan of a few long rows and its CUDA codegen failed, at a static
    size as at a symbolic one (bench/rollout_realistic.py's realistic case, bench/RESULTS.md,
    2026-12-07, eleventh session); the top-p filter runs eagerly. Seeded rollouts equal the plain
    loop's at both sizes (on the CPU through Inductor's CPU backend, which does not split), and
    so do top-k's, which stay in the compiled sampler."""
    model = tiny("llama", seed=31, vocab_size=32000, num_hidden_layers=1)
    ids, mask = left_padded(seed=32)
    fg = FastGenerator(model, max_batch=4, max_len=32, compile=True)
    for kw in (dict(top_p=0.9), dict(temperature=0.9, top_k=50)):
        for rows in (slice(0, 4), slice(1, 3)):
            a = fast(fg, ids[rows], mask[rows], eos=-1, generator=torch.Generator(DEVICE).manual_seed(7), **kw)
            b = plain(model, ids[rows], mask[rows], eos=-1, generator=torch.Generator(DEVICE).manual_seed(7), **kw)
            assert torch.equal(a.sequences, b.sequences), (kw, rows)


def test_compaction_decodes_the_rows_still_going_and_keeps_the_tokens():
    """Rows that stop early (three stop ids, six of eight rows done within six steps): at the
    checks the going rows move to the front and the step runs at 4, then 2 rows; greedy and
    seeded top-p rollouts equal the plain loop's in every field, in row order."""
    model = tiny("llama", seed=21)
    ids, mask = left_padded(lengths=(7, 3, 10, 5, 9, 4, 6, 8), seed=22)
    stops = [10, 81, 52]
    fg = FastGenerator(model, max_batch=8, max_len=32, check_every=2)
    assert fg._sizes(8) == [8, 4, 2, 1] and fg._sizes(64) == [64, 32, 16, 8] and fg._sizes(3) == [3, 1]
    fields = ("sequences", "attention_mask", "action_mask", "ended_with_eos")
    got, want = fast(fg, ids, mask, stops, greedy=True), plain(model, ids, mask, stops, greedy=True)
    assert fg.compactions == [(2, 4), (6, 2)], fg.compactions
    assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in fields)
    assert got.action_mask.sum(-1).tolist() == [4, 1, N, 2, 1, 2, 6, N]  # rows 2 and 7 decoded to the end
    compacted = 0
    for seed in range(3, 7):
        kw = dict(temperature=0.9, top_p=0.9)
        got = fast(fg, ids, mask, stops, generator=torch.Generator(DEVICE).manual_seed(seed), **kw)
        want = plain(model, ids, mask, stops, generator=torch.Generator(DEVICE).manual_seed(seed), **kw)
        assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in fields), seed
        compacted += bool(fg.compactions)
    assert compacted  # the sampled rollouts compacted too (at least one of them)
    off = FastGenerator(model, max_batch=8, max_len=32, check_every=2, compact=False)
    assert off._sizes(8) == [8]
    assert torch.equal(fast(off, ids, mask, stops, greedy=True).sequences, plain(model, ids, mask, stops, greedy=True).sequences)
    assert off.compactions == []


def test_smaller_batches_and_repeated_calls_reuse_the_cache(setup):
    model, ids, mask, eos = setup
    fg = FastGenerator(model, max_batch=4, max_len=32)
    for sl in (slice(0, 4), slice(1, 3), slice(0, 4), slice(2, 3)):
        a = fast(fg, ids[sl], mask[sl], eos, greedy=True)
        assert torch.equal(a.sequences, plain(model, ids[sl], mask[sl], eos, greedy=True).sequences), sl


def test_a_new_graph_after_a_rollout_to_the_last_cache_column_stays_inside_the_cache(setup):
    """A new sampling setting captures a new graph, whose warm-up steps run on the state buffers
    left by the last rollout. When that rollout filled the cache to its last column (full-length
    prompts, no row stopped), the warm-up must still start at column and position 0: it read RoPE
    rows past max_len, a device-side assert on the H200 (bench/rollout_realistic.py)."""
    model, ids, mask, _ = setup
    n = 24 - ids.shape[1]
    fg = FastGenerator(model, max_batch=4, max_len=ids.shape[1] + n)
    assert fg.max_len == ids.shape[1] + n
    fg.generate(ids, mask, max_new_tokens=n, eos_token_id=-1, pad_token_id=PAD, greedy=True)
    assert int(fg._pos[:4].max()) == fg.max_len - 1  # the full-length row ended on the last column
    if DEVICE == "cuda":  # the real path: a second key captures a graph, then the rollout equals the plain loop's
        kw = dict(max_new_tokens=n, eos_token_id=-1, pad_token_id=PAD, temperature=0.7)
        a = fg.generate(ids, mask, generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        b = generate(model, ids, mask, generator=torch.Generator(DEVICE).manual_seed(3), **kw)
        assert torch.equal(a.sequences, b.sequences)
    else:  # what _graph's warm-up and capture run (CUDA only), eagerly: three steps from _reset
        fg._reset(4)
        for _ in range(3):
            fg._decode(4, GREEDY)
        assert int(fg._pos[:4].max()) == 3


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


def test_low_precision_copy_follows_updates():
    """fp32 master weights decoded in bf16: the cast copy is re-filled on every call, so the bf16
    logits follow an update of the fp32 weights (to bf16 rounding) and not the stale weights."""
    model = tiny("llama", seed=6)
    ids, mask = left_padded(seed=7)
    fg = FastGenerator(model, max_batch=4, max_len=32, dtype=torch.bfloat16)
    fast(fg, ids, mask, eos=-1, greedy=True)  # decoded once with the old weights

    def logits():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[:, -1]

    stale = logits()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    want = logits()
    r = fast(fg, ids, mask, eos=-1, greedy=True)  # refreshes the bf16 copy
    assert r.sequences.shape == (4, ids.shape[1] + N)
    with torch.no_grad():
        fg._reset(4, mask)
        got = fg._prefill(ids, mask).float()
    err, err_stale = [float((got - w).norm() / w.norm()) for w in (want, stale)]
    assert err < 0.06 and err_stale > 4 * err, (err, err_stale)  # measured on CPU: 0.038 vs 0.28
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


# -- when PPO uses it ------------------------------------------------------------------------------
def test_which_rollout_path_ppo_takes():
    from transformers import GPT2Config, MistralConfig

    from tasks.ppo.config import PPOConfig
    from tasks.ppo.fast_generate import fast_generate_applies

    llama = LlamaConfig(**SHAPE)
    assert fast_generate_applies("auto", "ddp", "cuda", llama)
    assert not fast_generate_applies("auto", "ddp", "cpu", llama)  # CPU keeps the plain loop
    assert fast_generate_applies("on", "ddp", "cpu", llama)
    assert not fast_generate_applies("off", "ddp", "cuda", llama)
    assert not fast_generate_applies("auto", "fsdp", "cuda", llama)  # sharded DTensors
    assert fast_generate_applies("auto", "colossalai_zero2", "cuda", llama)  # whole parameters on every rank
    assert fast_generate_applies("auto", "colossalai_gemini", "cuda", llama)  # through group.plain_copy
    assert not fast_generate_applies("auto", "ddp", "cuda", GPT2Config())
    with pytest.raises(ValueError, match=r"fast_generate 'on' cannot apply: model_type 'gpt2' .*set ppo.fast_generate 'auto' or 'off'"):
        fast_generate_applies("on", "ddp", "cuda", GPT2Config())
    with pytest.raises(ValueError, match=r"sliding-window"):
        fast_generate_applies("on", "ddp", "cuda", MistralConfig(sliding_window=64))
    with pytest.raises(ValueError, match=r"fast_generate 'on' needs every actor rank to hold full parameters.*'fsdp'"):
        PPOConfig(fast_generate="on", strategy="fsdp")
    assert PPOConfig(fast_generate="on", strategy="colossalai_gemini").fast_generate == "on"


def test_plain_copy_decodes_as_the_model_with_the_trainable_weights_loaded():
    """Gemini's rollouts: a copy sharing the frozen base, its own trainable (LoRA) weights, filled
    from full_state's dict before each rollout; FastGenerator over it decodes as over the model."""
    from peft import LoraConfig, get_peft_model

    from tasks.ppo.group import full_state, load_trainable, plain_copy

    peft_model = get_peft_model(tiny("llama", seed=12), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    ids, mask = left_padded(seed=13)
    copy = plain_copy(peft_model, DEVICE)
    orig, mine = dict(peft_model.named_parameters()), dict(copy.named_parameters())
    assert orig.keys() == mine.keys() and not any(p.requires_grad for p in mine.values())
    for n, p in orig.items():  # the frozen base shared, not copied; the adapters apart
        assert (mine[n].data_ptr() == p.data_ptr()) is (not p.requires_grad), n
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=5.0)
    peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    opt.step()  # the learner moves; the copy sees it only once loaded
    weights, _ = full_state(peft_model, with_optimizer=False)
    assert weights and all("lora_" in n for n in weights)
    load_trainable(copy, weights)
    assert all(torch.equal(mine[n], orig[n]) for n in orig)
    want = fast(FastGenerator(peft_model, max_batch=4, max_len=32), ids, mask, eos=-1, greedy=True).sequences
    got = fast(FastGenerator(copy, max_batch=4, max_len=32), ids, mask, eos=-1, greedy=True).sequences
    assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="not in the rollout copy"):
        load_trainable(copy, {"nope.weight": torch.zeros(1)})
    with pytest.raises(AssertionError, match="trainable weights of the rollout copy not given"):
        load_trainable(copy, dict(list(weights.items())[1:]))


def test_peft_update_is_seen_with_bf16_base_and_fp32_adapter():
    """What the PPO actor holds on a GPU: bf16 base weights, fp32 LoRA (PEFT's autocast). The
    decode runs on a bf16 shadow of the adapter, refreshed in place before every rollout."""
    from peft import LoraConfig, get_peft_model

    model = tiny("llama", seed=10).to(torch.bfloat16)
    ids, mask = left_padded(seed=11)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
                                autocast_adapter_dtype=True).eval()
    assert {p.dtype for n, p in peft_model.named_parameters() if "lora_" in n} == {torch.float32}
    fg = FastGenerator(peft_model, max_batch=4, max_len=32)
    assert fg.dtype == torch.bfloat16 and fg.weight_copy_bytes() > 0  # merged adapter deltas live in bf16 buffers
    before = fast(fg, ids, mask, eos=-1, greedy=True).sequences
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=20.0)
    peft_model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    opt.step()
    after = fast(fg, ids, mask, eos=-1, greedy=True).sequences
    ref = plain(peft_model, ids, mask, eos=-1, greedy=True).sequences  # fp32 LoRA math: rounding may differ
    assert not torch.equal(after, before)  # the update mattered
    assert (after == ref).float().mean() > 0.9


@pytest.fixture(scope="module")
def sft_adapter(rlhf_cache, ray_cluster, tmp_path_factory):
    """(store, data, sft, model config): data prep and a short SFT of the built-in model, fp32."""
    from storage import ArtifactStore
    from tasks.common.model import ModelConfig
    from tasks.data.config import DataConfig
    from tasks.data.prepare import prepare_data
    from tasks.sft.config import SFTConfig
    from tasks.sft.train import train_sft

    store = ArtifactStore(f"file://{tmp_path_factory.mktemp('fastgen-store')}")
    model = ModelConfig(dtype="float32")  # exact comparisons on a GPU too (bf16 is the bench's business)
    data = prepare_data(DataConfig(), model, store, 42)
    return store, data, train_sft(SFTConfig(max_steps=40), model, store, data, 42), model


def _actor(mode: str, stages, ppo, tok):
    import ray

    from tasks.ppo.config import RoleConfig
    from tasks.ppo.group import RoleGroup
    from tasks.ppo.roles import PolicyWorker

    store, data, sft, model = stages
    pg = ray.util.placement_group([{"CPU": 1.0, **({"GPU": 0.25} if DEVICE == "cuda" else {})}])
    ray.get(pg.ready())
    group = RoleGroup("actor", PolicyWorker, RoleConfig(cpus_per_worker=1.0, gpus_per_worker=0.25 if DEVICE == "cuda" else 0.0),
                      pg, "ddp", 42, DEVICE)
    ray.get(group.connect())
    w = group.workers[0]
    ray.get(w.load.remote(model, store, sft.key, data.key, ppo.model_copy(update={"fast_generate": mode}),
                          tok.pad_token_id, [tok.eos_token_id]))
    return group, pg, w


def test_policy_worker_fast_rollouts_equal_plain_ones_before_and_after_learning(sft_adapter):
    """PolicyWorker with ppo.fast_generate 'on' (static cache; on CUDA the graph) against 'off'
    (the plain loop): same greedy and seeded-sampled rollouts, and still the same after both
    learned from the same experience (the fast path reads the updated LoRA weights in place)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from tasks.common.model import load_tokenizer
    from tasks.data.dataset import read_jsonl
    from tasks.ppo.config import PPOConfig
    from tasks.ppo.roles import Experience

    store, data, _, model = sft_adapter
    tok = load_tokenizer(model, str(store.fetch(data.key) / "tokenizer"))
    prompts = [r["prompt_ids"] for r in read_jsonl(store.fetch(data.key) / "prompts_eval.jsonl")][:12]
    # fp32 learners on a GPU too (the fp32 model's, as train_ppo resolves ppo.learner_weights 'auto' for it): exact comparisons
    ppo = PPOConfig(rollout_batch_size=12, train_batch_size=12, max_new_tokens=16, actor_lr=0.05, ppo_epochs=2, learner_weights="fp32")
    started = [_actor(m, sft_adapter, ppo, tok) for m in ("on", "off")]
    (_, _, fast_w), (_, _, plain_w) = started
    try:
        assert ray.get(fast_w.rollout_info.remote())["fast_generate"] and not ray.get(plain_w.rollout_info.remote())["fast_generate"]

        def both(**kw):
            return ray.get([w.generate.remote(prompts, 1, **kw) for w in (fast_w, plain_w)])

        def assert_same(a, b):
            for field in a._fields:
                assert torch.equal(getattr(a, field), getattr(b, field)), field

        greedy, plain_greedy = both(greedy=True)
        assert_same(greedy, plain_greedy)
        assert greedy.ended_with_eos.any()  # rows stop at EOS on their own
        assert_same(*both(seed=7))  # sampled with the same seed (the evaluation's path)

        lp, _ = ray.get(fast_w.logprobs.remote(greedy))
        adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)) * greedy.action_mask
        exp = Experience(greedy.sequences, greedy.attention_mask, greedy.action_mask, lp, torch.zeros_like(lp), adv, torch.zeros_like(lp), torch.zeros_like(lp))
        ray.get([w.learn.remote(0.0, exp) for w in (fast_w, plain_w)])  # kl_coef unused: ppo.kl_penalty is reward
        digests = ray.get([w.local_digest.remote() for w in (fast_w, plain_w)])
        # the same LoRA weights in both (a GPU's attention backward may add in another order)
        assert digests[0] == (digests[1] if DEVICE == "cpu" else pytest.approx(digests[1], rel=1e-6))

        after, plain_after = both(greedy=True)
        assert not torch.equal(after.sequences, greedy.sequences)  # learning changed the policy's output
        assert_same(after, plain_after)
        info = ray.get(fast_w.rollout_info.remote())
        assert info["cuda_graphs"] == (DEVICE == "cuda") and info["graph_batch_sizes"] == ([12] if DEVICE == "cuda" else [])
        assert info["compact"] and not ray.get(plain_w.rollout_info.remote())["compact"]  # on by default; the plain loop has none
    finally:
        for group, pg, _ in started:
            group.kill()
            remove_placement_group(pg)


def test_policy_worker_decodes_with_ppo_decode_attention(sft_adapter):
    """``ppo.decode_attention`` and ``ppo.decode_linear`` reach the actor's FastGenerator: a
    PolicyWorker with 'triton' for both (on CPU in Triton's interpreter, which its Ray worker
    process turns on through its runtime_env) names them in ``rollout_info`` and decodes the greedy
    and seeded rollouts of one with 'sdpa' and 'cublas'."""
    import ray

    from tasks.common.model import load_tokenizer
    from tasks.data.dataset import read_jsonl
    from tasks.ppo.config import PPOConfig
    from tasks.ppo.roles import PolicyWorker

    store, data, sft, model = sft_adapter
    tok = load_tokenizer(model, str(store.fetch(data.key) / "tokenizer"))
    prompts = [r["prompt_ids"] for r in read_jsonl(store.fetch(data.key) / "prompts_eval.jsonl")][:6]
    env = {"env_vars": {"TRITON_INTERPRET": "1"}} if DEVICE == "cpu" else {}
    workers = []
    try:
        for attention in ("triton", "sdpa"):
            w = ray.remote(PolicyWorker).options(num_cpus=1, num_gpus=0.25 if DEVICE == "cuda" else 0, runtime_env=env).remote(
                "actor", 0, 1, "ddp", 42, 1.0, DEVICE)
            workers.append(w)
            ray.get(w.init_group.remote(*ray.get(w.rendezvous.remote())))
            ppo = PPOConfig(rollout_batch_size=6, train_batch_size=6, max_new_tokens=8, fast_generate="on", decode_attention=attention,
                            decode_linear={"triton": "triton", "sdpa": "cublas"}[attention])
            ray.get(w.load.remote(model, store, sft.key, data.key, ppo, tok.pad_token_id, [tok.eos_token_id]))
        for kw in (dict(greedy=True), dict(seed=7)):
            triton, sdpa = ray.get([w.generate.remote(prompts, 1, **kw) for w in workers])
            assert torch.equal(triton.sequences, sdpa.sequences) and torch.equal(triton.action_mask, sdpa.action_mask), kw
        # the generator is built at the first rollout
        assert [(i["attention"], i["linear"]) for i in ray.get([w.rollout_info.remote() for w in workers])] == [
            ("triton", "triton"), ("sdpa", "cublas")]
    finally:
        for w in workers:
            ray.kill(w)


def test_one_token_prompts_after_a_longer_rollout_see_only_their_own_column():
    """Prompts of one column (P = 1) prefill a single token per row, which must attend to that
    column alone, not to the K/V that an earlier, longer rollout left in the rest of the cache."""
    model = tiny("llama", seed=3)
    fg = FastGenerator(model, max_batch=4, max_len=32)
    ids, mask = left_padded()
    fast(fg, ids, mask, eos=-1, greedy=True)  # fills the cache's columns with this rollout's K/V
    one, one_mask = ids[:, -1:], torch.ones((len(ids), 1), dtype=torch.long, device=DEVICE)
    got = fast(fg, one, one_mask, eos=-1, greedy=True)
    want = plain(model, one, one_mask, eos=-1, greedy=True)
    assert torch.equal(got.sequences, want.sequences)
