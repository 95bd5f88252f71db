"""Data prep: sources (any fsspec URI, or the built-in task) -> a tokenized ``dataset`` artifact.

``prepare_data`` reads each source once, hashes its bytes into the artifact key (so new data is
a new key and unchanged data is found again), parses it with ``tasks.data.formats`` and only then
loads the tokenizer. The built-in task is written to files and read back through the same
parsers, so there is one code path. The artifact's files are described in docs/ARTIFACTS.md.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from storage.keys import code_version, stage_key
from storage.store import ArtifactRef, ArtifactStore
from tasks.common.builtin import write_task_files
from tasks.common.model import ModelConfig, load_tokenizer
from tasks.data.config import DataConfig
from tasks.data.dataset import write_jsonl
from tasks.data.encode import Encoder, truncate_left
from tasks.data.formats import DataError, parse_preferences, parse_prompts, parse_ptx, parse_sft, read_bytes

# name -> the DataConfig field holding its URI; names match write_task_files' files.
SOURCES = {"sft": "sft_path", "preference": "preference_path", "prompts": "prompts_path", "ptx": "ptx_path"}
SPLIT = ("sft", "preference", "prompts")  # ptx has no eval split


@dataclass
class Source:
    name: str
    field: str
    uri: str  # what the parser reads (a temp file for the built-in task)
    shown: str  # what meta.json records
    data: bytes

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _load_sources(cfg: DataConfig, tmp: str) -> dict[str, Source]:
    builtin = None
    out = {}
    for name, attr in SOURCES.items():
        field, uri = f"data.{attr}", getattr(cfg, attr)
        if uri is None:
            builtin = builtin or write_task_files(Path(tmp) / "builtin", cfg.builtin_seed)
            out[name] = Source(name, field, str(builtin[name]), f"builtin:task/{name}.jsonl?seed={cfg.builtin_seed}",
                               builtin[name].read_bytes())
        else:
            out[name] = Source(name, field, uri, uri, read_bytes(uri, cfg.storage_options, field))
    return out


def _parse(cfg: DataConfig, sources: dict[str, Source]) -> dict[str, list[dict]]:
    s = sources
    records = {
        "sft": parse_sft(s["sft"].data, s["sft"].uri, s["sft"].field),
        "preference": parse_preferences(s["preference"].data, s["preference"].uri, s["preference"].field),
        "prompts": parse_prompts(s["prompts"].data, s["prompts"].uri, s["prompts"].field, cfg.prompt_template),
        "ptx": parse_ptx(s["ptx"].data, s["ptx"].uri, s["ptx"].field),
    }
    for name in SPLIT:
        if len(records[name]) < 2:
            raise DataError(f"{s[name].field} {s[name].shown!r} has {len(records[name])} record; "
                            "at least 2 are needed to split train/eval: add records")
    return records


def check_data(cfg: DataConfig) -> dict[str, int]:
    """Pre-flight: every source is reachable and parses. Returns the record count per source."""
    with tempfile.TemporaryDirectory(prefix="rlhf-data-") as tmp:
        return {name: len(recs) for name, recs in _parse(cfg, _load_sources(cfg, tmp)).items()}


def _key_config(cfg: DataConfig, model: ModelConfig, seed: int, sources: dict[str, Source]) -> dict:
    # Sources enter by content hash, not URI: the same bytes elsewhere give the same key.
    # storage_options (endpoints) never change what is read.
    data = cfg.model_dump(mode="json", exclude={"storage_options", "builtin_seed", *SOURCES.values()})
    return {"data": data, "sources": {n: s.sha256 for n, s in sources.items()}, "model": model.identity(), "seed": seed}


def data_key(cfg: DataConfig, model: ModelConfig, seed: int) -> str:
    """``data/<fingerprint>`` of the dataset these sources, this config and tokenizer make."""
    with tempfile.TemporaryDirectory(prefix="rlhf-data-") as tmp:
        return _data_key(_key_config(cfg, model, seed, _load_sources(cfg, tmp)))


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


def group_lines(lines: list[list[int]], max_length: int, short_text: bool = False) -> tuple[list[list[int]], int]:
    """Plain-text samples from tokenized lines (each already ending with EOS): (samples, lines split).

    A line longer than ``max_length`` is cut into chunks. Unless ``short_text``, adjacent pieces
    are concatenated while they fit; the piece that would overflow a group starts the next one
    (the seed dropped it).
    """
    pieces, n_split = [], 0
    for ids in lines:
        n_split += len(ids) > max_length
        pieces += [ids[i:i + max_length] for i in range(0, len(ids), max_length)]
    if short_text:
        return pieces, n_split
    groups, cur = [], []
    for p in pieces:
        if cur and len(cur) + len(p) > max_length:
            groups.append(cur)
            cur = []
        cur = cur + p
    if cur:
        groups.append(cur)
    return groups, n_split


# -- building the files ------------------------------------------------------------------------
def _lm_samples(enc: Encoder, records: list[dict], stats: dict, name: str) -> list[dict]:
    samples, lines, L = [], [], enc.cfg.max_length
    for r in records:
        if "text" in r:
            lines.append(enc.enc(r["text"]) + [enc.eos])
            continue
        if "messages" in r:
            ids, labels = enc.messages(r["messages"])
            truncated = len(ids) > L
            ids, labels = ids[:L], labels[:L]
        else:
            ids, labels, truncated = enc.prompt_response(r["prompt"], r["response"])
        stats["truncated"][name] += truncated
        if all(x == -100 for x in labels):  # truncation left no response token: nothing to learn
            stats["dropped"][f"{name}_no_labels"] += 1
            continue
        samples.append({"input_ids": ids, "labels": labels})
    groups, stats["lines_split"][name] = group_lines(lines, L, enc.cfg.short_text)
    return samples + [{"input_ids": g, "labels": list(g)} for g in groups]


def _pair_samples(enc: Encoder, records: list[dict], stats: dict) -> list[dict]:
    samples, L = [], enc.cfg.max_length
    for rec in records:
        p, c, r = enc.pair(rec)
        room = L - max(len(c), len(r))
        if room < 1:  # the response alone does not fit: no prompt left to score it against
            stats["dropped"]["preference_response_too_long"] += 1
            continue
        if len(p) > room:
            p = truncate_left(p, room, enc.prefix)
            stats["truncated"]["preference"] += 1
        samples.append({"chosen_ids": p + c, "rejected_ids": p + r, "prompt_len": len(p)})
    return samples


def _prompt_samples(enc: Encoder, records: list[dict], stats: dict) -> list[dict]:
    samples, n = [], enc.cfg.max_prompt_length
    for rec in records:
        text = enc.render_prompt(rec)
        ids = (enc.prefix if "prompt" in rec else []) + enc.enc(text)
        if len(ids) > n:  # keep the end: the generation prompt must stay where the response starts
            ids = truncate_left(ids, n, enc.prefix)
            body = ids[len(enc.prefix):] if enc.prefix and ids[: len(enc.prefix)] == enc.prefix else ids
            text = enc.tok.decode(body)
            stats["truncated"]["prompts"] += 1
        samples.append({"prompt_ids": ids, "prompt": text})
    return samples


def _check_chat(tok, model: ModelConfig, records: dict[str, list[dict]], sources: dict[str, Source]) -> None:
    if tok.chat_template:
        return
    for name, recs in records.items():
        if any("messages" in r or "prompt_messages" in r for r in recs):
            s = sources[name]
            raise DataError(f"{s.field} {s.shown!r} has chat `messages` records, but the tokenizer of model.pretrain "
                            f"{model.pretrain!r} has no chat template; use prompt/response records or set "
                            "model.tokenizer to a tokenizer with a chat template")


def _write_files(out: Path, enc: Encoder, records: dict[str, list[dict]], seed: int, sources: dict[str, Source]) -> dict:
    stats = {"truncated": dict.fromkeys(SOURCES, 0), "dropped": {"sft_no_labels": 0, "ptx_no_labels": 0,
             "preference_response_too_long": 0}, "lines_split": {}}
    samples = {
        "sft": _lm_samples(enc, records["sft"], stats, "sft"),
        "pref": _pair_samples(enc, records["preference"], stats),
        "prompts": _prompt_samples(enc, records["prompts"], stats),
    }
    ptx = _lm_samples(enc, records["ptx"], stats, "ptx")
    counts = {}
    for prefix, source in (("sft", "sft"), ("pref", "preference"), ("prompts", "prompts")):
        s, got = sources[source], samples[prefix]
        if len(got) < 2:
            raise DataError(f"{s.field} {s.shown!r}: {len(records[source])} records gave {len(got)} samples "
                            f"(max_length {enc.cfg.max_length}, dropped {stats['dropped']}); at least 2 are needed "
                            "to split train/eval: raise data.max_length, add data, or set data.short_text=true for plain text")
        train, held = split_indices(len(got), enc.cfg.eval_fraction, seed)
        counts[f"{prefix}_train.jsonl"] = write_jsonl(out / f"{prefix}_train.jsonl", (got[i] for i in train))
        counts[f"{prefix}_eval.jsonl"] = write_jsonl(out / f"{prefix}_eval.jsonl", (got[i] for i in held))
    counts["ptx_train.jsonl"] = write_jsonl(out / "ptx_train.jsonl", ptx)
    return {"counts": counts, **stats}


def prepare_data(cfg: DataConfig, model: ModelConfig, store: ArtifactStore, seed: int, *, key: str | None = None,
                 force: bool = False) -> ArtifactRef:
    """Tokenize the sources into the ``dataset`` artifact at ``data_key``; reuse it when it exists."""
    with tempfile.TemporaryDirectory(prefix="rlhf-data-") as tmp:
        sources = _load_sources(cfg, tmp)
        key_config = _key_config(cfg, model, seed, sources)
        key = key or _data_key(key_config)  # the flow hands the key it computed
        if not force and store.is_good(key):  # a damaged artifact is rebuilt
            return store.ref(key)
        records = _parse(cfg, sources)  # every data error is raised here, before the tokenizer loads
        tok = load_tokenizer(model)
        _check_chat(tok, model, records, sources)
        out = Path(tmp) / "artifact"
        out.mkdir()
        stats = _write_files(out, Encoder(tok, cfg), records, seed, sources)
        tok.save_pretrained(out / "tokenizer")
        meta = {
            **stats,
            "max_length": cfg.max_length,
            "max_prompt_length": cfg.max_prompt_length,
            "templates": {"prompt": cfg.prompt_template, "response": cfg.response_template, "chat": tok.chat_template},
            "sources": {n: {"uri": s.shown, "sha256": s.sha256, "records": len(records[n])} for n, s in sources.items()},
            "seed": seed,
            "eval_fraction": cfg.eval_fraction,
            "short_text": cfg.short_text,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        metrics = {f"data/{f.removesuffix('.jsonl')}": n for f, n in stats["counts"].items()}
        metrics["data/truncated"] = sum(stats["truncated"].values())
        metrics["data/dropped"] = sum(stats["dropped"].values())
        return store.publish(key, out, kind="dataset", config=key_config, metrics=metrics)
