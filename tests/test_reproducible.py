"""The same key builds the same bytes: data prep, SFT and the reward model run in two separate
processes (different PYTHONHASHSEED, as any two runs have) publish identical files at identical
keys. TensorBoard's event files are the exception by design (wall times in them and in their
names); PPO keys on the parts it reads, which leave them out (tasks/ppo/key.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage.store import ArtifactStore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
BUILD = """
import json, sys
from storage.store import ArtifactStore
from tasks.common.model import ModelConfig
from tasks.data.config import DataConfig
from tasks.data.prepare import prepare_data
from tasks.rm.config import RewardConfig
from tasks.rm.train import train_reward_model
from tasks.sft.config import SFTConfig
from tasks.sft.train import train_sft

store, model = ArtifactStore(sys.argv[1]), ModelConfig()
data = prepare_data(DataConfig(), model, store, seed=3)
sft = train_sft(SFTConfig(max_steps=6, eval_every=3), model, store, data, seed=3)
rm = train_reward_model(RewardConfig(max_steps=4), model, store, data, seed=3)
print(json.dumps({"data": data.key, "sft": sft.key, "rm": rm.key}))
"""


def _files(store: ArtifactStore, key: str) -> dict[str, bytes]:
    root = store.fetch(key, verify=False)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.relative_to(root).as_posix().startswith("tensorboard/")}


def test_two_processes_build_bit_identical_data_sft_and_rm(rlhf_cache, tmp_path):
    stores = [f"file://{tmp_path / f'store{i}'}" for i in (1, 2)]
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, uri], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": str(i)})
             for i, uri in enumerate(stores, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    keys = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert keys[0] == keys[1], keys
    a, b = (ArtifactStore(u) for u in stores)
    for stage, key in keys[0].items():
        fa, fb = _files(a, key), _files(b, key)
        assert fa.keys() == fb.keys(), (stage, sorted(fa.keys() ^ fb.keys()))
        differ = sorted(n for n in fa if fa[n] != fb[n])
        assert not differ, f"{stage}: {differ} differ between the two builds"
        assert any(n.endswith((".safetensors", ".jsonl")) for n in fa), sorted(fa)
