"""One small artifact store on fsspec: file://, memory://, s3:// (s3fs), gcs://, ...

An artifact is a directory of files under ``<root>/<key>/``. Publishing uploads the files into a
fresh ``data-<time>-<uuid>/`` folder and then writes ``MANIFEST.json`` last, in one put (an
atomic rename on local disks). A reader only trusts what a manifest names, so a half-written
artifact is never seen as complete, and two writers of the same key never mix their files: each
manifest points at a complete folder of its own. A republished key leaves the older folder
behind unreferenced (a reader may still be fetching it); ``delete`` removes them all.

The manifest describes the artifact (STYLE 6): the config that made it, the content hashes of
its inputs, a sha256 and size per file, library versions, metrics, and when it was made.
Storage options (endpoints, credentials) are never written into it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import fsspec
from pydantic import BaseModel

MANIFEST = "MANIFEST.json"
DATA_PREFIX = "data-"
_LOCAL = {"file", "local"}
_VERIFIED: set[tuple] = set()  # (store uri, key, data folder, manifest stamp) hashed whole in this process
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=+-]*")
# Fields publish() writes itself; ``extra`` may not replace them (a stray "files" would make the
# manifest point at nothing).
_RESERVED = {"format", "kind", "key", "data", "content_hash", "files", "config", "inputs",
             "input_uris", "metrics", "versions", "created_at"}


class ArtifactRef(BaseModel):
    """What stages pass to each other: where an artifact is and what it holds."""

    uri: str
    key: str
    kind: str
    content_hash: str
    parts: dict[str, str] = {}  # content hash per top-level file/folder, see ``only``

    def only(self, *names: str) -> "ArtifactRef":
        """This ref with a content hash over just the named parts (top-level files or folders).

        A consumer that reads only some parts keys on those, so a change elsewhere in the
        artifact does not invalidate it (new prompts re-run PPO, not SFT).
        """
        if not self.parts:
            return self
        missing = [n for n in names if n not in self.parts]
        if missing:
            raise KeyError(f"{self.uri} has no parts {missing}; it has {sorted(self.parts)}")
        h = hashlib.sha256("".join(f"{n}\0{self.parts[n]}\n" for n in sorted(names)).encode()).hexdigest()
        return self.model_copy(update={"content_hash": h, "parts": {n: self.parts[n] for n in names}})


class ArtifactCorrupt(RuntimeError):
    """A file of a published artifact is missing or does not match its manifest hash."""


_CREDENTIAL_KEYS = {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}


def reject_credentials(field: str, options: Mapping[str, Any]) -> dict:
    """Storage options are saved with flow parameters and manifests: credentials must come from
    the environment. Returns the options, or raises naming the field, the keys and the fix."""
    bad = sorted(k for k in options if k.lower() in _CREDENTIAL_KEYS)
    if bad:
        raise ValueError(
            f"{field} has credential keys {bad}: they would be saved with flow parameters; set them in the "
            "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or a profile via storage_options.profile) instead"
        )
    return dict(options)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def part_hashes(files: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Content hash of each top-level entry: 'tokenizer/a.json' belongs to part 'tokenizer'."""
    groups: dict[str, dict] = {}
    for rel, meta in files.items():
        groups.setdefault(rel.split("/", 1)[0], {})[rel] = meta
    return {name: content_hash(group) for name, group in groups.items()}


def content_hash(files: Mapping[str, Mapping[str, Any]]) -> str:
    """Hash of an artifact's contents: its relative paths and their file hashes, in order."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]['sha256']}\n".encode())
    return h.hexdigest()


def to_jsonable(obj: Any) -> Any:
    """JSON default for manifests and keys: pydantic models, numpy/torch scalars, paths, sets.

    Sets are sorted so that a key does not depend on the process's hash seed.
    """
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=lambda v: json.dumps(v, sort_keys=True, default=to_jsonable))
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars (0-d tensors)
        return obj.item()
    return str(obj)


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "peft", "ray", "prefect", "fsspec", "s3fs"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _check_key(key: str) -> str:
    parts = key.split("/") if isinstance(key, str) else [None]
    bad = [p for p in parts if not (isinstance(p, str) and _SEGMENT.fullmatch(p))]
    reserved = [p for p in parts if p == MANIFEST or (isinstance(p, str) and p.startswith(DATA_PREFIX))]
    if not key or bad or reserved:
        raise ValueError(
            f"artifact key {key!r} is not a relative path inside the store: use '/'-separated "
            "parts of letters, digits and ._=+- (not starting with '.' or '-'; no '..', no leading "
            f"'/', no empty part; '{MANIFEST}' and '{DATA_PREFIX}*' are reserved), e.g. 'sft/3f2a9c'"
        )
    return key


def _check_rel(uri: str, rel: str) -> str:
    """A file path read from a manifest must stay inside the artifact's folder."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
        raise ArtifactCorrupt(f"{uri}: manifest names file {rel!r} outside the artifact folder")
    return rel


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
        protocols = set(_protocols(self.fs))
        self.local = bool(protocols & _LOCAL)
        # Remote stores may be unreachable when a publish fails; we then leave the unreferenced
        # data folder for delete() instead of retrying against a dead endpoint.
        self.remote = not (self.local or "memory" in protocols)
        if self.local:
            try:
                os.makedirs(self.root, exist_ok=True)
            except PermissionError as e:
                raise PermissionError(f"store.uri {uri!r}: cannot create {self.root} ({e.strerror}); "
                                      "make its parent writable or point store.uri elsewhere") from e

    def __repr__(self) -> str:
        return f"ArtifactStore({self.uri!r})"

    # -- paths -----------------------------------------------------------------------------
    def _path(self, key: str, *rest: str) -> str:
        return "/".join([self.root, _check_key(key), *rest])

    def uri_of(self, key: str) -> str:
        return f"{self.uri}/{_check_key(key)}"

    def _fresh(self, path: str) -> None:
        # s3fs answers exists/info from its listing cache; another process may have published
        # (or corrupted) since we listed, so readers drop the cache for the paths they read.
        self.fs.invalidate_cache(path)

    # -- reading ---------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        self._fresh(self._path(key))
        return self.fs.exists(self._path(key, MANIFEST))

    def manifest(self, key: str) -> dict:
        path = self._path(key, MANIFEST)
        self._fresh(self._path(key))
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no artifact at {self.uri_of(key)} (no {MANIFEST})") from None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ArtifactCorrupt(f"{self.uri_of(key)}: {MANIFEST} is not valid JSON ({e})") from None

    def ref(self, key: str) -> ArtifactRef:
        m = self.manifest(key)
        return ArtifactRef(uri=self.uri_of(key), key=_check_key(key), kind=m["kind"], content_hash=m["content_hash"],
                           parts=part_hashes(m["files"]))

    def list(self, prefix: str = "") -> list[str]:
        """Keys of complete artifacts (those with a manifest) under ``prefix``, sorted."""
        base = self._path(prefix) if prefix else self.root
        self._fresh(base)
        if not self.fs.exists(base):
            return []
        root = self.root + "/"
        keys = []
        for found in self.fs.find(base):
            path = _strip(self.fs, found)
            if not (path.startswith(root) and path.endswith("/" + MANIFEST)):
                continue
            key = path[len(root):-len(MANIFEST) - 1]
            # A file named MANIFEST.json inside some artifact's data folder is content, not a key.
            if not any(p.startswith(DATA_PREFIX) for p in key.split("/")):
                keys.append(key)
        return sorted(keys)

    def _stamp(self, key: str) -> tuple:
        """What changes when a manifest is rewritten: ETag on object stores, mtime on disks, and size."""
        self._fresh(self._path(key))  # s3fs answers info from a listing of the key's folder made before its publish
        info = self.fs.info(self._path(key, MANIFEST))
        return tuple(str(info.get(k)) for k in ("ETag", "mtime", "LastModified", "created", "size"))

    def verify(self, key: str, *, again: bool = False) -> dict:
        """Re-hash every file in the store against the manifest; raises ArtifactCorrupt.

        Once per process: a (store, key, data folder, manifest stamp) that verified is not hashed
        again (a republish changes the stamp); ``again`` re-hashes anyway (``rlhf verify``).
        """
        try:
            stamp = self._stamp(key)
        except FileNotFoundError:
            raise FileNotFoundError(f"no artifact at {self.uri_of(key)} (no {MANIFEST})") from None
        m = self.manifest(key)
        memo = (self.uri, key, m["data"], stamp)
        if memo in _VERIFIED and not again:
            return m
        uri = self.uri_of(key)
        for rel, meta in m["files"].items():
            path = self._path(key, m["data"], _check_rel(uri, rel))
            h, size = hashlib.sha256(), 0
            try:
                with self.fs.open(path, "rb") as f:
                    while block := f.read(1 << 20):
                        h.update(block)
                        size += len(block)
            except FileNotFoundError:
                raise ArtifactCorrupt(f"{uri}: file {rel} named in the manifest is missing") from None
            _check_file(uri, rel, meta, h.hexdigest(), size)
        _VERIFIED.add(memo)
        return m

    def check(self, key: str) -> dict:
        """The cheap check of a cache hit: the manifest, and every file it names present with its
        size (one listing, no file read); raises ArtifactCorrupt. Hashes are checked by
        ``verify``, which every fetch that loads the artifact runs."""
        m = self.manifest(key)
        uri, base = self.uri_of(key), self._path(key, m["data"])
        self._fresh(base)
        try:
            listed = self.fs.find(base, detail=True)
        except FileNotFoundError:
            listed = {}
        sizes = {_strip(self.fs, p)[len(_strip(self.fs, base)) + 1:]: info.get("size") for p, info in listed.items()}
        for rel, meta in m["files"].items():
            if _check_rel(uri, rel) not in sizes:
                raise ArtifactCorrupt(f"{uri}: file {rel} named in the manifest is missing")
            if sizes[rel] != meta["size"]:
                raise ArtifactCorrupt(f"{uri}: file {rel} has {sizes[rel]} bytes, the manifest says {meta['size']} (truncated?)")
        return m

    def is_good(self, key: str) -> bool:
        """Published and whole by ``check`` (sizes, not hashes): what a stage may reuse instead of
        rebuilding (a damaged artifact is rebuilt, never trusted)."""
        try:
            self.check(key)
            return True
        except (ArtifactCorrupt, FileNotFoundError):
            return False

    def fetch(self, key: "str | ArtifactRef", cache_dir: str | Path | None = None, verify: bool = True) -> Path:
        """A local directory holding the artifact's files, checked against the manifest.

        Given an ``ArtifactRef``, the manifest must also hold the content the ref names (a
        consumer keyed on a ref never loads different bytes republished at the same key).
        Local stores return the published folder itself (treat it as read-only); ``verify``
        re-hashes it (once per process). Remote ones download once into a cache keyed by content
        hash (``$RLHF_CACHE`` or ``~/.cache/rlhf``); downloads are always checked, since the cache
        is shared by every later fetch of the same content.
        """
        ref = key if isinstance(key, ArtifactRef) else None
        key = ref.key if ref is not None else key
        m = self.manifest(key)
        if ref is not None:
            _check_ref(ref, m)
        if self.local:
            if verify:
                self.verify(key)
            return Path(self._path(key, m["data"]))
        cache = Path(cache_dir or os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf")) / "artifacts"
        dest = cache / m["content_hash"]
        if dest.is_dir():  # only ever renamed into place whole, after every file was checked
            return dest
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".partial-"))
        uri = self.uri_of(key)
        try:
            for rel, meta in m["files"].items():
                target = tmp / _check_rel(uri, rel)
                target.parent.mkdir(parents=True, exist_ok=True)
                src = self._path(key, m["data"], rel)
                self._fresh(src)
                try:
                    self.fs.get_file(src, str(target))
                except FileNotFoundError:
                    raise ArtifactCorrupt(f"{uri}: file {rel} named in the manifest is missing") from None
                _check_file(uri, rel, meta, sha256_file(target), target.stat().st_size)
            try:
                os.replace(tmp, dest)
            except OSError:  # another process fetched the same content first
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
        config: Mapping[str, Any] | BaseModel | None = None,
        inputs: Mapping[str, ArtifactRef] | None = None,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        keep_existing: bool = False,
    ) -> ArtifactRef:
        """Upload every file under ``local_dir`` and then write the manifest: the one commit point.

        ``keep_existing``: when a whole artifact is already at the key (a run racing this one on
        the same inputs published first), keep it and return its ref. The first build wins, so
        what a racing run's consumers were keyed on is not replaced under them by bytes that may
        differ (the model files are bit-reproducible across processes, tests/test_reproducible.py, but
        TensorBoard's event files carry wall times)."""
        key = _check_key(key)
        if keep_existing and self.is_good(key):
            return self.ref(key)
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise FileNotFoundError(f"publish {key!r}: {local_dir} is not a directory")
        paths = sorted(p for p in local_dir.rglob("*") if p.is_file())
        if not paths:
            raise ValueError(f"publish {key!r}: {local_dir} holds no files; write the artifact there first")
        clash = sorted(set(extra or {}) & _RESERVED)
        if clash:
            raise ValueError(f"publish {key!r}: extra fields {clash} would overwrite manifest fields; rename them")
        data = f"{DATA_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        try:
            files = self._upload(key, data, local_dir, paths)
        except BaseException:
            if not self.remote and self.fs.exists(self._path(key, data)):
                self.fs.rm(self._path(key, data), recursive=True)
            raise
        if hasattr(config, "model_dump"):
            config = config.model_dump(mode="json")
        manifest = {
            "format": 1,
            "kind": kind,
            "key": key,
            "data": data,
            "content_hash": content_hash(files),
            "files": files,
            "config": dict(config or {}),
            "inputs": {name: ref.content_hash for name, ref in (inputs or {}).items()},
            "input_uris": {name: ref.uri for name, ref in (inputs or {}).items()},
            "metrics": dict(metrics or {}),
            "versions": library_versions(),
            "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),  # µs: two runs a second apart still order
            **dict(extra or {}),
        }
        raw = json.dumps(manifest, indent=1, sort_keys=True, default=to_jsonable).encode()
        self._write_manifest(key, raw)
        return ArtifactRef(uri=self.uri_of(key), key=key, kind=kind, content_hash=manifest["content_hash"],
                           parts=part_hashes(files))

    def _upload(self, key: str, data: str, local_dir: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = {}
        for path in paths:
            rel = path.relative_to(local_dir).as_posix()
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
            target = self._path(key, data, rel)
            try:
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(path), target)
            except PermissionError as e:
                raise PermissionError(
                    f"publish {key!r} to {self.uri}: cannot write {target} ({e.strerror or e}); "
                    "make the store root writable or point store.uri elsewhere"
                ) from e
        return files

    def _write_manifest(self, key: str, raw: bytes) -> None:
        path = self._path(key, MANIFEST)
        if self.local:  # write + rename: readers see the old manifest or the new one, never half
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(raw)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        else:  # one PUT: object stores make it visible whole or not at all
            self.fs.pipe_file(path, raw)

    def delete(self, key: str) -> None:
        """Remove an artifact and every folder under its key (older data folders, nested keys).

        The manifest goes first, so the artifact stops counting as complete at once.
        """
        base = self._path(key)
        self._fresh(base)
        if self.fs.exists(self._path(key, MANIFEST)):
            self.fs.rm_file(self._path(key, MANIFEST))
        if self.fs.exists(base):
            self.fs.rm(base, recursive=True)


def _check_ref(ref: ArtifactRef, m: Mapping[str, Any]) -> None:
    have = part_hashes(m["files"])
    if (ref.parts and any(have.get(n) != h for n, h in ref.parts.items())) or (not ref.parts and m["content_hash"] != ref.content_hash):
        raise ArtifactCorrupt(f"{ref.uri}: the store holds other content than the ref names (content hash "
                              f"{m['content_hash'][:12]}, ref {ref.content_hash[:12]}): it was republished since; rerun the stage that made it")


def _check_file(uri: str, rel: str, meta: Mapping[str, Any], sha256: str, size: int) -> None:
    if size != meta["size"]:
        raise ArtifactCorrupt(f"{uri}: file {rel} has {size} bytes, the manifest says {meta['size']} (truncated?)")
    if sha256 != meta["sha256"]:
        raise ArtifactCorrupt(f"{uri}: file {rel} does not match its manifest sha256")


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _strip(fs, path: str) -> str:
    return fs._strip_protocol(path).rstrip("/")
