"""Garbage in an artifact store: what ``rlhf gc`` would delete, and deleting it.

Two kinds, and nothing else:

- **Unreferenced data folders**: a ``data-*`` folder that the manifest of its key does not name
  (a republished key leaves the older one behind; a crashed publish leaves one with no manifest).
- **Checkpoints of finished runs**: the artifacts under ``<key>-ckpt/`` (PPO checkpoints and
  shards) and ``<key>-partial`` (SFT) once ``<key>`` itself is complete, when they were made
  before it.

Everything a manifest references stays. Safe beside a run writing to the store: a folder is
garbage only once its newest file is older than ``grace_s`` *and*, for a superseded folder, its
key's manifest is too (a reader that read the older manifest just before the republish may still
be fetching the folder); a checkpoint only once it is older than ``grace_s`` and than the final
artifact (a ``--refresh ppo`` run rewriting checkpoints keeps its new ones). Each deletion re-reads
the manifest first. ``grace_s`` must exceed the longest publish (an upload that paused longer
could lose its folder); the default is an hour.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime

from storage.store import DATA_PREFIX, MANIFEST, ArtifactStore

DEFAULT_GRACE_S = 3600.0
_FINISHED = (re.compile(r"^(?P<run>.+)-ckpt/.+$"), re.compile(r"^(?P<run>.+)-partial$"))


@dataclass(frozen=True)
class Garbage:
    path: str  # under the store root: '<key>/data-...' (a folder) or '<key>' (a whole checkpoint artifact)
    nbytes: int
    why: str


def _mtime(info: dict) -> float:
    t = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
    return t.timestamp() if isinstance(t, datetime) else float(t)


def _scan(store: ArtifactStore) -> tuple[dict[str, float], dict[tuple[str, str], list[float]]]:
    """(key -> its manifest's mtime, (key, data folder) -> [bytes, newest mtime]) from one listing."""
    root = store.root + "/"
    store.fs.invalidate_cache(store.root)
    if not store.fs.exists(store.root):
        return {}, {}
    manifests, folders = {}, {}
    for path, info in store.fs.find(store.root, detail=True).items():
        rel = path[path.index(root) + len(root):] if root in path else path
        parts = rel.split("/")
        i = next((n for n, p in enumerate(parts) if p.startswith(DATA_PREFIX)), None)
        if i is None:
            if parts[-1] == MANIFEST and len(parts) > 1:
                manifests["/".join(parts[:-1])] = _mtime(info)
            continue
        if i == 0:
            continue
        entry = folders.setdefault(("/".join(parts[:i]), parts[i]), [0, 0.0])
        entry[0] += int(info.get("size") or 0)
        entry[1] = max(entry[1], _mtime(info))
    return manifests, folders


def find_garbage(store: ArtifactStore, grace_s: float = DEFAULT_GRACE_S, now: float | None = None) -> list[Garbage]:
    """What ``collect`` would delete, as of ``now`` (default: the present)."""
    now = time.time() if now is None else now
    old = now - grace_s
    manifests, folders = _scan(store)
    named, created = {}, {}
    for key in manifests:
        try:
            m = store.manifest(key)
            named[key], created[key] = m["data"], datetime.fromisoformat(m["created_at"])
        except Exception:  # unreadable (ArtifactCorrupt, gone since the listing): keep all under it
            named[key] = None
    out = []
    finished = {}
    for key, m_time in manifests.items():
        for pat in _FINISHED:
            # made before the final artifact: its publish times to the microsecond (an object store's
            # listing times are whole seconds, so a checkpoint of a run still going could tie)
            if ((match := pat.match(key)) and key in created and created.get(match["run"]) is not None
                    and created[key] < created[match["run"]] and m_time < old):
                finished[key] = match["run"]
    for key, run in sorted(finished.items()):
        nbytes = sum(int(v[0]) for (k, _), v in folders.items() if k == key)
        out.append(Garbage(key, nbytes, f"checkpoint of the finished run {run}"))
    for (key, data), (nbytes, newest) in sorted(folders.items()):
        if key in finished or named.get(key, "") in (data, None) or newest >= old:
            continue
        if key in manifests and manifests[key] >= old:
            continue  # superseded only lately: a reader may still be fetching it
        why = f"not named by {key}/{MANIFEST}" if key in manifests else f"no {MANIFEST} at {key} (a publish that never finished)"
        out.append(Garbage(f"{key}/{data}", int(nbytes), why))
    return out


def collect(store: ArtifactStore, garbage: list[Garbage]) -> list[Garbage]:
    """Delete ``garbage`` (from ``find_garbage``), re-reading each manifest first; returns what went."""
    gone = []
    for g in garbage:
        key, _, data = g.path.partition(f"/{DATA_PREFIX}")
        if data:
            try:
                if store.manifest(key)["data"] == DATA_PREFIX + data:
                    continue  # a publish named it since the scan
            except FileNotFoundError:
                pass
            store.fs.rm(f"{store.root}/{g.path}", recursive=True)
        else:
            run = next(m["run"] for pat in _FINISHED if (m := pat.match(key)))
            if not store.exists(run):
                continue
            store.delete(key)
        gone.append(g)
    return gone
