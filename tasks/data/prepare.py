"""Data prep: sources (any fsspec URI, or the built-in task) -> a tokenized ``dataset`` artifact.

A source is streamed, never held whole: ``tasks.data.sources`` reads its container(s) and hashes
the bytes as they pass, ``tasks.data.formats`` turns each raw record into one of ours (or drops
and counts a degenerate one), and the samples go to disk as they are tokenized. ``scan_sources``
is the pass that validates and hashes (pre-flight and the key); it is memoised per process by
each file's size/mtime/ETag, so a run's driver reads every source once. ``prepare_data`` reads
them once more to build the artifact, and checks that the bytes it built from are the ones it
was keyed on. The built-in task is written to files and read back through the same code. The
artifact's files are described in docs/ARTIFACTS.md.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from storage.keys import code_version, stage_key
from storage.store import ArtifactRef, ArtifactStore
from tasks.common.builtin import write_task_files
from tasks.common.model import ModelConfig, load_tokenizer
from tasks.data.config import DataConfig
from tasks.data.encode import Encoder, truncate_left
from tasks.data.formats import normalize, source_columns
from tasks.data.sources import DataError, Source, open_source

log = logging.getLogger("rlhf.data")

# name -> the DataConfig field holding its URI; names match write_task_files' files.
SOURCES = {"sft": "sft_path", "preference": "preference_path", "prompts": "prompts_path", "ptx": "ptx_path"}
SPLIT = ("sft", "preference", "prompts")  # ptx has no eval split


@dataclass
class Scan:
    """What one validating pass over a source found."""

    sha256: str
    records: int  # raw records read
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    columns_used: frozenset = frozenset()  # the plain data.columns renames that matched a field
    chat: bool = False  # some record is chat messages (needs the tokenizer's chat template)


_SCANS: dict[tuple, Scan] = {}  # memo: (source, file identities, parse settings) -> Scan


def _open_sources(cfg: DataConfig, tmp: str) -> dict[str, Source]:
    builtin = None
    out = {}
    for name, attr in SOURCES.items():
        field_name, uri = f"data.{attr}", getattr(cfg, attr)
        if uri is None:
            builtin = builtin or write_task_files(Path(tmp) / "builtin", cfg.builtin_seed)
            out[name] = open_source(str(builtin[name]), None, field_name)
            out[name].uri = f"builtin:task/{name}.jsonl?seed={cfg.builtin_seed}"
        else:
            out[name] = open_source(uri, cfg.storage_options, field_name)
    return out


def _records(cfg: DataConfig, name: str, src: Source, dropped: dict, used: set, counter: list) -> Iterator[dict]:
    def counted():
        for item in src.records():
            counter[0] += 1
            yield item

    return normalize(name, counted(), columns=cfg.columns, prompt_template=cfg.prompt_template, dropped=dropped, used=used,
                     metadata=cfg.prompt_metadata)


def _check_kept(src: Source, records: int, kept: int, dropped: dict) -> None:
    if records and not kept:
        raise DataError(f"{src.field} {src.uri!r}: all {records} records are degenerate (dropped: {dropped}); "
                        "check that the fields hold text (data.columns maps other field names)")
    if kept < 2:
        raise DataError(f"{src.field} {src.uri!r} has {kept} usable record(s) (dropped: {dropped}); "
                        "at least 2 are needed to split train/eval: add records")


def _check_columns(cfg: DataConfig, used: set) -> None:
    unused = {k: v for k, v in cfg.columns.items() if "." not in k and k not in used
              and not any(k in source_columns(cfg.columns, n)[0] for n in SOURCES)}
    if unused:
        k, v = next(iter(unused.items()))
        raise DataError(f"data.columns[{k!r}] = {v!r}: no record of any source has a field {v!r}; "
                        "check the name (data.columns maps your field names to ours)")


def scan_sources(cfg: DataConfig, sources: dict[str, Source]) -> dict[str, Scan]:
    """Validate and hash every source in one streaming pass each (memoised per process)."""
    out = {}
    for name, src in sources.items():
        ident = src.uri if src.uri.startswith("builtin:") else src.identity  # built-in files are fresh temp files
        memo = (name, ident, json.dumps(cfg.columns, sort_keys=True), cfg.prompt_template, tuple(cfg.prompt_metadata))
        if memo not in _SCANS:
            dropped, used, counter, kept, chat = {}, set(), [0], 0, False
            for r in _records(cfg, name, src, dropped, used, counter):
                kept, chat = kept + 1, chat or "messages" in r or "prompt_messages" in r
            if name in SPLIT:
                _check_kept(src, counter[0], kept, dropped)
            _SCANS[memo] = Scan(src.sha256, counter[0], kept, dropped, frozenset(used), chat)
        out[name] = _SCANS[memo]
    _check_columns(cfg, set().union(*(s.columns_used for s in out.values())))
    return out


def check_data(cfg: DataConfig, model: ModelConfig | None = None) -> dict[str, int]:
    """Pre-flight: every source is reachable and parses (and, given the model, chat records have a
    chat template to render them). Returns the usable record count per source."""
    with tempfile.TemporaryDirectory(prefix="rlhf-data-") as tmp:
        sources = _open_sources(cfg, tmp)
        scans = scan_sources(cfg, sources)
        chat = [n for n, s in scans.items() if s.chat]
        if model is not None and chat and not load_tokenizer(model).chat_template:
            _chat_template_error(model, sources[chat[0]])
        return {name: s.kept for name, s in scans.items()}


def _chat_template_error(model: ModelConfig, src: Source):
    raise DataError(f"{src.field} {src.uri!r} has chat `messages` records, but the tokenizer of model.pretrain "
                    f"{model.pretrain!r} has no chat template; use prompt/response records or set "
                    "model.tokenizer to a tokenizer with a chat template")


def _key_config(cfg: DataConfig, model: ModelConfig, seed: int, hashes: dict[str, str]) -> dict:
    # Sources enter by content hash, not URI: the same bytes elsewhere give the same key.
    # storage_options (endpoints) never change what is read.
    data = cfg.model_dump(mode="json", exclude={"storage_options", "builtin_seed", *SOURCES.values()})
    return {"data": data, "sources": hashes, "model": model.identity(), "seed": seed}


def data_key(cfg: DataConfig, model: ModelConfig, seed: int) -> str:
    """``data/<fingerprint>`` of the dataset these sources, this config and tokenizer make."""
    with tempfile.TemporaryDirectory(prefix="rlhf-data-") as tmp:
        scans = scan_sources(cfg, _open_sources(cfg, tmp))
        return _data_key(_key_config(cfg, model, seed, {n: s.sha256 for n, s in scans.items()}))


def _data_key(key_config: dict) -> str:
    return stage_key("data", key_config, {}, code_version(__name__))


# -- pure helpers ------------------------------------------------------------------------------
def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: a ``random.Random(seed)`` shuffle; eval has 1..n-1 items."""
    assert n >= 2, n
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    return sorted(idx[n_eval:]), sorted(idx[:n_eval])


class LineGrouper:
    """Plain-text samples from tokenized lines (each already ending with EOS), fed one at a time.

    A line longer than ``max_length`` is cut into chunks (counted in ``stats["lines_split"]``).
    Unless ``short_text``, adjacent pieces are concatenated while they fit; the piece that would
    overflow a group starts the next one (the seed dropped it).
    """

    def __init__(self, max_length: int, short_text: bool, stats: dict):
        self.L, self.short, self.stats, self.cur = max_length, short_text, stats, []

    def add(self, ids: list[int]) -> list[list[int]]:
        """The groups this line completes."""
        done = []
        if len(ids) > self.L:
            self.stats["lines_split"] = self.stats.get("lines_split", 0) + 1
        for piece in (ids[i:i + self.L] for i in range(0, len(ids), self.L)):
            if self.short:
                done.append(piece)
                continue
            if self.cur and len(self.cur) + len(piece) > self.L:
                done.append(self.cur)
                self.cur = []
            self.cur = self.cur + piece
        return done

    def flush(self) -> list[list[int]]:
        done, self.cur = ([self.cur] if self.cur else []), []
        return done


def group_lines(lines: list[list[int]], max_length: int, short_text: bool = False) -> tuple[list[list[int]], int]:
    """``LineGrouper`` over a list: (samples, lines split)."""
    stats: dict = {}
    g = LineGrouper(max_length, short_text, stats)
    groups = [x for ids in lines for x in g.add(ids)] + g.flush()
    return groups, stats.get("lines_split", 0)


def _drop(stats: dict, reason: str) -> None:
    stats["dropped"][reason] = stats["dropped"].get(reason, 0) + 1


# -- building the files: a generator of samples per source kind -----------------------------------
def _lm_samples(enc: Encoder, records: Iterable[dict], stats: dict) -> Iterator[dict]:
    L = enc.cfg.max_length
    grouper = LineGrouper(L, enc.cfg.short_text, stats)
    for r in records:
        if "text" in r:
            for g in grouper.add(enc.enc(r["text"]) + [enc.eos]):
                yield {"input_ids": g, "labels": list(g)}
            continue
        if "messages" in r:
            ids, labels = enc.messages(r["messages"])
            truncated = len(ids) > L
            ids, labels = ids[:L], labels[:L]
        else:
            ids, labels, truncated = enc.prompt_response(r["prompt"], r["response"])
        stats["truncated"] += truncated
        if all(x == -100 for x in labels):  # truncation left no response token: nothing to learn
            _drop(stats, "no_labels_after_truncation")
            continue
        yield {"input_ids": ids, "labels": labels}
    for g in grouper.flush():
        yield {"input_ids": g, "labels": list(g)}


def _pair_samples(enc: Encoder, records: Iterable[dict], stats: dict) -> Iterator[dict]:
    L = enc.cfg.max_length
    for rec in records:
        p, c, r = enc.pair(rec)
        room = L - max(len(c), len(r))
        if room < 1:  # the response alone does not fit: no prompt left to score it against
            _drop(stats, "response_too_long")
            continue
        if len(p) > room:
            p = truncate_left(p, room, enc.prefix)
            stats["truncated"] += 1
        yield {"chosen_ids": p + c, "rejected_ids": p + r, "prompt_len": len(p)}


def _prompt_samples(enc: Encoder, records: Iterable[dict], stats: dict) -> Iterator[dict]:
    n = enc.cfg.max_prompt_length
    for rec in records:
        text = enc.render_prompt(rec)
        if not text.strip():
            _drop(stats, "empty_prompt_after_template")
            continue
        ids = (enc.prefix if "prompt" in rec else []) + enc.enc(text)
        if len(ids) > n:  # keep the end: the generation prompt must stay where the response starts
            ids = truncate_left(ids, n, enc.prefix)
            body = ids[len(enc.prefix):] if enc.prefix and ids[: len(enc.prefix)] == enc.prefix else ids
            text = enc.tok.decode(body)
            stats["truncated"] += 1
        yield {"prompt_ids": ids, "prompt": text, **({"metadata": rec["metadata"]} if "metadata" in rec else {})}


_SAMPLES = {"sft": _lm_samples, "ptx": _lm_samples, "preference": _pair_samples, "prompts": _prompt_samples}
_PREFIX = {"sft": "sft", "preference": "pref", "prompts": "prompts", "ptx": "ptx"}  # file names


def _needs_chat(tok, model: ModelConfig, src: Source, records: Iterable[dict]) -> Iterator[dict]:
    for r in records:
        if not tok.chat_template and ("messages" in r or "prompt_messages" in r):
            _chat_template_error(model, src)
        yield r


def _lengths(sample: dict) -> int:
    return len(sample.get("input_ids") or sample.get("prompt_ids") or max(sample["chosen_ids"], sample["rejected_ids"], key=len))


def _percentiles(lengths: array) -> dict[str, int]:
    v = sorted(lengths)
    return {"p50": v[len(v) // 2], "p95": v[min(len(v) - 1, int(len(v) * 0.95))], "max": v[-1]} if v else {}


def _write_source(out: Path, name: str, samples: Iterator[dict], seed: int, eval_fraction: float, stats: dict) -> dict[str, int]:
    """Stream the samples to disk, then deal them to train/eval by a seeded shuffle of their indices."""
    prefix, lengths, n = _PREFIX[name], array("I"), 0
    every = out / f".{prefix}_all.jsonl"
    with open(every, "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
            lengths.append(_lengths(sample))
            n += 1
    stats["samples"], stats["tokens"] = n, _percentiles(lengths)
    if name not in SPLIT:
        every.rename(out / f"{prefix}_train.jsonl")
        return {f"{prefix}_train.jsonl": n}
    if n < 2:
        return {}
    _, held = split_indices(n, eval_fraction, seed)
    held, counts = set(held), {f"{prefix}_train.jsonl": n - len(held), f"{prefix}_eval.jsonl": len(held)}
    with open(every, encoding="utf-8") as f, open(out / f"{prefix}_train.jsonl", "w", encoding="utf-8") as tr, \
            open(out / f"{prefix}_eval.jsonl", "w", encoding="utf-8") as ev:
        for i, line in enumerate(f):
            (ev if i in held else tr).write(line)
    every.unlink()
    return counts


def _build(out: Path, enc: Encoder, cfg: DataConfig, model: ModelConfig, sources: dict[str, Source], seed: int) -> tuple[dict, dict]:
    """Every source through parse -> tokenize -> files in one streaming pass: (per-file counts, per-source stats)."""
    counts, per_source = {}, {}
    for name, src in sources.items():
        st = {"records": 0, "kept": 0, "dropped": {}, "truncated": 0}
        counter, used = [0], set()
        records = _records(cfg, name, src, st["dropped"], used, counter)

        def kept(recs):
            for r in recs:
                st["kept"] += 1
                yield r

        samples = _SAMPLES[name](enc, kept(_needs_chat(enc.tok, model, src, records)), st)
        counts.update(_write_source(out, name, samples, seed, cfg.eval_fraction, st))
        st["records"] = counter[0]
        if name in SPLIT:
            _check_kept(src, st["records"], st["kept"], st["dropped"])
            if st["samples"] < 2:
                raise DataError(f"{src.field} {src.uri!r}: {st['kept']} records gave {st['samples']} samples "
                                f"(max_length {cfg.max_length}, dropped {st['dropped']}); at least 2 are needed "
                                "to split train/eval: raise data.max_length, add data, or set data.short_text=true for plain text")
        per_source[name] = {"uri": src.uri, "sha256": src.sha256, "read_as": src.note or "file", "shards": len(src.shards),
                            "bytes": sum(sh.size for sh in src.shards), **st}
    return counts, per_source


def _report(per_source: dict) -> None:
    for name, s in per_source.items():
        log.info("data %-10s %7d records  %7d samples  dropped %s  truncated %d  tokens p50/p95/max %s  (%s)",
                 name, s["records"], s["samples"], s["dropped"] or 0, s["truncated"],
                 "/".join(str(s["tokens"].get(k, "-")) for k in ("p50", "p95", "max")), s["uri"])


def prepare_data(cfg: DataConfig, model: ModelConfig, store: ArtifactStore, seed: int, *, force: bool = False,
                 key: str | None = None) -> ArtifactRef:
    """Tokenize the sources into the ``dataset`` artifact at ``data_key``; reuse it when it exists.

    ``key``: the ``data_key`` the caller computed (the flow, in its pre-flight pass): then the
    sources are read once here, to build, and the key is checked against what was read.
    """
    with tempfile.TemporaryDirectory(prefix="rlhf-data-") as tmp:
        sources = _open_sources(cfg, tmp)
        if key is None:  # every data error is raised here, before the tokenizer loads
            scans = scan_sources(cfg, sources)
            key = _data_key(_key_config(cfg, model, seed, {n: s.sha256 for n, s in scans.items()}))
        if not force and store.is_good(key):  # a damaged artifact is rebuilt
            return store.ref(key)
        tok = load_tokenizer(model)
        out = Path(tmp) / "artifact"
        out.mkdir()
        counts, per_source = _build(out, Encoder(tok, cfg), cfg, model, sources, seed)
        key_config = _key_config(cfg, model, seed, {n: s["sha256"] for n, s in per_source.items()})
        if _data_key(key_config) != key:
            raise DataError(f"the data sources changed while this run read them (their sha256 differs from the one "
                            f"the run was keyed on, {key}); let the writer finish, then run again")
        _report(per_source)
        tok.save_pretrained(out / "tokenizer")
        meta = {
            "counts": counts,
            "sources": per_source,
            "truncated": {n: s["truncated"] for n, s in per_source.items()},
            "dropped": {n: s["dropped"] for n, s in per_source.items()},
            "max_length": cfg.max_length,
            "max_prompt_length": cfg.max_prompt_length,
            "templates": {"prompt": cfg.prompt_template, "response": cfg.response_template, "chat": tok.chat_template},
            "seed": seed,
            "eval_fraction": cfg.eval_fraction,
            "short_text": cfg.short_text,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        metrics = {f"data/{f.removesuffix('.jsonl')}": n for f, n in counts.items()}
        metrics["data/truncated"] = sum(meta["truncated"].values())
        metrics["data/dropped"] = sum(sum(d.values()) for d in meta["dropped"].values())
        return store.publish(key, out, kind="dataset", config=key_config, metrics=metrics)
