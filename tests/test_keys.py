"""Stage keys: code versions derived from each stage's import closure, exactly.

Edits are made in a temporary copy of the tree (never the real files: others run tests from
them), and code versions are computed against that copy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from storage.keys import ROOT, code_version, import_closure
from storage.store import ArtifactRef

STAGES = {"data": "tasks.data.prepare", "sft": "tasks.sft.train", "rm": "tasks.rm.train", "ppo": "tasks.ppo.train"}
UNRELATED = ["flows/cli.py", "flows/rlhf.py", "flows/preflight.py", "deployments/deploy.py", "bench/common.py",
             "tests/conftest.py", "tests/test_keys.py"]


def versions(root: Path) -> dict[str, str]:
    return {stage: code_version.__wrapped__(module, root) for stage, module in STAGES.items()}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for top in ("tasks", "storage", "flows", "deployments", "bench", "tests"):
        shutil.copytree(ROOT / top, root / top, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_closures_hold_what_each_stage_runs():
    closure = {stage: set(import_closure(m)) for stage, m in STAGES.items()}
    # the collate functions every trainer uses; the critic's forward lives with the reward model
    for stage in ("sft", "rm", "ppo"):
        assert "tasks.data.dataset" in closure[stage], stage
    assert {"tasks.rm.model", "tasks.ppo.roles", "tasks.ppo.losses", "tasks.ppo.generation"} <= closure["ppo"]
    assert {"tasks.common.lora", "tasks.common.dist"} <= closure["rm"]  # LoRA helpers; DDP imported inside a function
    assert {"tasks.data.formats", "tasks.data.encode", "tasks.common.builtin"} <= closure["data"]
    assert not any(m.startswith(("flows", "tests", "bench")) for c in closure.values() for m in c)


@pytest.mark.parametrize("stage", list(STAGES))
def test_closure_covers_every_project_module_an_import_loads(stage):
    """What Python really loads (top-level imports) is inside the statically derived closure."""
    module = STAGES[stage]
    script = (f"import sys, {module}; "
              "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('tasks', 'storage', 'flows')))")
    loaded = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert module in loaded and set(loaded) <= set(import_closure(module)), set(loaded) - set(import_closure(module))


def test_an_edit_rekeys_exactly_the_stages_that_import_the_module(tree):
    base = versions(tree)
    assert base == {stage: code_version(m) for stage, m in STAGES.items()}  # the copy is the tree
    closures = {stage: {p.relative_to(tree).as_posix() for p in import_closure(m, tree).values()} for stage, m in STAGES.items()}
    files = sorted(p.relative_to(tree).as_posix() for top in ("tasks", "storage") for p in (tree / top).rglob("*.py"))
    for rel in [*files, *UNRELATED]:
        path = tree / rel
        original = path.read_bytes()
        path.write_bytes(original + b"\n_EDITED = 1\n")
        try:
            changed = {stage for stage, v in versions(tree).items() if v != base[stage]}
        finally:
            path.write_bytes(original)
        assert changed == {stage for stage in STAGES if rel in closures[stage]}, rel
        if rel in UNRELATED:
            assert changed == set(), rel
    assert versions(tree) == base


def test_a_new_import_joins_the_closure(tree):
    """Transitive and relative imports: SFT's loss importing PPO's losses makes them SFT's code."""
    loss, ppo_losses = tree / "tasks/sft/loss.py", tree / "tasks/ppo/losses.py"
    original, other = loss.read_bytes(), ppo_losses.read_bytes()
    base = versions(tree)
    try:
        loss.write_bytes(original + b"\nfrom ..ppo import losses as _ppo_losses  # noqa\n")
        assert "tasks.ppo.losses" in import_closure("tasks.sft.train", tree)
        with_import = versions(tree)
        ppo_losses.write_bytes(other + b"\n_EDITED = 1\n")
        after = versions(tree)
        assert after["sft"] != with_import["sft"] and after["ppo"] != with_import["ppo"]
        assert after["data"] == base["data"] and after["rm"] == base["rm"]
    finally:
        loss.write_bytes(original)
        ppo_losses.write_bytes(other)


def test_downstream_keys_follow_upstream_content():
    """A rebuilt upstream artifact with new bytes re-keys everything downstream of it."""
    from tasks.common.model import ModelConfig
    from tasks.ppo.config import PPOConfig
    from tasks.ppo.train import ppo_key
    from tasks.rm.config import RewardConfig
    from tasks.rm.train import rm_key
    from tasks.sft.config import SFTConfig
    from tasks.sft.train import sft_key

    parts = {"tokenizer": "t", "sft_train.jsonl": "a", "sft_eval.jsonl": "b", "pref_train.jsonl": "c", "pref_eval.jsonl": "d",
             "prompts_train.jsonl": "e", "prompts_eval.jsonl": "f", "ptx_train.jsonl": "g"}
    data = ArtifactRef(uri="memory://s/data/1", key="data/1", kind="dataset", content_hash="d1", parts=parts)
    sft = ArtifactRef(uri="memory://s/sft/1", key="sft/1", kind="sft_adapter", content_hash="s1")
    rm = ArtifactRef(uri="memory://s/rm/1", key="rm/1", kind="reward_model", content_hash="r1")
    m = ModelConfig()
    ppo = ppo_key(PPOConfig(), m, data, sft, rm, 1)
    assert ppo_key(PPOConfig(), m, data, sft.model_copy(update={"content_hash": "s2"}), rm, 1) != ppo
    assert ppo_key(PPOConfig(), m, data, sft, rm.model_copy(update={"content_hash": "r2"}), 1) != ppo
    new_sft_data = data.model_copy(update={"parts": {**parts, "sft_train.jsonl": "a2"}})
    assert sft_key(SFTConfig(), m, new_sft_data, 1) != sft_key(SFTConfig(), m, data, 1)
    assert rm_key(RewardConfig(), m, new_sft_data, 1) == rm_key(RewardConfig(), m, data, 1)  # RM reads no SFT split


def test_library_versions_are_in_the_key(tree, monkeypatch):
    import storage.keys as keys

    base = versions(tree)
    monkeypatch.setattr(keys, "key_library_versions", lambda: {**dict.fromkeys(keys.KEY_LIBRARIES, "0"), "torch": "9.9"})
    assert all(v != base[s] for s, v in versions(tree).items())
