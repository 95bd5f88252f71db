"""Using the result: `rlhf export` (merged model and adapter), `rlhf generate`, `rlhf ls`, on a
store with two real (short) SFT runs of the built-in task."""

from __future__ import annotations

import json

import pytest
import torch

from flows.cli import main
from flows.use import find_artifact
from storage.store import ArtifactStore
from tasks.common.model import ModelConfig, load_causal_lm
from tasks.data.config import DataConfig
from tasks.data.prepare import prepare_data
from tasks.sft.config import SFTConfig
from tasks.sft.train import train_sft

MODEL = ModelConfig()
PROMPT = "Human: Describe the river.\nAssistant:"


@pytest.fixture(scope="module")
def runs(rlhf_cache, tmp_path_factory):
    """(store uri, data ref, [older sft ref, newer sft ref]): two SFT runs (seeds 0 and 1)."""
    uri = "file://" + str(tmp_path_factory.mktemp("export-store"))
    store = ArtifactStore(uri)
    data = prepare_data(DataConfig(), MODEL, store, seed=0)
    cfg = SFTConfig(max_steps=12, eval_every=6)
    return uri, data, [train_sft(cfg, MODEL, store, data, seed=s) for s in (0, 1)]


def _greedy(model, tok) -> list[int]:
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_export_merged_and_adapter_generate_the_adapters_tokens(runs, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    uri, _, (_, newest) = runs
    store = ArtifactStore(uri)
    assert main(["export", "--stage", "sft", "--out", str(tmp_path / "merged"), "--set", f"store.uri={uri}"]) == 0
    assert main(["export", "--stage", "sft", "--run", newest.key.rsplit("/", 1)[-1][:8], "--adapter-only",
                 "--out", str(tmp_path / "adapter"), "--set", f"store.uri={uri}"]) == 0
    assert str(tmp_path / "merged") in capsys.readouterr().out

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    reference = PeftModel.from_pretrained(load_causal_lm(MODEL), str(store.fetch(newest.key) / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()  # plain transformers, no PEFT
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter = PeftModel.from_pretrained(load_causal_lm(MODEL), str(tmp_path / "adapter")).eval()
    tokens = _greedy(reference, tok)
    assert len(tokens) > 0 and _greedy(merged, tok) == tokens and _greedy(adapter, tok) == tokens
    gen = GenerationConfig.from_pretrained(str(tmp_path / "merged"))
    assert tok.eos_token_id in ([gen.eos_token_id] if isinstance(gen.eos_token_id, int) else gen.eos_token_id)
    assert gen.pad_token_id == tok.pad_token_id
    assert json.loads((tmp_path / "merged" / "rlhf_source.json").read_text())["artifact"] == store.uri_of(newest.key)


def test_ls_lists_both_runs_with_lineage_and_generate_samples(runs, capsys):
    uri, data, refs = runs
    assert main(["ls", "--set", f"store.uri={uri}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3, lines  # the dataset and two SFT runs; no partial checkpoints
    short = lambda ref: ref.key.rsplit("/", 1)[-1][:12]  # noqa: E731
    assert " data " in lines[0] and short(data) in lines[0]
    for line, ref in zip(lines[1:], refs):
        assert f" sft  {short(ref)}  inputs: data={short(data)}  sft/eval_loss_start=" in line and "sft/eval_loss=" in line
    assert find_artifact(ArtifactStore(uri), "sft") == refs[1].key  # latest is the newer run

    assert main(["generate", "--stage", "sft", "--greedy", "--max-new-tokens", "8", "--set", f"store.uri={uri}", PROMPT]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"### {PROMPT}\n") and len(out.split("\n", 2)[1].strip()) > 0


def test_bad_stage_run_and_out_exit_2_with_the_fix(runs, tmp_path, capsys):
    uri = runs[0]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for argv, message in ((["export", "--stage", "ppo", "--out", str(tmp_path / "o")], "holds no ppo_actor artifact; run the pipeline"),
                          (["export", "--stage", "sft", "--run", "zzzz", "--out", str(tmp_path / "o")], "--run 'zzzz' matches 0 sft artifacts"),
                          (["export", "--stage", "sft", "--out", str(tmp_path / "full")], "exists and is not empty: give a new folder")):
        assert main([*argv, "--set", f"store.uri={uri}"]) == 2
        assert message in capsys.readouterr().err
