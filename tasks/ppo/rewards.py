"""Rewards computed by code: a Python function or an HTTP server, beside the trained reward model.

``ppo.rewards`` is a weighted sum of terms (``tasks.ppo.config.RewardSource``). A 'model' term is
the `reward` role group's score; a 'function' or 'http' term is scored by ``score_chunk`` in a Ray
task per rollout chunk, so a slow verifier runs beside the GPU roles, not inside them. Both see
the prompt as rendered for the model (``prompt`` of the dataset's prompt records), the decoded
response, and the record's metadata columns (``data.prompt_metadata``) as keyword lists.

A function: ``fn(prompts: list[str], responses: list[str], **metadata: list) -> list[float]``,
one finite number per response. An HTTP server: POST JSON ``{"prompts": [...], "responses":
[...], "metadata": {...}}``, answer ``{"rewards": [...]}``. Every way these go wrong is a
ValueError or RuntimeError naming ``ppo.rewards[i]``, what came back, and the fix;
``check_reward_sources`` runs the cheap checks (import, signature) before any model loads, and
``probe_reward_sources`` calls each term once on a real prompt before the roles start.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import numbers
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

import torch

from tasks.ppo.config import PPOConfig, RewardSource


def field(i: int) -> str:
    return f"ppo.rewards[{i}]"


def load_function(spec: str, where: str) -> Callable:
    """The callable at ``'package.module:function'``; a ValueError naming ``where`` when it does not
    import, is missing, or cannot take ``(prompts, responses, **metadata)``."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the module failing on its own imports
        raise ValueError(f"{where}.function {spec!r}: module {mod_name!r} does not import ({type(e).__name__}: {e}); "
                         "install it on every node (or put it on PYTHONPATH), or fix the path") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{where}.function {spec!r}: module {mod_name!r} has no callable {fn_name!r}"
                         f"{'' if fn is None else f' (it is a {type(fn).__name__})'}; fix the name after ':'")
    try:
        sig = inspect.signature(fn)
    except ValueError:  # a builtin without a signature: judged when called
        return fn
    try:
        sig.bind_partial(["prompt"], ["response"])  # more required parameters: metadata columns by keyword
    except TypeError as e:
        raise ValueError(f"{where}.function {spec!r} has the signature {fn_name}{sig}, which cannot be called as "
                         f"fn(prompts, responses, **metadata) ({e}): define it as "
                         f"def {fn_name}(prompts, responses, **metadata) -> list[float]") from None
    return fn


def check_metadata_accepted(fn: Callable, spec: str, where: str, columns: Sequence[str]) -> None:
    """``fn`` takes every metadata column as a keyword (or ``**metadata``), and needs no other."""
    try:
        inspect.signature(fn).bind(["prompt"], ["response"], **{c: [None] for c in columns})
    except TypeError as e:
        raise ValueError(f"{where}.function {spec!r} cannot be called with the metadata columns {list(columns)} "
                         f"(data.prompt_metadata) as keywords ({e}): add **metadata to its parameters, or the columns it "
                         "needs to data.prompt_metadata") from None
    except ValueError:
        pass


def as_rewards(out, n: int, where: str) -> torch.Tensor:
    """``out`` (a function's or server's answer) as a (n,) float32 tensor, or a ValueError that says
    what is wrong with it: not a list, the wrong length, a non-number, NaN or inf."""
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().flatten().tolist()
    try:
        values = list(out)
    except TypeError:
        raise ValueError(f"{where} returned {type(out).__name__} {out!r:.80}, not a list of numbers: return one float per response") from None
    if len(values) != n:
        raise ValueError(f"{where} returned {len(values)} rewards for {n} responses: return exactly one float per response, in order")
    bad = [(i, v) for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, numbers.Real)]
    if bad:
        i, v = bad[0]
        raise ValueError(f"{where} returned a non-number at position {i}: {v!r} ({type(v).__name__}); return floats")
    floats = [float(v) for v in values]
    nonfinite = [i for i, v in enumerate(floats) if not math.isfinite(v)]
    if nonfinite:
        raise ValueError(f"{where} returned {floats[nonfinite[0]]} at position {nonfinite[0]} ({len(nonfinite)} non-finite of {n}): "
                         "return finite floats (e.g. 0.0 for a response that cannot be scored)")
    return torch.tensor(floats, dtype=torch.float32)


def call_function(src: RewardSource, where: str, prompts: list[str], responses: list[str], metadata: dict[str, list]) -> torch.Tensor:
    fn = load_function(src.function, where)
    out = fn(prompts, responses, **metadata)
    return as_rewards(out, len(responses), f"{where}.function {src.function!r}")


def call_http(src: RewardSource, where: str, prompts: list[str], responses: list[str], metadata: dict[str, list]) -> torch.Tensor:
    """POST the batch to ``src.url``; retried ``src.retries`` times (1, 2, 4 s ... apart) on a timeout,
    a refused connection or a 5xx; a 4xx or a malformed answer fails at once."""
    body = json.dumps({"prompts": prompts, "responses": responses, "metadata": metadata}).encode()
    last = ""
    for attempt in range(src.retries + 1):
        if attempt:
            time.sleep(min(2 ** (attempt - 1), 30))
        req = urllib.request.Request(src.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=src.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if e.code < 500:
                raise RuntimeError(f"{where}.url {src.url!r} answered {last}: the server refuses the request "
                                   '{"prompts", "responses", "metadata"}; fix the server or the url') from None
            continue
        except (TimeoutError, urllib.error.URLError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            last = "timed out" if isinstance(reason, TimeoutError) or "timed out" in str(reason) else f"{type(reason).__name__}: {reason}"
            continue
        try:
            answer = json.loads(raw)
        except ValueError:
            raise RuntimeError(f"{where}.url {src.url!r} answered {raw[:80]!r}, not JSON: answer {{\"rewards\": [...]}}") from None
        rewards = answer.get("rewards") if isinstance(answer, dict) else answer
        return as_rewards(rewards, len(responses), f"{where}.url {src.url!r}")
    raise RuntimeError(f"{where}.url {src.url!r}: no answer after {src.retries + 1} tries ({last}; timeout_s {src.timeout_s:g} each): "
                       f"start the reward server or fix the url; raise {where}.timeout_s if it is only slow")


def decode_responses(rollout, tokenizer) -> list[str]:
    """Each row's generated tokens up to and including its stop token, decoded without special tokens."""
    n = rollout.action_mask.shape[1]
    return [tokenizer.decode(seq[m].tolist(), skip_special_tokens=True)
            for seq, m in zip(rollout.sequences[:, -n:], rollout.action_mask.bool())]


def score_chunk(src: RewardSource, index: int, rollout, tokenizer, prompts: list[str], metadata: dict[str, list]) -> torch.Tensor:
    """One 'function' or 'http' term's (B,) scores of one rollout chunk (the body of a Ray task)."""
    responses = decode_responses(rollout, tokenizer)
    call = call_function if src.kind == "function" else call_http
    return call(src, field(index), prompts, responses, metadata)


def code_terms(cfg: PPOConfig) -> list[int]:
    """Indices of the terms scored by code (kind 'function' or 'http')."""
    return [i for i, s in enumerate(cfg.rewards) if s.kind != "model"]


def reward_code_version(cfg: PPOConfig) -> dict[str, str]:
    """What of the reward terms' code is part of the PPO key, by term: a function's source (a
    project module's import closure via ``storage.keys.code_version``, another module's own file),
    an HTTP server's url and version (already in the config; the server's code is not visible)."""
    from storage.keys import ROOT, code_version

    out = {}
    for i, src in enumerate(cfg.rewards):
        if src.kind != "function":
            continue
        mod_name = src.function.partition(":")[0]
        load_function(src.function, field(i))
        path = Path(inspect.getsourcefile(importlib.import_module(mod_name)) or "")
        if path.is_file() and path.resolve().is_relative_to(ROOT) and mod_name.split(".")[0] in ("tasks", "storage", "flows"):
            out[str(i)] = code_version(mod_name)
        elif path.is_file():
            out[str(i)] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        else:
            raise ValueError(f"{field(i)}.function {src.function!r}: the source of module {mod_name!r} cannot be read, so it "
                             "cannot key the PPO stage; use a module that is a .py file")
    return out


def check_reward_sources(cfg: PPOConfig, metadata_columns: Sequence[str] | None = None) -> None:
    """Before any model loads: each function imports and takes (prompts, responses, **metadata)
    (with ``metadata_columns`` given, exactly those keywords); each server's host:port takes a
    TCP connection (5 s at most)."""
    import socket
    from urllib.parse import urlparse

    for i, src in enumerate(cfg.rewards):
        if src.kind == "function":
            fn = load_function(src.function, field(i))
            if metadata_columns is not None:
                check_metadata_accepted(fn, src.function, field(i), metadata_columns)
        elif src.kind == "http":
            url = urlparse(src.url)
            port = url.port or (443 if url.scheme == "https" else 80)
            try:
                socket.create_connection((url.hostname, port), timeout=min(5.0, src.timeout_s)).close()
            except OSError as e:
                raise ValueError(f"{field(i)}.url {src.url!r}: nothing answers at {url.hostname}:{port} ({e.strerror or e}); "
                                 "start the reward server, or fix the url") from None


def probe_reward_sources(cfg: PPOConfig, record: dict) -> None:
    """Call every code term once with one real prompt and an empty response (before the roles
    start): a function that raises or returns the wrong thing, a server that is down or times
    out, fails here instead of after the models loaded."""
    meta = {k: [v] for k, v in record.get("metadata", {}).items()}
    for i, src in enumerate(cfg.rewards):
        if src.kind != "model":
            call = call_function if src.kind == "function" else call_http
            call(src, field(i), [record["prompt"]], [""], meta)
