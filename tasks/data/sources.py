"""Data sources as streams of raw records: a file, a glob or a folder of shards, on any fsspec URI.

Containers: ``.jsonl``, ``.json`` (an array, or an object holding one under ``data`` / ``rows`` /
``train``...), ``.csv``, ``.tsv``, ``.txt`` (a record a line), ``.parquet``, and Arrow: a Hugging
Face ``datasets`` folder made by ``save_to_disk`` (a ``DatasetDict`` folder reads its ``train``
split). Any of the text containers may be compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``: fsspec's
compression inference). A URI with ``*``/``?``/``[`` is a glob of shards; a folder is its data
files, sorted by name.

``Source.records()`` streams: one pass over the bytes, which feeds sha256 as they are read, so a
source is read and hashed at once and never held whole in memory (a ``.json`` array is the one
container that is parsed whole: use ``.jsonl`` for multi-GB data). Parquet needs random access, so
its bytes are hashed in a streaming pass of their own. Every error is a ``DataError`` naming the
config field, the URI, the line or record, and the fix.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from fsspec.compression import compr
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression

CONTAINERS = (".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet", ".arrow")
_CHUNK = 1 << 20
_JSON_LIST_KEYS = ("data", "rows", "records", "examples", "train")


class DataError(ValueError):
    """A data source is unreadable or malformed; the message names the field, line and fix."""


@dataclass(frozen=True)
class Shard:
    path: str  # path on the source's filesystem
    uri: str  # as shown in messages
    container: str  # one of CONTAINERS
    compression: str | None
    size: int
    identity: tuple  # size and mtime / ETag: what says "these bytes have not changed"


class _HashingReader(io.RawIOBase):
    """A read-only stream that feeds every byte it passes on into ``sha``."""

    def __init__(self, f, sha):
        self.f, self.sha, self.nbytes = f, sha, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        self.nbytes += n
        return n


def _identity(info: Mapping[str, Any]) -> tuple:
    return tuple(str(info.get(k)) for k in ("size", "mtime", "ETag", "etag", "LastModified", "md5Hash", "created"))


def container_of(name: str) -> tuple[str, str | None]:
    """(container extension, compression) of a file name: 'x.jsonl.gz' -> ('.jsonl', 'gzip')."""
    name = name.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1].lower()
    comp = infer_compression(name)
    if comp:
        name = name.rsplit(".", 1)[0]
    return ("." + name.rsplit(".", 1)[1] if "." in name else ""), comp


@dataclass
class Source:
    """One configured data source: its shards and, after a full pass, its content hash."""

    field: str  # config field, e.g. "data.sft_path"
    uri: str
    fs: Any
    shards: list[Shard]
    note: str = ""  # how the URI was read (e.g. "DatasetDict split 'train'"), for meta.json
    _hashes: dict[str, str] = field(default_factory=dict)

    @property
    def identity(self) -> tuple:
        return (self.uri, tuple((s.path, s.identity) for s in self.shards))

    @property
    def sha256(self) -> str:
        """The content hash: of the file's bytes for one file, of (name, hash) per shard for several."""
        if len(self._hashes) != len(self.shards):
            raise RuntimeError("Source.sha256 before a full pass of records()")
        if len(self.shards) == 1:
            return self._hashes[self.shards[0].path]
        h = hashlib.sha256()
        for s in self.shards:
            h.update(f"{s.path.rsplit('/', 1)[-1]}\0{self._hashes[s.path]}\n".encode())
        return h.hexdigest()

    def records(self) -> Iterator[tuple[str, Any]]:
        """(where, raw record) for every record of every shard; a ``.txt`` line is a str record."""
        n = 0
        for shard in self.shards:
            where = f"{self.field} {shard.uri!r}"
            sha = hashlib.sha256()
            for item in (_parquet if shard.container == ".parquet" else _stream)(self.fs, shard, where, sha):
                n += 1
                yield item
            self._hashes[shard.path] = sha.hexdigest()
        if not n:
            raise DataError(f"{self.field} {self.uri!r} is empty; it needs at least one record")


def open_source(uri: str, storage_options: Mapping[str, Any] | None, field: str,
                allowed: tuple[str, ...] = CONTAINERS) -> Source:
    """Resolve a URI (file, glob, folder, ``save_to_disk`` folder) to its shards; reads no data."""
    try:
        fs, path = url_to_fs(uri, **dict(storage_options or {}))
    except (ValueError, ImportError) as e:  # unknown protocol, bad URL: fsspec says which
        raise DataError(f"{field} {uri!r} cannot be opened ({e}); use a local path or an installed fsspec "
                        "protocol (file://, memory://, s3://)") from None
    note = ""
    magic = next((i for i, c in enumerate(path) if c in "*?["), None)
    if magic is not None:
        paths = sorted(p for p in fs.glob(path) if not fs.isdir(p))
        if not paths:
            raise FileNotFoundError(f"{field} {uri!r}: the pattern matches no file; check the path "
                                    "(and data.storage_options for remote stores)")
        base = path[: path.rfind("/", 0, magic) + 1]
    elif fs.isdir(path):
        paths, note = _folder(fs, path.rstrip("/"), uri, field)
        base = path.rstrip("/") + "/"
    elif fs.exists(path):
        paths, base = [path], path
    else:
        raise FileNotFoundError(f"{field} {uri!r}: no such file; check the path (and data.storage_options for remote stores)")
    # messages show the user's own spelling of the URI, extended by the shard's path under it
    stem = uri[: uri.rfind("/", 0, next((i for i, c in enumerate(uri) if c in "*?["), len(uri))) + 1] if magic is not None \
        else (uri.rstrip("/") + "/" if base.endswith("/") else uri)

    def shown(p: str) -> str:
        return stem + p[len(base):] if p.startswith(base) and p != base else (uri if p == base else p)

    shards = []
    for p in paths:
        container, comp = container_of(p)
        if container not in allowed:
            raise DataError(f"{field} {shown(p)!r}: unknown extension {container or '(none)'!r}; "
                            f"data files can be {', '.join(allowed)} (optionally .gz/.bz2/.xz/.zst)")
        if comp and container in (".parquet", ".arrow"):
            raise DataError(f"{field} {shown(p)!r}: a compressed {container} file; {container} files compress "
                            "internally: write them uncompressed")
        if comp and comp not in compr:
            raise DataError(f"{field} {shown(p)!r}: {comp} compression needs a package that is not installed "
                            f"(zstd: pip install zstandard)")
        info = fs.info(p)
        shards.append(Shard(p, shown(p), container, comp, int(info.get("size") or 0), _identity(info)))
    return Source(field, uri, fs, shards, note)


def _folder(fs, path: str, uri: str, field: str) -> tuple[list[str], str]:
    """The data files of a folder; a ``datasets.save_to_disk`` folder by its own index files."""
    if fs.exists(f"{path}/dataset_dict.json"):  # a DatasetDict: one folder per split
        splits = json.loads(fs.cat_file(f"{path}/dataset_dict.json")).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{field} {uri!r} is a DatasetDict with splits {splits} and no 'train'; "
                            f"point it at one split folder, e.g. {uri.rstrip('/')}/{splits[0] if splits else 'SPLIT'}")
        files, _ = _folder(fs, f"{path}/train", uri, field)
        return files, "DatasetDict split 'train'"
    if fs.exists(f"{path}/state.json"):  # a Dataset: its Arrow shards in order
        state = json.loads(fs.cat_file(f"{path}/state.json"))
        return [f"{path}/{f['filename']}" for f in state.get("_data_files", [])], "datasets.save_to_disk folder"
    files = sorted(p for p in fs.ls(path, detail=False)
                   if not p.rsplit("/", 1)[-1].startswith((".", "_")) and container_of(p)[0] in CONTAINERS)
    if not files:
        raise DataError(f"{field} {uri!r} is a folder with no data files; it needs files ending in "
                        f"{', '.join(CONTAINERS)} (optionally compressed)")
    return files, "folder"


# -- readers -----------------------------------------------------------------------------------
def _stream(fs, shard: Shard, where: str, sha) -> Iterator[tuple[str, Any]]:
    raw = fs.open(shard.path, "rb")
    hashed = _HashingReader(raw, sha)
    f = compr[shard.compression](io.BufferedReader(hashed, _CHUNK), mode="rb") if shard.compression else io.BufferedReader(hashed, _CHUNK)
    try:
        if shard.container == ".arrow":
            yield from _arrow(f, where)
        elif shard.container in (".jsonl", ".txt"):
            yield from (_jsonl if shard.container == ".jsonl" else _txt)(_lines(f, where), where)
        else:
            text = io.TextIOWrapper(f, encoding="utf-8", newline="")
            yield from (_json(text, where) if shard.container == ".json" else _csv(text, where, shard.container))
        # drain what a reader left (a trailing newline, a JSON document's tail) so the hash is of the whole file
        while f.read(_CHUNK):
            pass
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: bytes {e.object[e.start:e.end]!r} are not UTF-8; re-save the file as UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8)") from None
    except (EOFError, OSError) as e:  # a truncated gzip/xz/bz2/zstd stream, a corrupt header
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"{where}: the {shard.compression or shard.container} stream is truncated or corrupt "
                        f"({type(e).__name__}: {e}); download or write the file again") from None
    finally:
        f.close()
        raw.close()


def _lines(f, where: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of the non-blank lines of a binary stream; UTF-8 checked per line."""
    for n, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise DataError(f"{where} line {n}: bytes {raw[e.start:e.end]!r} are not UTF-8; re-save the file as UTF-8 "
                            "(e.g. iconv -f latin1 -t utf-8)") from None
        if n == 1:
            line = line.removeprefix("\ufeff")  # a BOM from Windows editors
        if line.strip():
            yield n, line


def _txt(lines, where: str) -> Iterator[tuple[str, Any]]:
    for n, line in lines:
        yield f"{where} line {n}", line


def _jsonl(lines, where: str) -> Iterator[tuple[str, Any]]:
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where} line {n}: malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where} line {n}: a JSON {type(obj).__name__}, not an object; each line must be one "
                            "JSON object like {\"prompt\": ...}")
        yield f"{where} line {n}", obj


def _json(text, where: str) -> Iterator[tuple[str, Any]]:
    body = text.read()
    try:
        doc = json.loads(body.removeprefix("\ufeff"))
    except json.JSONDecodeError as e:
        raise DataError(f"{where} line {e.lineno}: malformed JSON ({e.msg} at column {e.colno}); a .json file must be "
                        "one JSON array of objects (or one object per line, named .jsonl)") from None
    if isinstance(doc, dict):
        key = next((k for k in _JSON_LIST_KEYS if isinstance(doc.get(k), list)), None)
        if key is None:
            raise DataError(f"{where}: a JSON object with keys {sorted(doc)[:10]} and no list of records under "
                            f"{', '.join(_JSON_LIST_KEYS)}; write an array of objects")
        doc, where = doc[key], f"{where} [{key!r}]"
    if not isinstance(doc, list):
        raise DataError(f"{where}: a JSON {type(doc).__name__}; a .json file must hold an array of objects")
    for i, obj in enumerate(doc):
        if not isinstance(obj, dict):
            raise DataError(f"{where} record {i}: a JSON {type(obj).__name__}, not an object; records are objects like {{\"prompt\": ...}}")
        yield f"{where} record {i}", obj


def _csv(text, where: str, container: str) -> Iterator[tuple[str, Any]]:
    reader = csv.DictReader(text, delimiter="\t" if container == ".tsv" else ",", strict=True)
    try:
        columns = [c.strip().removeprefix("\ufeff") for c in reader.fieldnames or []]
        reader.fieldnames = columns
        for row in reader:
            if None in row:  # more cells than columns
                raise DataError(f"{where} line {reader.line_num}: {len(columns) + len(row[None])} cells for "
                                f"{len(columns)} columns; quote cells that hold the delimiter")
            if any(v and v.strip() for v in row.values()):
                yield f"{where} line {reader.line_num}", {k: v for k, v in row.items() if v is not None}
    except csv.Error as e:
        raise DataError(f"{where}, the record after line {reader.line_num}: malformed {container[1:].upper()} ({e}); "
                        "check the quoting (a cell with the delimiter, a quote or a newline must be in double quotes)") from None


def _table_rows(batches, where: str) -> Iterator[tuple[str, Any]]:
    i = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield f"{where} record {i}", row
            i += 1


def _arrow(f, where: str) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa

    try:
        yield from _table_rows(pa.ipc.open_stream(f), where)
    except pa.ArrowInvalid as e:
        raise DataError(f"{where}: not a readable Arrow stream ({e}); write it with datasets' save_to_disk, or as .parquet/.jsonl") from None


def _parquet(fs, shard: Shard, where: str, sha) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fs.open(shard.path, "rb") as f:  # the hash needs a pass of its own: Parquet is read from its footer
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    try:
        with fs.open(shard.path, "rb") as f:
            yield from _table_rows(pq.ParquetFile(f).iter_batches(batch_size=1024), where)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{where}: not a readable Parquet file ({e}); write it again (e.g. pandas.to_parquet / pyarrow)") from None
