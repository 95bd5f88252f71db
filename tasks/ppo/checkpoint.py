"""PPO checkpoints and the final artifact, as artifacts of the store.

A checkpoint at ``<key>-ckpt/iter-<it:06d>`` (kind ``ppo_checkpoint``) holds everything the run
needs to continue at exactly that iteration. Each learner rank writes its own shard straight to
the store, at ``<key>-ckpt/shards-<it:06d>/<role>-rank<r>`` (kind ``ppo_checkpoint_shard``):

    weights.safetensors   rank 0: the trainable weights (LoRA, value head; all of a full critic), full, by name
    optimizer.pt          rank 0: the optimizer state (full; torch.save, loads with weights_only=True)
    rng.pt                every rank: its torch / python / sampling RNG states

Nothing of it travels through the driver, which only publishes the checkpoint itself: driver.json
(iteration, prompt-sampler position, KL controller, metrics so far) with the shards as its inputs
(their content hashes) and their keys in the manifest's ``shards``. That manifest is written last,
so only complete checkpoints count; a rank resuming fetches rank 0's shard and its own. Sharded
strategies (FSDP2, ColossalAI) gather the full state onto rank 0 inside the group first.
The final artifact at ``<key>`` (kind ``ppo_actor``): ``adapter/`` (PeftModel.from_pretrained on
the base), ``tokenizer/``, ``metrics.jsonl`` (one record per iteration and per evaluation).
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

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


def shard_key(key: str, iteration: int, role: str, rank: int) -> str:
    return f"{checkpoint_prefix(key)}/shards-{iteration:06d}/{role}-rank{rank}"


def write_shard(store: ArtifactStore, key: str, iteration: int, role: str, rank: int, weights: Mapping[str, torch.Tensor] | None,
                optim: dict | None, rng: dict) -> ArtifactRef:
    """One rank's shard of the checkpoint at ``iteration``, published by the rank itself."""
    with tempfile.TemporaryDirectory(prefix="rlhf-ppo-shard-") as tmp:
        out = Path(tmp)
        if weights is not None:
            _save_tensors(out / "weights.safetensors", weights)
            _torch_save(out / "optimizer.pt", optim)
        _torch_save(out / "rng.pt", rng)
        return store.publish(shard_key(key, iteration, role, rank), out, kind="ppo_checkpoint_shard",
                             extra={"iteration": iteration, "run_key": key, "role": role, "rank": rank})


def read_shard(store: ArtifactStore, full: ArtifactRef, mine: ArtifactRef) -> dict:
    """``worker.load_state`` kwargs from rank 0's shard (``full``: weights, optimizer) and this rank's (RNG)."""
    from safetensors.torch import load_file

    d = store.fetch(full)
    return {"weights": load_file(str(d / "weights.safetensors")), "optim": torch.load(d / "optimizer.pt", weights_only=True),
            "rng": torch.load(store.fetch(mine) / "rng.pt", weights_only=True)}


def save_checkpoint(store: ArtifactStore, key: str, iteration: int, shards: Mapping[str, list[dict]],
                    driver: dict, config: dict, inputs: Mapping[str, ArtifactRef]) -> ArtifactRef:
    """Publish the checkpoint at ``iteration`` over the ``shards`` the ranks wrote (role -> each
    rank's shard ref, as a dict): the one commit point."""
    refs = {role: [ArtifactRef.model_validate(r) for r in rs] for role, rs in shards.items()}
    with tempfile.TemporaryDirectory(prefix="rlhf-ppo-ckpt-") as tmp:
        out = Path(tmp)
        (out / "driver.json").write_text(json.dumps({**driver, "iteration": iteration}, indent=1))
        return store.publish(f"{checkpoint_prefix(key)}/iter-{iteration:06d}", out, kind="ppo_checkpoint", config=config,
                             inputs={**inputs, **{f"{role}-rank{r}": ref for role, rs in refs.items() for r, ref in enumerate(rs)}},
                             metrics=driver["history"][-1] if driver["history"] else {},
                             extra={"iteration": iteration, "run_key": key, "shards": {role: [x.key for x in rs] for role, rs in refs.items()}})


def load_checkpoint(store: ArtifactStore, ckpt_key: str, num_workers: Mapping[str, int]) -> tuple[dict, dict]:
    """(role -> each rank's shard ref, verified against the content the checkpoint recorded; driver state)."""
    manifest = store.manifest(ckpt_key)
    shards = {}
    for role in num_workers:  # the learners of the run (no critic with a critic-free estimator)
        keys = manifest["shards"][role]
        if len(keys) != num_workers[role]:
            raise ValueError(f"checkpoint {ckpt_key}: {role} has {len(keys)} ranks but ppo.{role}.num_workers is {num_workers[role]}")
        shards[role] = [store.ref(k).model_copy(update={"content_hash": manifest["inputs"][f"{role}-rank{r}"], "parts": {}})
                        for r, k in enumerate(keys)]
    return shards, json.loads((store.fetch(ckpt_key) / "driver.json").read_text())


def publish_final(store: ArtifactStore, key: str, adapter_files: Mapping[str, bytes], tokenizer_dir: Path,
                  history: list[dict], summary: dict, config: dict, inputs: Mapping[str, ArtifactRef],
                  add_files: Callable[[Path], None] | None = None) -> ArtifactRef:
    """``add_files(folder)`` may put more files into the artifact before it is published (TensorBoard's)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-ppo-final-") as tmp:
        out = Path(tmp)
        (out / "adapter").mkdir()
        for name, data in adapter_files.items():
            (out / "adapter" / name).write_bytes(data)
        shutil.copytree(tokenizer_dir, out / "tokenizer")
        with open(out / "metrics.jsonl", "w") as f:
            for rec in history:
                f.write(json.dumps(rec) + "\n")
        if add_files is not None:
            add_files(out)
        return store.publish(key, out, kind="ppo_actor", config=config, inputs=inputs, metrics=summary)
