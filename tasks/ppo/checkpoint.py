"""PPO checkpoints and the final artifact, as artifacts of the store.

A checkpoint at ``<key>-ckpt/iter-<it:06d>`` (kind ``ppo_checkpoint``) holds everything the run
needs to continue at exactly that iteration:

    actor/weights.safetensors   trainable (LoRA) weights, full, keyed by parameter name
    actor/optimizer.pt          optimizer state (full; torch.save, loads with weights_only=True)
    actor/rng-rank<r>.pt        each rank's torch / python / sampling RNG states
    critic/...                  the same for the critic (its trainable weights: all, or the LoRA adapter and the value head)
    driver.json                 iteration, prompt-sampler position, KL controller, metrics so far

Workers hand their state to the driver, which writes and publishes (so it works when the
workers are on other nodes); the manifest is written last, so only complete checkpoints count.
The final artifact at ``<key>`` (kind ``ppo_actor``): ``adapter/`` (PeftModel.from_pretrained on
the base), ``tokenizer/``, ``metrics.jsonl`` (one record per iteration and per evaluation).
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from storage.store import ArtifactRef, ArtifactStore

LEARNERS = ("actor", "critic")


def checkpoint_prefix(key: str) -> str:
    return f"{key}-ckpt"


def latest_checkpoint(store: ArtifactStore, key: str) -> str | None:
    """Key of the newest complete checkpoint of the run at ``key`` (None: start fresh)."""
    keys = [k for k in store.list(checkpoint_prefix(key)) if k.rsplit("/", 1)[-1].startswith("iter-")]
    return max(keys, key=lambda k: int(k.rsplit("-", 1)[-1])) if keys else None


def _save_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    # clone: safetensors refuses tensors that share storage (tied weights)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path))


def _torch_save(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(buf.getvalue())


def save_checkpoint(store: ArtifactStore, key: str, iteration: int, states: Mapping[str, list[dict]],
                    driver: dict, config: dict, inputs: Mapping[str, ArtifactRef]) -> ArtifactRef:
    """``states``: role -> each rank's ``worker.state()`` (rank 0 carries weights + optimizer)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-ppo-ckpt-") as tmp:
        out = Path(tmp)
        for role in LEARNERS:
            d = out / role
            d.mkdir()
            ranks = states[role]
            _save_tensors(d / "weights.safetensors", ranks[0]["weights"])
            _torch_save(d / "optimizer.pt", ranks[0]["optim"])
            for r, s in enumerate(ranks):
                _torch_save(d / f"rng-rank{r}.pt", s["rng"])
        (out / "driver.json").write_text(json.dumps({**driver, "iteration": iteration}, indent=1))
        return store.publish(f"{checkpoint_prefix(key)}/iter-{iteration:06d}", out, kind="ppo_checkpoint",
                             config=config, inputs=inputs, metrics=driver["history"][-1] if driver["history"] else {},
                             extra={"iteration": iteration, "run_key": key})


def load_checkpoint(store: ArtifactStore, ckpt_key: str, num_workers: Mapping[str, int]) -> tuple[dict, dict]:
    """(role -> per-rank kwargs for ``worker.load_state``, driver state)."""
    from safetensors.torch import load_file

    path = store.fetch(ckpt_key)
    states = {}
    for role in LEARNERS:
        d = path / role
        weights = load_file(str(d / "weights.safetensors"))
        optim = torch.load(d / "optimizer.pt", weights_only=True)
        n = len(list(d.glob("rng-rank*.pt")))
        if n != num_workers[role]:
            raise ValueError(f"checkpoint {ckpt_key}: {role} has {n} ranks but ppo.{role}.num_workers is {num_workers[role]}")
        states[role] = [{"weights": weights, "optim": optim, "rng": torch.load(d / f"rng-rank{r}.pt", weights_only=True)}
                        for r in range(n)]
    return states, json.loads((path / "driver.json").read_text())


def publish_final(store: ArtifactStore, key: str, adapter_files: Mapping[str, bytes], tokenizer_dir: Path,
                  history: list[dict], summary: dict, config: dict, inputs: Mapping[str, ArtifactRef]) -> ArtifactRef:
    with tempfile.TemporaryDirectory(prefix="rlhf-ppo-final-") as tmp:
        out = Path(tmp)
        (out / "adapter").mkdir()
        for name, data in adapter_files.items():
            (out / "adapter" / name).write_bytes(data)
        shutil.copytree(tokenizer_dir, out / "tokenizer")
        with open(out / "metrics.jsonl", "w") as f:
            for rec in history:
                f.write(json.dumps(rec) + "\n")
        return store.publish(key, out, kind="ppo_actor", config=config, inputs=inputs, metrics=summary)
