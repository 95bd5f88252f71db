"""One small artifact store on fsspec: file://, memory://, s3:// (s3fs), gcs://, ...

An artifact is a directory of files under ``<root>/<key>/``. Publishing uploads the files into a
fresh ``data-<uuid>/`` folder and then writes ``MANIFEST.json`` last, in one put (an atomic
rename on local disks). A reader only trusts what a manifest names, so a half-written artifact
is never seen as complete, and two writers of the same key never mix their files: each
manifest points at a complete folder of its own.

The manifest describes the artifact (STYLE 6): the config that made it, the content hashes of
its inputs, a sha256 per file, library versions, metrics, and when it was made. Storage options
(endpoints, credentials) are never written into it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import fsspec
from pydantic import BaseModel

MANIFEST = "MANIFEST.json"
_LOCAL = {"file", "local"}


class ArtifactRef(BaseModel):
    """What stages pass to each other: where an artifact is and what it holds."""

    uri: str
    key: str
    kind: str
    content_hash: str


class ArtifactCorrupt(RuntimeError):
    """A file of a published artifact is missing or does not match its manifest hash."""


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def content_hash(files: Mapping[str, Mapping[str, Any]]) -> str:
    """Hash of an artifact's contents: its relative paths and their file hashes, in order."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]['sha256']}\n".encode())
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "peft", "ray", "prefect", "fsspec"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _check_key(key: str) -> str:
    parts = PurePosixPath(key).parts
    if not key or key.startswith("/") or any(p in ("..", ".", "") for p in parts) or "\\" in key:
        raise ValueError(
            f"artifact key {key!r} is not a relative path inside the store "
            "(no leading '/', no '..' or '.' parts): use keys like 'sft/3f2a9c'"
        )
    return "/".join(parts)


class ArtifactStore:
    """Artifacts under one root URI. ``storage_options`` go to fsspec (endpoint, profile, ...)."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None):
        if "://" not in uri:
            uri = "file://" + os.path.abspath(uri)
        scheme = uri.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(scheme)
        except (ValueError, ImportError) as e:
            raise ValueError(
                f"store.uri {uri!r}: unknown or unavailable fsspec protocol {scheme!r} ({e}); "
                "use file://, memory://, s3:// (s3fs) or another installed fsspec protocol"
            ) from None
        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **dict(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.local = bool(set(_protocols(self.fs)) & _LOCAL)
        if self.local:
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.uri!r})"

    # -- paths -----------------------------------------------------------------------------
    def _path(self, key: str, *rest: str) -> str:
        return "/".join([self.root, _check_key(key), *rest])

    def uri_of(self, key: str) -> str:
        return f"{self.uri}/{_check_key(key)}"

    # -- reading ---------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key, MANIFEST))

    def manifest(self, key: str) -> dict:
        path = self._path(key, MANIFEST)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no artifact at {self.uri_of(key)} (no {MANIFEST})") from None
        return json.loads(raw)

    def ref(self, key: str) -> ArtifactRef:
        m = self.manifest(key)
        return ArtifactRef(uri=self.uri_of(key), key=key, kind=m["kind"], content_hash=m["content_hash"])

    def list(self, prefix: str = "") -> list[str]:
        """Keys of complete artifacts under ``prefix``."""
        base = self._path(prefix) if prefix else self.root
        if not self.fs.exists(base):
            return []
        found = self.fs.glob(f"{base}/**/{MANIFEST}") + self.fs.glob(f"{base}/{MANIFEST}")
        root = self.root + "/"
        keys = {p[len(root):].rsplit("/", 1)[0] for p in (_strip(self.fs, f) for f in found) if p.startswith(root)}
        return sorted(keys)

    def verify(self, key: str) -> dict:
        """Re-hash every file in the store against the manifest; raises ArtifactCorrupt."""
        m = self.manifest(key)
        for rel, meta in m["files"].items():
            path = self._path(key, m["data"], rel)
            try:
                with self.fs.open(path, "rb") as f:
                    h = hashlib.sha256()
                    while block := f.read(1 << 20):
                        h.update(block)
            except FileNotFoundError:
                raise ArtifactCorrupt(f"{self.uri_of(key)}: file {rel} named in the manifest is missing") from None
            if h.hexdigest() != meta["sha256"]:
                raise ArtifactCorrupt(f"{self.uri_of(key)}: file {rel} does not match its manifest sha256")
        return m

    def fetch(self, key: str, cache_dir: str | Path | None = None, verify: bool = True) -> Path:
        """A local directory holding the artifact's files, checked against the manifest.

        Local stores return the published folder itself; remote ones download once into a
        cache keyed by content hash (``$RLHF_CACHE`` or ``~/.cache/rlhf``).
        """
        m = self.manifest(key)
        if self.local:
            if verify:
                self.verify(key)
            return Path(self._path(key, m["data"]))
        cache = Path(cache_dir or os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf")) / "artifacts"
        dest = cache / m["content_hash"]
        if (dest / ".complete").exists():
            return dest
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".partial-"))
        try:
            for rel, meta in m["files"].items():
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.fs.get_file(self._path(key, m["data"], rel), str(target))
                except FileNotFoundError:
                    raise ArtifactCorrupt(f"{self.uri_of(key)}: file {rel} named in the manifest is missing") from None
                if verify and sha256_file(target) != meta["sha256"]:
                    raise ArtifactCorrupt(f"{self.uri_of(key)}: file {rel} does not match its manifest sha256")
            (tmp / ".complete").touch()
            try:
                os.replace(tmp, dest)
            except OSError:  # another process published the same content first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest

    # -- writing ---------------------------------------------------------------------------
    def publish(
        self,
        key: str,
        local_dir: str | Path,
        *,
        kind: str,
        config: Mapping[str, Any] | None = None,
        inputs: Mapping[str, ArtifactRef] | None = None,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> ArtifactRef:
        """Upload every file under ``local_dir`` and then write the manifest: the one commit point."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise FileNotFoundError(f"publish {key!r}: {local_dir} is not a directory")
        data = f"data-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
            target = self._path(key, data, rel)
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), target)
        manifest = {
            "format": 1,
            "kind": kind,
            "key": _check_key(key),
            "data": data,
            "content_hash": content_hash(files),
            "files": files,
            "config": dict(config or {}),
            "inputs": {name: ref.content_hash for name, ref in (inputs or {}).items()},
            "input_uris": {name: ref.uri for name, ref in (inputs or {}).items()},
            "metrics": dict(metrics or {}),
            "versions": library_versions(),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **dict(extra or {}),
        }
        self._write_manifest(key, json.dumps(manifest, indent=1, sort_keys=True, default=str).encode())
        return ArtifactRef(uri=self.uri_of(key), key=manifest["key"], kind=kind, content_hash=manifest["content_hash"])

    def _write_manifest(self, key: str, raw: bytes) -> None:
        path = self._path(key, MANIFEST)
        if self.local:  # write + rename: readers see the old manifest or the new one, never half
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:  # one PUT: object stores make it visible whole or not at all
            self.fs.pipe_file(path, raw)

    def delete(self, key: str) -> None:
        """Remove an artifact: the manifest first, so it stops counting as complete at once."""
        base = self._path(key)
        if self.fs.exists(self._path(key, MANIFEST)):
            self.fs.rm_file(self._path(key, MANIFEST))
        if self.fs.exists(base):
            self.fs.rm(base, recursive=True)


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _strip(fs, path: str) -> str:
    return fs._strip_protocol(path).rstrip("/")
