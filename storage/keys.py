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

from storage.store import ArtifactRef


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    return obj


@functools.cache
def code_version(*packages: str) -> str:
    """sha256 over the source files of the given packages (e.g. 'tasks.sft', 'tasks.common')."""
    import importlib

    h = hashlib.sha256()
    for name in sorted(packages):
        mod = importlib.import_module(name)
        root = Path(mod.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def stage_key(stage: str, config: Mapping[str, Any], inputs: Mapping[str, ArtifactRef], code: str) -> str:
    """``<stage>/<fingerprint>`` from the stage's config (jsonable), inputs and code version."""
    payload = {
        "stage": stage,
        "config": {k: _jsonable(v) for k, v in config.items()},
        "inputs": {name: ref.content_hash for name, ref in sorted(inputs.items())},
        "code": code,
    }
    raw = json.dumps(payload, sort_keys=True, default=str).encode()
    return f"{stage}/{hashlib.sha256(raw).hexdigest()[:20]}"
