"""Parsers of the data sources into plain records. Pure: fsspec, json, csv; no tokenizer.

Each ``read_*`` takes a URI (any fsspec protocol) and returns a list of dicts; the matching
``parse_*`` takes the bytes, so data prep can hash a file and parse it from one read. Text is
strict UTF-8, and every error is a ``DataError`` that names the config field, the URI, the line
and the fix. Record shapes:

- SFT / ptx: ``{"text"}``, ``{"prompt", "response"}`` or ``{"messages": [{role, content}]}``
- prompts: ``{"prompt"}`` or ``{"messages"}`` (the conversation before the answer)
- preference pairs: ``{"prompt", "chosen", "rejected"}`` (strings) or
  ``{"prompt_messages", "chosen_messages", "rejected_messages"}`` (chosen/rejected hold only the
  completion turns)
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any, Mapping

import fsspec

ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A data source is unreadable or malformed; the message names the field, line and fix."""


# -- reading bytes -----------------------------------------------------------------------------
def read_bytes(uri: str, storage_options: Mapping[str, Any] | None = None, field: str = "data") -> bytes:
    try:
        with fsspec.open(uri, "rb", **dict(storage_options or {})) as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{field} {uri!r}: no such file; check the path (and data.storage_options for remote stores)") from None
    except IsADirectoryError:
        raise DataError(f"{field} {uri!r} is a directory; point it at one data file") from None
    except (ValueError, ImportError) as e:  # unknown protocol, bad URL: fsspec says which
        raise DataError(f"{field} {uri!r} cannot be opened ({e}); use a local path or an installed fsspec protocol (file://, memory://, s3://)") from None


def extension(uri: str) -> str:
    name = uri.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return "." + name.rsplit(".", 1)[1].lower() if "." in name else ""


def _decode(data: bytes, uri: str, field: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{field} {uri!r} line {line}: bytes {data[e.start:e.end]!r} are not UTF-8; "
            "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    if not text.strip():
        raise DataError(f"{field} {uri!r} is empty; it needs at least one record")
    return text.removeprefix("\ufeff")  # a BOM from Windows editors is not part of the first record


def _check_ext(uri: str, field: str, allowed: tuple[str, ...], what: str) -> str:
    ext = extension(uri)
    if ext not in allowed:
        raise DataError(f"{field} {uri!r}: unknown extension {ext or '(none)'!r}; {what} can be {', '.join(allowed)}")
    return ext


def _lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) of the non-blank lines, without the newline."""
    return [(i, line.rstrip("\r")) for i, line in enumerate(text.split("\n"), 1) if line.strip()]


def _jsonl(text: str, uri: str, field: str) -> list[tuple[int, dict]]:
    out = []
    for n, line in _lines(text):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{field} {uri!r} line {n}: malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DataError(f"{field} {uri!r} line {n}: a JSON {type(obj).__name__}, not an object; each line must be one JSON object like {{\"prompt\": ...}}")
        out.append((n, obj))
    return out


# -- field checks ------------------------------------------------------------------------------
def _str(obj: dict, key: str, where: str) -> str:
    v = obj[key]
    if not isinstance(v, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(v).__name__} {v!r}"[:300] + "; write it as JSON text")
    if not v.strip():
        raise DataError(f"{where}: {key!r} is empty; give it some text or remove the line")
    return v


def _messages(v: Any, key: str, where: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects, got {type(v).__name__}")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content', got {m!r}"[:300])
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {key}[{i}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _missing(obj: dict, where: str, need: str) -> DataError:
    return DataError(f"{where}: found keys {sorted(obj)}; each line needs {need}")


# -- SFT and ptx -------------------------------------------------------------------------------
def _lm_record(obj: dict, where: str, allow_messages: bool) -> dict:
    if "prompt" in obj or "response" in obj:
        for key in ("prompt", "response"):
            if key not in obj:
                raise DataError(f"{where}: missing key {key!r}; a prompt/response line needs both")
        return {"prompt": _str(obj, "prompt", where), "response": _str(obj, "response", where)}
    if allow_messages and "messages" in obj:
        msgs = _messages(obj["messages"], "messages", where)
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: 'messages' has no assistant turn, so there is nothing to learn; add one or drop the line")
        return {"messages": msgs}
    if "text" in obj:
        return {"text": _str(obj, "text", where)}
    raise _missing(obj, where, "prompt+response, messages or text" if allow_messages else "text or prompt+response")


def _parse_lm(data: bytes, uri: str, field: str, what: str, allow_messages: bool) -> list[dict]:
    ext = _check_ext(uri, field, (".txt", ".jsonl"), what)
    text = _decode(data, uri, field)
    if ext == ".txt":
        return [{"text": line} for _, line in _lines(text)]
    return [_lm_record(obj, f"{field} {uri!r} line {n}", allow_messages) for n, obj in _jsonl(text, uri, field)]


def parse_sft(data: bytes, uri: str, field: str = "data.sft_path") -> list[dict]:
    return _parse_lm(data, uri, field, "SFT data", allow_messages=True)


def parse_ptx(data: bytes, uri: str, field: str = "data.ptx_path") -> list[dict]:
    return _parse_lm(data, uri, field, "ptx data", allow_messages=False)


# -- prompts -----------------------------------------------------------------------------------
def strip_answer(line: str, prompt_template: str | None) -> str:
    """The prompt part of a line that may carry a rendered exchange.

    The seed dropped the answer after its separator ("回答："); we take the separator from the
    template: text after the response marker (what follows ``{prompt}``, e.g. "Assistant:") is
    the answer, and a leading prompt marker ("Human:") is dropped so it is not rendered twice.
    """
    if not prompt_template or "{prompt}" not in prompt_template:
        return line.strip()
    head, tail = (s.strip() for s in prompt_template.split("{prompt}", 1))
    if tail and tail in line:
        line = line.split(tail, 1)[0]
    line = line.strip()
    if head and line.startswith(head):
        line = line[len(head):]
    return line.strip()


def _prompt_record(obj: dict, where: str) -> dict:
    if "prompt" in obj:
        return {"prompt": _str(obj, "prompt", where)}
    if "messages" in obj:
        msgs = _messages(obj["messages"], "messages", where)
        while msgs and msgs[-1]["role"] == "assistant":  # the answer part, as for .txt lines
            msgs.pop()
        if not msgs:
            raise DataError(f"{where}: 'messages' holds only assistant turns; a prompt needs a user turn")
        return {"messages": msgs}
    raise _missing(obj, where, "prompt (a string) or messages")


def parse_prompts(data: bytes, uri: str, field: str = "data.prompts_path", prompt_template: str | None = None) -> list[dict]:
    ext = _check_ext(uri, field, (".txt", ".csv", ".jsonl"), "prompts")
    text = _decode(data, uri, field)
    if ext == ".jsonl":
        return [_prompt_record(obj, f"{field} {uri!r} line {n}") for n, obj in _jsonl(text, uri, field)]
    if ext == ".txt":
        out = []
        for n, line in _lines(text):
            prompt = strip_answer(line, prompt_template)
            if not prompt:
                raise DataError(f"{field} {uri!r} line {n}: no prompt left once the answer part is dropped ({line!r}); write the prompt before the response marker")
            out.append({"prompt": prompt})
        return out
    reader = csv.DictReader(io.StringIO(text, newline=""))
    columns = [c.strip() for c in reader.fieldnames or []]
    if "prompt" not in columns:
        raise DataError(f"{field} {uri!r}: no 'prompt' column; the columns found are {columns}; name the prompt column 'prompt' in the header row")
    reader.fieldnames = columns
    out = []
    for row in reader:
        prompt = (row.get("prompt") or "").strip()
        if not prompt:
            raise DataError(f"{field} {uri!r} line {reader.line_num}: the 'prompt' cell is empty; fill it or remove the row")
        out.append({"prompt": prompt})
    return out


# -- preference pairs --------------------------------------------------------------------------
def _completion(v: Any, key: str, prompt_msgs: list[dict], where: str) -> list[dict]:
    msgs = _messages(v, key, where)
    if msgs[: len(prompt_msgs)] == prompt_msgs:  # HH style: the full conversation, prompt included
        msgs = msgs[len(prompt_msgs):]
    if not msgs or msgs[-1]["role"] != "assistant":
        raise DataError(f"{where}: {key!r} must end with an assistant turn after the prompt turns")
    return msgs


def _common_prefix(a: list[dict], b: list[dict]) -> list[dict]:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return a[:n]


def _pair_record(obj: dict, where: str) -> dict:
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise DataError(f"{where}: missing key {key!r}; each line needs prompt, chosen, rejected")
    as_messages = isinstance(obj["chosen"], list) or isinstance(obj["rejected"], list)
    if not as_messages:
        if "prompt" not in obj:
            raise DataError(f"{where}: missing key 'prompt'; each line needs prompt, chosen, rejected")
        return {k: _str(obj, k, where) for k in ("prompt", "chosen", "rejected")}
    if "prompt" in obj:
        p = obj["prompt"]
        prompt_msgs = [{"role": "user", "content": _str(obj, "prompt", where)}] if isinstance(p, str) else _messages(p, "prompt", where)
    else:  # the prompt is the conversation the two share
        prompt_msgs = _common_prefix(_messages(obj["chosen"], "chosen", where), _messages(obj["rejected"], "rejected", where))
        if not prompt_msgs:
            raise DataError(f"{where}: no 'prompt' and chosen/rejected share no leading turns; add a 'prompt' key")
    return {
        "prompt_messages": prompt_msgs,
        "chosen_messages": _completion(obj["chosen"], "chosen", prompt_msgs, where),
        "rejected_messages": _completion(obj["rejected"], "rejected", prompt_msgs, where),
    }


def parse_preferences(data: bytes, uri: str, field: str = "data.preference_path") -> list[dict]:
    _check_ext(uri, field, (".jsonl",), "preference pairs")
    text = _decode(data, uri, field)
    return [_pair_record(obj, f"{field} {uri!r} line {n}") for n, obj in _jsonl(text, uri, field)]


# -- from a URI --------------------------------------------------------------------------------
# The extension is checked before the read, so a wrong name fails without a download.
def read_sft(uri: str, storage_options: Mapping[str, Any] | None = None, field: str = "data.sft_path") -> list[dict]:
    _check_ext(uri, field, (".txt", ".jsonl"), "SFT data")
    return parse_sft(read_bytes(uri, storage_options, field), uri, field)


def read_ptx(uri: str, storage_options: Mapping[str, Any] | None = None, field: str = "data.ptx_path") -> list[dict]:
    _check_ext(uri, field, (".txt", ".jsonl"), "ptx data")
    return parse_ptx(read_bytes(uri, storage_options, field), uri, field)


def read_prompts(uri: str, storage_options: Mapping[str, Any] | None = None, field: str = "data.prompts_path",
                 prompt_template: str | None = None) -> list[dict]:
    _check_ext(uri, field, (".txt", ".csv", ".jsonl"), "prompts")
    return parse_prompts(read_bytes(uri, storage_options, field), uri, field, prompt_template)


def read_preferences(uri: str, storage_options: Mapping[str, Any] | None = None, field: str = "data.preference_path") -> list[dict]:
    _check_ext(uri, field, (".jsonl",), "preference pairs")
    return parse_preferences(read_bytes(uri, storage_options, field), uri, field)
