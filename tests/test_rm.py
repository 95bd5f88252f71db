"""Reward model: pairwise loss math, scoring at the last real token, training on the built-in task."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from storage.store import ArtifactStore
from tasks.common.model import ModelConfig
from tasks.data.config import DataConfig
from tasks.data.dataset import pad_batch, read_jsonl
from tasks.data.prepare import prepare_data
from tasks.common.tracking import read_scalars
from tasks.rm import train as rm_train
from tasks.rm.config import RewardConfig
from tasks.rm.loss import pairwise_loss
from tasks.rm.model import build_reward_model, last_token_index, load_reward_model
from tasks.rm.train import evaluate_rm, train_reward_model

MODEL = ModelConfig()


@pytest.fixture(scope="module")
def store(rlhf_cache) -> ArtifactStore:
    return ArtifactStore("memory://rm-tests")


@pytest.fixture(scope="module")
def data(store):
    return prepare_data(DataConfig(), MODEL, store, seed=0)


@pytest.fixture(scope="module")
def pad_id(store, data):
    from tasks.common.model import load_tokenizer

    return load_tokenizer(MODEL, str(store.fetch(data.key) / "tokenizer")).pad_token_id


# -- the loss ----------------------------------------------------------------------------------
def test_pairwise_loss_hand_computed():
    out = pairwise_loss(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 1.0]))
    assert out.loss.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(-1))) / 2)
    assert out.accuracy.item() == 0.5 and out.margin_mean.item() == pytest.approx(0.5)  # a tie is not correct
    m = pairwise_loss(torch.tensor([3.0]), torch.tensor([1.0]), margin=2.0)
    assert m.loss.item() == pytest.approx(math.log(2)) and m.accuracy.item() == 1.0


def test_pairwise_loss_invariants():
    g = torch.Generator().manual_seed(0)
    r_c, r_r = torch.randn(64, generator=g), torch.randn(64, generator=g)
    a, b = pairwise_loss(r_c, r_r), pairwise_loss(r_r, r_c)
    assert a.accuracy + b.accuracy == pytest.approx(1.0) and a.margin_mean == pytest.approx(-b.margin_mean)
    assert pairwise_loss(r_c + 5, r_r + 5).loss == pytest.approx(a.loss.item())  # shift-invariant
    assert pairwise_loss(r_c, r_r, margin=1.0).loss > a.loss  # a margin asks for more
    big = pairwise_loss(torch.tensor([1e4, -1e4]), torch.tensor([0.0, 0.0]))
    assert torch.isfinite(big.loss) and big.loss.item() == pytest.approx(1e4 / 2)
    r = r_c.clone().requires_grad_(True)
    pairwise_loss(r, r_r).loss.backward()  # d/dr_c = -sigmoid(r_r - r_c) / B
    torch.testing.assert_close(r.grad, -torch.sigmoid(r_r - r_c) / 64)
    torch.testing.assert_close(a.loss, -F.logsigmoid(r_c - r_r).mean())


# -- where the score is read -------------------------------------------------------------------
def test_last_token_index_any_padding_side():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 4, 2]


def test_score_at_last_non_pad_token(store, data, pad_id, rlhf_cache):
    torch.manual_seed(0)
    rm = build_reward_model(MODEL).eval()
    seqs = [r["chosen_ids"] for r in read_jsonl(store.fetch(data.key) / "pref_eval.jsonl")[:4]]
    with torch.no_grad():
        ids, mask = pad_batch(seqs, pad_id)
        base = rm(ids, mask)
        padded_ids = torch.cat([ids, torch.full((4, 7), pad_id)], 1)
        padded_mask = torch.cat([mask, torch.zeros(4, 7, dtype=mask.dtype)], 1)
        torch.testing.assert_close(rm(padded_ids, padded_mask), base, atol=1e-5, rtol=1e-5)
        left_ids, left_mask = pad_batch(seqs, pad_id, side="left")
        torch.testing.assert_close(rm(left_ids, left_mask), base, atol=1e-5, rtol=1e-5)
        junk = padded_ids.masked_fill(padded_mask == 0, 7)  # whatever sits under the mask is ignored
        torch.testing.assert_close(rm(junk, padded_mask), base, atol=1e-5, rtol=1e-5)
        last = last_token_index(mask)
        values = rm.values(ids, mask)
        assert values.shape == ids.shape
        torch.testing.assert_close(values[torch.arange(4), last], base)
        changed = ids.clone()
        changed[0, last[0]] = (changed[0, last[0]] + 1) % 400
        assert not torch.isclose(rm(changed, mask)[0], base[0])
    with pytest.raises(ValueError, match="all padding"):
        rm(ids, torch.cat([mask[:3], torch.zeros_like(mask[:1])]))


# -- training ----------------------------------------------------------------------------------
def test_default_reward_model_learns_and_loads(store, data, pad_id):
    ref = train_reward_model(RewardConfig(), MODEL, store, data, seed=0)
    manifest = store.manifest(ref.key)
    m = manifest["metrics"]
    assert ref.kind == "reward_model"
    assert m["rm/eval_accuracy"] >= 0.9 and m["rm/eval_margin"] > 0 and m["rm/train_loss"] < math.log(2), m
    assert m["rm/eval_accuracy_start"] < 0.8
    assert {"model.safetensors", "config.json", "tokenizer/tokenizer.json"} <= set(manifest["files"])
    rm = load_reward_model(store.fetch(ref.key)).eval()  # one call, from the folder alone
    evals = read_jsonl(store.fetch(data.key) / "pref_eval.jsonl")
    acc, margin = evaluate_rm(rm, evals, pad_id, 16, "cpu")
    assert acc == pytest.approx(m["rm/eval_accuracy"]) and margin == pytest.approx(m["rm/eval_margin"], abs=1e-4)
    assert train_reward_model(RewardConfig(), MODEL, store, data, seed=0) == ref  # cached
    tb = read_scalars(store.fetch(ref.key) / "tensorboard")  # the artifact's event files, TensorBoard's reader
    expected = [(0, m["rm/eval_accuracy_start"])] + [(s, a) for s, a, _ in m["rm/eval_history"]]
    assert [s for s, _ in tb["rm/eval_accuracy"]] == [s for s, _ in expected]
    assert [v for _, v in tb["rm/eval_accuracy"]] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [s for s, _ in tb["rm/loss"]] == list(range(1, m["rm/steps"] + 1)) and len(tb["rm/grad_norm"]) == m["rm/steps"]


def test_lora_reward_model_merges_into_a_plain_state_dict(store, data, pad_id):
    from safetensors.torch import load_file

    cfg = RewardConfig(lora_rank=8, lr=5e-3, max_epochs=1)
    ref = train_reward_model(cfg, MODEL, store, data, seed=0)
    m = store.manifest(ref.key)["metrics"]
    path = store.fetch(ref.key)
    state = load_file(str(path / "model.safetensors"))
    assert not any("lora" in k for k in state) and "head.weight" in state
    base = load_file(f"{MODEL.path()}/model.safetensors")
    assert not torch.equal(state["body.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    torch.testing.assert_close(state["body.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not a target
    acc, _ = evaluate_rm(load_reward_model(path).eval(), read_jsonl(store.fetch(data.key) / "pref_eval.jsonl"), pad_id, 16, "cpu")
    assert acc == pytest.approx(m["rm/eval_accuracy"]) and acc >= 0.9, m


def test_bad_config_fails_before_the_model_loads(store, data, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(rm_train, "build_reward_model", no_loading)
    with pytest.raises(ValueError, match=r"rm.target_modules.*\['query'\] not found.*'v_proj'"):
        train_reward_model(RewardConfig(lora_rank=4, target_modules=["query"]), MODEL, store, data, seed=0)
    with pytest.raises(ValueError, match="kind 'dataset'"):
        train_reward_model(RewardConfig(), MODEL, store, data.model_copy(update={"kind": "sft_adapter"}), seed=0)
