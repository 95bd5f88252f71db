"""SFT: the tiny model really trains on the built-in task (data from the real prepare_data)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from storage.store import ArtifactStore
from tasks.common.model import ModelConfig, load_causal_lm
from tasks.data.config import DataConfig
from tasks.data.dataset import read_jsonl
from tasks.data.prepare import prepare_data
from tasks.common import loop
from tasks.common.tracking import read_scalars
from tasks.sft import train as sft_train
from tasks.sft.config import SFTConfig
from tasks.common.lora import AUTO_TARGETS, resolve_target_modules
from tasks.sft.loss import causal_lm_loss
from tasks.sft.train import evaluate, partial_key, sft_key, train_sft

MODEL = ModelConfig()


@pytest.fixture(scope="module")
def store(rlhf_cache, tmp_path_factory) -> ArtifactStore:
    # file://, not memory://: the 2-worker test's Ray actors must reach the same store.
    return ArtifactStore("file://" + str(tmp_path_factory.mktemp("sft-store")))


@pytest.fixture(scope="module")
def data(store):
    return prepare_data(DataConfig(), MODEL, store, seed=0)


@pytest.fixture(scope="module")
def trained(store, data):
    """The default SFTConfig on the built-in task: (ref, manifest, local folder)."""
    ref = train_sft(SFTConfig(), MODEL, store, data, seed=0)
    return ref, store.manifest(ref.key), store.fetch(ref.key)


def _adapter(path):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_causal_lm(MODEL), str(path / "adapter")).eval()


# -- the loss ----------------------------------------------------------------------------------
def test_causal_lm_loss_hand_computed_and_masking():
    V = 5
    labels = torch.tensor([[-100, 2, 3, -100]])
    logits = torch.zeros(1, 4, V)
    assert causal_lm_loss(logits, labels).loss.item() == pytest.approx(math.log(V))  # uniform
    logits[0, 0, 2] = 2.0  # position 0 predicts label 1 (= 2)
    out = causal_lm_loss(logits, labels)
    expected = ((-2.0 + math.log(math.exp(2) + V - 1)) + math.log(V)) / 2
    assert out.loss.item() == pytest.approx(expected) and out.n_tokens.item() == 2
    assert out.nll_sum.item() == pytest.approx(2 * expected)
    moved = logits.clone()
    moved[0, 2:] = torch.randn(2, V)  # predict masked label 3 / nothing: must not count
    assert causal_lm_loss(moved, labels).loss.item() == pytest.approx(expected)
    assert causal_lm_loss(logits, torch.full_like(labels, -100)).loss.item() == 0.0  # not NaN


# -- data order, DistributedSampler-style --------------------------------------------------------
def test_epoch_batches_partition_and_determinism():
    n, bs = 103, 8
    ranks = [loop.epoch_batches(n, bs, seed=3, epoch=1, rank=r, world=2) for r in range(2)]
    flat = [[i for b in rb for i in b] for rb in ranks]
    assert len(ranks[0]) == len(ranks[1]) == (n // 2) // bs
    assert not set(flat[0]) & set(flat[1])
    assert ranks[0] == loop.epoch_batches(n, bs, seed=3, epoch=1, rank=0, world=2)
    assert ranks[0] != loop.epoch_batches(n, bs, seed=3, epoch=2, rank=0, world=2)
    assert loop.steps_per_epoch(n, bs, 2, 2) == 3


# -- target modules, checked before any model loads ---------------------------------------------
def test_auto_targets_per_architecture():
    from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, OPTConfig

    cases = [(GPT2Config(n_layer=1, n_embd=32, n_head=2), "gpt2"),
             (OPTConfig(num_hidden_layers=1, hidden_size=32, ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=32), "opt"),
             (BloomConfig(n_layer=1, hidden_size=32, n_head=2), "bloom")]
    for config, family in cases:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        assert resolve_target_modules("auto", skeleton) == AUTO_TARGETS[family]
    from tasks.common.lora import model_skeleton

    llama = model_skeleton(MODEL)
    assert resolve_target_modules("auto", llama) == AUTO_TARGETS["llama"]
    assert resolve_target_modules("auto", llama, builtin=True)[-1] == "lm_head"


def test_missing_target_modules_fail_before_the_model_loads(store, data, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(sft_train, "load_causal_lm", no_loading)
    with pytest.raises(ValueError, match=r"sft.target_modules.*\['c_attn'\] not found.*'down_proj'.*'q_proj'"):
        train_sft(SFTConfig(target_modules=["q_proj", "c_attn"]), MODEL, store, data, seed=0)
    with pytest.raises(ValueError, match=r"sft.batch_size \(4096\)"):
        train_sft(SFTConfig(batch_size=4096), MODEL, store, data, seed=0)
    with pytest.raises(ValueError, match="memory://.*file:// or s3://"):
        train_sft(SFTConfig(num_workers=2), MODEL, ArtifactStore("memory://sft-ddp"), data, seed=0)


# -- training with the defaults -----------------------------------------------------------------
def test_default_sft_learns(trained):
    ref, manifest, path = trained
    m = manifest["metrics"]
    assert ref.kind == "sft_adapter"
    assert m["sft/eval_loss"] <= 0.7 * m["sft/eval_loss_start"], m
    assert m["sft/steps"] == 99 and m["sft/tokens_per_s"] > 0 and m["sft/train_loss"] < m["sft/eval_loss_start"]
    losses = [loss for _, loss in m["sft/eval_history"]]
    assert losses == sorted(losses, reverse=True)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "trainer_state.pt",
            "tokenizer/tokenizer.json"} <= set(manifest["files"])
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    assert state["step"] == 99 and "optimizer" in state and "scheduler" in state and len(state["rng"]) == 1


def test_tensorboard_events_in_the_artifact_hold_the_run(trained):
    """tensorboard/ of the artifact, read with TensorBoard's own reader: the eval curve is the
    manifest's eval history, and every step has its loss, lr, grad norm and tokens/s."""
    _, manifest, path = trained
    m = manifest["metrics"]
    tb = read_scalars(path / "tensorboard")
    assert any(f.startswith("tensorboard/events.out.tfevents.") for f in manifest["files"])
    expected = [(0, m["sft/eval_loss_start"])] + [(s, v) for s, v in m["sft/eval_history"]]
    assert [s for s, _ in tb["sft/eval_loss"]] == [s for s, _ in expected]
    assert [v for _, v in tb["sft/eval_loss"]] == pytest.approx([v for _, v in expected], rel=1e-6)  # float32 in events
    for tag in ("sft/loss", "sft/lr", "sft/grad_norm", "sft/tokens_per_s"):
        assert [s for s, _ in tb[tag]] == list(range(1, m["sft/steps"] + 1)), tag
    assert max(v for _, v in tb["sft/lr"]) == pytest.approx(SFTConfig().lr, rel=1e-5)


def test_lora_moved_and_base_frozen(trained):
    _, _, path = trained
    model = _adapter(path)
    base = load_file(f"{MODEL.path()}/model.safetensors")
    seen = 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            if "lora_B" in name:  # PEFT initialises B to zero
                assert p.abs().max() > 1e-3, name
            continue
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(p, base[key]), key
        seen += 1
    assert seen == len(base)


def test_saved_adapter_reproduces_the_trained_model(trained, store, data):
    ref, manifest, path = trained
    model = _adapter(path)
    evals = read_jsonl(store.fetch(data.key) / "sft_eval.jsonl")
    assert evaluate(model, evals, 0, 16, "cpu") == pytest.approx(manifest["metrics"]["sft/eval_loss"], abs=1e-6)
    # logits change where the adapter acts: not the base model's
    ids = torch.tensor([evals[0]["input_ids"]])
    with torch.no_grad(), model.disable_adapter():
        plain = model(input_ids=ids).logits
    assert not torch.allclose(model(input_ids=ids).logits, plain, atol=1e-3)
    assert train_sft(SFTConfig(), MODEL, store, data, seed=0) == ref  # cached: no work


def test_resume_equals_uninterrupted(store, data):
    cfg = SFTConfig(max_steps=20, eval_every=5)
    key = sft_key(cfg, MODEL, data, seed=1)
    whole = train_sft(cfg, MODEL, store, data, seed=1)
    expect = load_file(str(store.fetch(whole.key) / "adapter/adapter_model.safetensors"))
    expect_metrics = store.manifest(whole.key)["metrics"]
    store.delete(key)

    ckpt = train_sft(cfg, MODEL, store, data, seed=1, stop_after=8)
    assert ckpt.kind == "sft_checkpoint" and ckpt.key == partial_key(key) and not store.exists(key)
    assert torch.load(store.fetch(ckpt.key) / "trainer_state.pt", weights_only=True)["step"] == 8
    resumed = train_sft(cfg, MODEL, store, data, seed=1)
    got = load_file(str(store.fetch(resumed.key) / "adapter/adapter_model.safetensors"))
    m = store.manifest(resumed.key)["metrics"]
    assert m["sft/resumed_from_step"] == 8 and not store.exists(partial_key(key))
    assert got.keys() == expect.keys()
    for k in expect:
        torch.testing.assert_close(got[k], expect[k], atol=1e-6, rtol=1e-5)
    for k in ("sft/eval_loss", "sft/eval_loss_start", "sft/train_loss"):
        assert m[k] == pytest.approx(expect_metrics[k], abs=1e-6), k


def test_two_workers_ddp(ray_cluster, store, data):
    cfg = SFTConfig(num_workers=2, batch_size=8)
    ref = train_sft(cfg, MODEL, store, data, seed=0)
    m = store.manifest(ref.key)["metrics"]
    assert m["sft/ddp_weight_max_diff"] == 0.0  # both ranks hold identical weights at the end
    assert m["sft/eval_loss"] <= 0.7 * m["sft/eval_loss_start"], m
    assert store.manifest(ref.key)["config"]["world_size"] == 2
    state = torch.load(store.fetch(ref.key) / "trainer_state.pt", weights_only=True)
    assert len(state["rng"]) == 2
