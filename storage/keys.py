"""Content-derived artifact keys: the same config, code and input contents give the same key.

The key of a stage's output is ``<stage>/<fingerprint>`` where the fingerprint hashes the stage's
own config, its code version and the *content hashes* of its inputs (never their URIs or a run
id). So an unchanged stage finds its artifact again in a new run, and a change upstream gives
every stage downstream a new key. Prefect's cache policy uses the same fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel

from storage.store import ArtifactRef, _check_key, to_jsonable


@functools.cache
def code_version(*packages: str) -> str:
    """sha256 over the source of the given packages or modules (e.g. 'tasks.sft', 'tasks.common').

    A package counts all its ``*.py`` files; a plain module only its own file (not its siblings).
    """
    import importlib

    h = hashlib.sha256()
    for name in sorted(packages):
        mod = importlib.import_module(name)
        if getattr(mod, "__file__", None) is None:
            raise ValueError(f"code_version({name!r}): {name} has no source file (namespace package?); "
                             "add an __init__.py or name its modules")
        h.update(f"{name}\0".encode())
        file = Path(mod.__file__)
        if hasattr(mod, "__path__"):
            sources = [(p.relative_to(file.parent).as_posix(), p) for p in sorted(file.parent.rglob("*.py"))]
        else:
            sources = [(file.name, file)]
        for rel, path in sources:
            h.update(f"{rel}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def stage_key(stage: str, config: Mapping[str, Any] | BaseModel, inputs: Mapping[str, ArtifactRef], code: str) -> str:
    """``<stage>/<fingerprint>`` from the stage's config (jsonable), inputs and code version."""
    if "/" in stage:
        raise ValueError(f"stage_key: stage {stage!r} must be one key part (no '/'), e.g. 'sft'")
    _check_key(stage)
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    payload = {
        "stage": stage,
        "config": dict(config),
        "inputs": {name: ref.content_hash for name, ref in sorted(inputs.items())},
        "code": code,
    }
    raw = json.dumps(payload, sort_keys=True, default=to_jsonable).encode()
    return f"{stage}/{hashlib.sha256(raw).hexdigest()[:20]}"
