"""Content-derived artifact keys: the same config, code and input contents give the same key.

The key of a stage's output is ``<stage>/<fingerprint>`` where the fingerprint hashes the stage's
own config, its code version and the *content hashes* of its inputs (never their URIs or a run
id). So an unchanged stage finds its artifact again in a new run, and a change upstream gives
every stage downstream a new key. The flow computes each key once and Prefect's cache key is it.

A stage's code version is derived, not listed (STYLE 15): ``code_version('tasks.sft.train')``
hashes the source of every project module that module imports, transitively, found by reading
the import statements (also those inside functions) -- so an edit to ``tasks/data/dataset.py``
re-keys SFT, RM and PPO, and an edit to ``flows/cli.py``, ``bench/`` or ``tests/`` re-keys none.
Third-party code is not walked; the versions of the libraries that decide an artifact's numbers
(``KEY_LIBRARIES``) are part of every key instead, so an upgrade of torch rebuilds rather than
reuses bytes the new version would not produce (the same key builds the same bytes). Other
libraries' versions are recorded in each manifest (``storage.store.library_versions``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel

from storage.store import ArtifactRef, _check_key, to_jsonable

ROOT = Path(__file__).resolve().parents[1]  # the project: top-level packages tasks/, storage/, flows/
# Libraries whose version changes what a stage computes (kernels, tokenization, LoRA, weight files).
KEY_LIBRARIES = ("torch", "transformers", "tokenizers", "peft", "safetensors")


PROJECT_PACKAGES = ("flows", "storage", "tasks")


@functools.cache
def _package_root(top: str) -> Path:
    """The folder holding top-level package ``top`` as this process imports it: ROOT in a checkout;
    on a Ray cluster's node each package is its own ``py_modules`` folder (flows/runtime.py)."""
    import importlib.util

    spec = importlib.util.find_spec(top) if top in PROJECT_PACKAGES else None
    return Path(spec.submodule_search_locations[0]).parent if spec and spec.submodule_search_locations else ROOT


def _module_file(name: str, root: Path | None) -> Path | None:
    base = (root or _package_root(name.split(".")[0])).joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _imported_names(path: Path, name: str) -> set[str]:
    """Every module name an ``import`` in this file may load (a ``from a import b`` may name module a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in [*up, base] if p)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def import_closure(module: str, root: Path | None = None) -> dict[str, Path]:
    """Module name -> file of every project module that importing (and running) ``module`` loads:
    its imports, transitively, with the packages' ``__init__.py`` files on the way. ``root``: a
    tree to read instead of the packages this process imports (tests edit copies)."""
    found: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            sub = ".".join(parts[:i])
            if sub in found or (path := _module_file(sub, root)) is None:
                continue
            found[sub] = path
            todo.extend(_imported_names(path, sub))
    if module not in found:
        raise ValueError(f"code_version({module!r}): no module {module} under {root or ROOT}; name a project module, e.g. 'tasks.sft.train'")
    return dict(sorted(found.items()))


def key_library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in KEY_LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


@functools.cache
def code_version(module: str, root: Path | None = None) -> str:
    """sha256 over the source of ``module``'s project import closure and ``KEY_LIBRARIES``' versions."""
    h = hashlib.sha256()
    for name, path in import_closure(module, root).items():
        h.update(f"{name}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    h.update(json.dumps(key_library_versions(), sort_keys=True).encode())
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
