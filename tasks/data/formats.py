"""Raw records in their published shapes -> the records data prep tokenizes. Pure: no tokenizer.

Shapes recognised (after ``data.columns`` renames the user's fields to these names):

- SFT / ptx: ``text``; ``prompt`` + ``response`` (or ``completion``, TRL); Alpaca ``instruction``
  (+ ``input``) + ``output``; OpenAI ``messages`` [{role, content}]; ShareGPT ``conversations``
  [{from: human|gpt|system, value}]; TRL conversational prompt/completion (message lists).
- prompts: ``prompt``; ``messages`` / ``conversations`` (the turns before the last answer);
  Alpaca ``instruction`` (+ ``input``); a preference pair (its prompt); a ``.txt`` line.
- preference pairs: ``prompt`` + ``chosen`` + ``rejected`` as strings; ``chosen`` / ``rejected``
  full transcripts with the prompt implicit (Anthropic HH: the prompt is the shared text up to
  the last ``Assistant:``; TRL's implicit prompt); the conversational forms (message lists or a
  single {role, content} dict, with or without ``prompt``).

Output records: ``{"text"}``, ``{"prompt", "response"}``, ``{"messages"}`` (SFT/ptx);
``{"prompt"}`` / ``{"messages"}`` (prompts); ``{"prompt", "chosen", "rejected"}`` or
``{"prompt_messages", "chosen_messages", "rejected_messages"}`` (pairs). ``"verbatim": True``
marks text that already holds its role markers (HH transcripts): data prep does not wrap it in
``data.prompt_template`` again. Degenerate records (empty text, chosen identical to rejected, no
answer to learn) raise ``Drop`` with a reason; the caller counts and skips them. Anything else
malformed is a ``DataError`` naming the field, URI, line or record, and the fix.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence

from tasks.data.sources import DataError, open_source

ROLES = ("system", "user", "assistant")
_ROLE_NAMES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
               "chatgpt": "assistant", "bot": "assistant", "model": "assistant"}
COLUMNS = ("prompt", "response", "chosen", "rejected", "messages", "text")  # what data.columns may map to
KINDS = ("sft", "preference", "prompts", "ptx")
_ASSISTANT_MARKERS = ("\n\nAssistant:", "\nAssistant:", "Assistant:", "ASSISTANT:")
__all__ = ["DataError", "Drop", "normalize", "read_records"]


class Drop(Exception):
    """A degenerate record: counted under ``reason`` and left out."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# -- field checks ------------------------------------------------------------------------------
def _str(obj: Mapping, key: str, where: str, drop: str) -> str:
    v = obj[key]
    if v is None:
        raise Drop(drop)
    if not isinstance(v, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(v).__name__} {v!r}"[:300] + "; write it as text")
    if not v.strip():
        raise Drop(drop)
    return v


def _messages(v: Any, key: str, where: str) -> list[dict]:
    """OpenAI {role, content} or ShareGPT {from, value} turns (a single dict is one turn)."""
    if isinstance(v, dict):
        v = [v]
    if not isinstance(v, list) or not v:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects, got {type(v).__name__}")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {key}[{i}] must be an object with 'role' and 'content', got {m!r}"[:300])
        role, content = (m.get("role"), m.get("content")) if "role" in m else (m.get("from"), m.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(f"{where}: {key}[{i}] must have string 'role' and 'content' (or ShareGPT 'from' and "
                            f"'value'), got {m!r}"[:300])
        if role.lower() not in _ROLE_NAMES:
            raise DataError(f"{where}: {key}[{i}] has role {role!r}; roles are {', '.join(ROLES)} "
                            "(ShareGPT: human, gpt, system)")
        out.append({"role": _ROLE_NAMES[role.lower()], "content": content})
    return out


def _conversation(obj: Mapping) -> str | None:
    return next((k for k in ("messages", "conversations") if k in obj), None)


def _alpaca_prompt(obj: Mapping, where: str) -> str:
    """Alpaca's instruction, with its optional input after a blank line."""
    instruction = _str(obj, "instruction", where, "empty_prompt")
    extra = obj.get("input")
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{where}: 'input' must be a string, got {type(extra).__name__}")
    return f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction


def _missing(obj: Mapping, where: str, need: str) -> DataError:
    return DataError(f"{where}: found keys {sorted(obj)}; a record needs {need}, "
                     "or map your field names with data.columns (e.g. --set data.columns.prompt=question)")


# -- SFT and ptx -------------------------------------------------------------------------------
def _with_answer(msgs: list[dict]) -> list[dict]:
    if not any(m["role"] == "assistant" for m in msgs):
        raise Drop("no_assistant_turn")
    if not any(m["content"].strip() for m in msgs if m["role"] == "assistant"):
        raise Drop("empty_response")
    return msgs


def lm_record(obj: Any, where: str) -> dict:
    if isinstance(obj, str):  # a .txt line
        return {"text": obj}
    if conv := _conversation(obj):
        return {"messages": _with_answer(_messages(obj[conv], conv, where))}
    answer = next((k for k in ("response", "completion") if k in obj), None)
    if "prompt" in obj and answer:
        p, a = obj["prompt"], obj[answer]
        if isinstance(p, (list, dict)) or isinstance(a, (list, dict)):  # TRL conversational prompt-completion
            prompt = _messages(p, "prompt", where) if isinstance(p, (list, dict)) else [{"role": "user", "content": _str(obj, "prompt", where, "empty_prompt")}]
            done = _messages(a, answer, where) if isinstance(a, (list, dict)) else [{"role": "assistant", "content": _str(obj, answer, where, "empty_response")}]
            return {"messages": _with_answer(prompt + done)}
        return {"prompt": _str(obj, "prompt", where, "empty_prompt"), "response": _str(obj, answer, where, "empty_response")}
    if "prompt" in obj or "response" in obj:
        raise DataError(f"{where}: missing key {'response' if 'prompt' in obj else 'prompt'!r}; a prompt/response record needs both")
    if "instruction" in obj and "output" in obj:
        return {"prompt": _alpaca_prompt(obj, where), "response": _str(obj, "output", where, "empty_response")}
    if "text" in obj:
        return {"text": _str(obj, "text", where, "empty_text")}
    raise _missing(obj, where, "text, prompt+response, instruction+output (Alpaca), messages or conversations (ShareGPT)")


# -- preference pairs --------------------------------------------------------------------------
def _completion(v: Any, key: str, prompt_msgs: list[dict], where: str) -> list[dict]:
    msgs = _messages(v, key, where)
    if msgs[: len(prompt_msgs)] == prompt_msgs:  # the full conversation, prompt included
        msgs = msgs[len(prompt_msgs):]
    if not msgs or msgs[-1]["role"] != "assistant":
        raise DataError(f"{where}: {key!r} must end with an assistant turn after the prompt turns")
    if not msgs[-1]["content"].strip():
        raise Drop("empty_response")
    return msgs


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n


def split_implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) of two full transcripts: the shared text up to its last
    ``Assistant:`` marker (HH); without one, the shared text up to a word boundary (TRL)."""
    n = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    head = chosen[:n]
    cuts = [head.rfind(m) + len(m) for m in _ASSISTANT_MARKERS if m in head]
    if cuts:
        n = max(cuts)
    else:
        while n > 0 and not chosen[n - 1].isspace():
            n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def pair_record(obj: Any, where: str) -> dict:
    if isinstance(obj, str):
        raise DataError(f"{where}: a line of text; preference pairs need prompt, chosen and rejected fields (.jsonl, .json, .parquet...)")
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise DataError(f"{where}: missing key {key!r}; a preference record needs chosen and rejected "
                            "(and a prompt, unless chosen/rejected are full transcripts); found keys "
                            f"{sorted(obj)}; map other names with data.columns")
    c, r = obj["chosen"], obj["rejected"]
    if c == r:
        raise Drop("chosen_equals_rejected")
    p = obj.get("prompt")
    if isinstance(c, (list, dict)) or isinstance(r, (list, dict)) or isinstance(p, (list, dict)):
        if p is None:  # the prompt is the conversation the two share
            cm, rm = _messages(c, "chosen", where), _messages(r, "rejected", where)
            prompt_msgs = cm[: _common_prefix(cm, rm)]
            if not prompt_msgs:
                raise Drop("no_shared_prompt")
        elif isinstance(p, str):
            prompt_msgs = [{"role": "user", "content": _str(obj, "prompt", where, "empty_prompt")}]
        else:
            prompt_msgs = _messages(p, "prompt", where)
        as_msgs = {k: v if isinstance(v, (list, dict)) else [{"role": "assistant", "content": _str(obj, k, where, "empty_response")}]
                   for k, v in (("chosen", c), ("rejected", r))}
        out = {"prompt_messages": prompt_msgs,
               "chosen_messages": _completion(as_msgs["chosen"], "chosen", prompt_msgs, where),
               "rejected_messages": _completion(as_msgs["rejected"], "rejected", prompt_msgs, where)}
        if out["chosen_messages"] == out["rejected_messages"]:
            raise Drop("chosen_equals_rejected")
        return out
    c, r = _str(obj, "chosen", where, "empty_response"), _str(obj, "rejected", where, "empty_response")
    if p is not None:
        return {"prompt": _str(obj, "prompt", where, "empty_prompt"), "chosen": c, "rejected": r}
    prompt, c, r = split_implicit_prompt(c, r)
    if not prompt.strip():
        raise Drop("no_shared_prompt")
    if not c.strip() or not r.strip():
        raise Drop("empty_response")
    return {"prompt": prompt, "chosen": c, "rejected": r, "verbatim": True}


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


def prompt_record(obj: Any, where: str, prompt_template: str | None = None) -> dict:
    if isinstance(obj, str) or (isinstance(obj, dict) and set(obj) == {"text"}):
        line = obj if isinstance(obj, str) else _str(obj, "text", where, "empty_prompt")
        prompt = strip_answer(line, prompt_template)
        if not prompt:
            raise Drop("empty_prompt")
        return {"prompt": prompt}
    if "chosen" in obj and "rejected" in obj:  # a preference file used for prompts
        pair = pair_record(obj, where)
        if "prompt_messages" in pair:
            return {"messages": pair["prompt_messages"]}
        return {k: v for k, v in pair.items() if k in ("prompt", "verbatim")}
    if "prompt" in obj:
        if isinstance(obj["prompt"], (list, dict)):
            return prompt_record({"messages": obj["prompt"]}, where)
        return {"prompt": _str(obj, "prompt", where, "empty_prompt")}
    if conv := _conversation(obj):
        msgs = _messages(obj[conv], conv, where)
        while msgs and msgs[-1]["role"] == "assistant":  # the answer part, as for .txt lines
            msgs.pop()
        if not msgs:
            raise Drop("no_user_turn")
        return {"messages": msgs}
    if "instruction" in obj:
        return {"prompt": _alpaca_prompt(obj, where)}
    raise _missing(obj, where, "prompt, messages, conversations, instruction (Alpaca), or chosen+rejected")


# -- column mapping and the loop ---------------------------------------------------------------
def source_columns(columns: Mapping[str, str], kind: str) -> tuple[dict[str, str], dict[str, str]]:
    """(required, optional) renames for one source: ``"<kind>.<name>"`` keys must be present in every
    record; plain ``"<name>"`` keys apply where the record has that field."""
    required = {k.split(".", 1)[1]: v for k, v in columns.items() if k.startswith(f"{kind}.")}
    optional = {k: v for k, v in columns.items() if "." not in k and k not in required}
    return required, optional


def _rename(obj: dict, required: Mapping[str, str], optional: Mapping[str, str], where: str, kind: str, used: set) -> dict:
    if not (required or optional) or not isinstance(obj, dict):
        return obj
    obj = dict(obj)
    for name, col in required.items():
        if col not in obj:
            raise DataError(f"{where}: data.columns maps {kind}.{name} to {col!r}, but the record has no {col!r}; "
                            f"found keys {sorted(obj)}; fix data.columns[{kind + '.' + name!r}]")
        obj[name] = obj.pop(col)
    for name, col in optional.items():
        if col in obj:
            obj[name] = obj.pop(col)
            used.add(name)
    return obj


_NORMALISERS = {"sft": lm_record, "ptx": lm_record, "preference": pair_record, "prompts": prompt_record}


def normalize(kind: str, records: Iterable[tuple[str, Any]], *, columns: Mapping[str, str] | None = None,
              prompt_template: str | None = None, dropped: dict | None = None, used: set | None = None,
              metadata: Sequence[str] = ()) -> Iterator[dict]:
    """The data-prep records of one source; degenerate ones are counted in ``dropped[reason]``.
    ``metadata``: fields of a prompts record kept, as they are, under the record's ``metadata``."""
    required, optional = source_columns(columns or {}, kind)
    used = set() if used is None else used
    fn = _NORMALISERS[kind]
    extra = {"prompt_template": prompt_template} if kind == "prompts" else {}
    for where, obj in records:
        try:
            rec = fn(_rename(obj, required, optional, where, kind, used), where, **extra)
            if metadata and kind == "prompts":
                missing = [c for c in metadata if not isinstance(obj, dict) or c not in obj]
                if missing:
                    raise DataError(f"{where}: data.prompt_metadata lists {missing[0]!r} but the record has no such field "
                                    f"(found {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}); add it to every "
                                    "prompts record, or drop it from data.prompt_metadata")
                rec["metadata"] = {c: obj[c] for c in metadata}
            yield rec
        except Drop as d:
            if dropped is not None:
                dropped[d.reason] = dropped.get(d.reason, 0) + 1


def read_records(kind: str, uri: str, storage_options: Mapping[str, Any] | None = None, field: str | None = None,
                 *, columns: Mapping[str, str] | None = None, prompt_template: str | None = None) -> list[dict]:
    """All records of one source as a list (small data and tests; data prep streams)."""
    source = open_source(uri, storage_options, field or f"data.{kind}_path")
    return list(normalize(kind, source.records(), columns=columns, prompt_template=prompt_template))
