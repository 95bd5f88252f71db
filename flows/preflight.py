"""Every check that needs no model: run before a stage starts, so a bad run fails in seconds."""

from __future__ import annotations

import socket
import uuid
from urllib.parse import urlparse

from flows.config import ConfigError, PipelineConfig
from flows.runtime import ray_address


def check_ray_address(address: str | None) -> None:
    """An address we would connect to (``ray.address`` or $RAY_ADDRESS) must answer (a TCP connect, 5 s)."""
    if not address or address in ("auto", "local"):
        return
    url = urlparse(address if "://" in address else f"tcp://{address}")
    if not url.hostname or not url.port:
        raise ConfigError(f"`ray.address` ({address!r}): expected host:port or ray://host:10001, or 'auto' for the local cluster")
    try:
        socket.create_connection((url.hostname, url.port), timeout=5).close()
    except OSError as e:
        raise ConfigError(f"`ray.address` ({address!r}): nothing answers at {url.hostname}:{url.port} ({e.strerror or e}); "
                          "start the cluster (`ray start --head`), fix the address, or unset it to run a local Ray") from None


def check_local_gpus(cfg: PipelineConfig) -> None:
    """A local Ray gets the GPUs torch sees: asking for more, or for fractions that do not fit
    on them, can never schedule. Judges the config as resolved for those GPUs."""
    from flows.config import local_gpus, resolve_resources
    from tasks.ppo.config import ROLES, check_gpu_fit

    have = local_gpus(cfg.ray)
    if have is None:
        return  # the PPO stage checks the cluster's resources itself
    cfg = resolve_resources(cfg, have)
    for stage, r in cfg.resources.items():
        if r.num_gpus > have:
            raise ConfigError(f"`resources.{stage}.num_gpus` ({r.num_gpus}): this machine has {have} GPU(s) for a local Ray; "
                              f"set it to 0 or run against a cluster with GPUs (`ray.address`)")
    if have == 0:
        for role in ROLES:
            g = cfg.ppo.role(role).gpus_per_worker
            if g > 0:
                raise ConfigError(f"`ppo.{role}.gpus_per_worker` ({g}): no GPU here (torch sees none); set it to 0 on CPU")
    check_gpu_fit(cfg.ppo, have, "this machine (a local Ray)")
    from tasks.ppo.train import check_ppo_memory

    check_ppo_memory(cfg.ppo, cfg.model, have)


_STORE_FIX = {
    "s3": "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE in the "
          "environment), that the bucket exists, and store.storage_options.client_kwargs.endpoint_url",
    "local": "make the folder writable by this user (and check the disk has free space) or point store.uri elsewhere",
}


def check_store(cfg: PipelineConfig) -> None:
    """The artifact root opens and takes a write: a probe file is written and removed at once.

    A bad scheme, wrong credentials, a missing bucket or a read-only or full disk fails here, in
    seconds, instead of when the first stage publishes after minutes of training."""
    from storage.store import ArtifactStore

    uri = cfg.store.resolved_uri()
    try:
        store = ArtifactStore(uri, cfg.store.storage_options)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"`store.uri` ({cfg.store.uri!r}): {e}") from None
    except OSError as e:
        raise ConfigError(f"`store.uri` ({cfg.store.uri!r}): {e}; {_STORE_FIX['local']}") from None
    # names starting with '.' can never be artifact keys, so a probe left by a crash is ignored
    probe = f"{store.root}/.rlhf-preflight-{uuid.uuid4().hex[:12]}"
    try:
        store.fs.pipe_file(probe, b"preflight write probe\n")
        store.fs.rm_file(probe)
    except Exception as e:  # PermissionError, FileNotFoundError (no bucket), OSError (ENOSPC), botocore errors
        fix = _STORE_FIX["local"] if store.local else _STORE_FIX["s3"] if "s3" in str(store.fs.protocol) else \
            "check the credentials and endpoint for this protocol (store.storage_options) and that the root exists"
        raise ConfigError(f"`store.uri` ({cfg.store.uri!r}): cannot write to the artifact store "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}); {fix}") from None


def check_tokenizer(cfg: PipelineConfig) -> None:
    """The tokenizer loads and has a pad (or eos) token, and ``ppo.stop_token_ids`` /
    ``ppo.stop_strings`` are tokens of it: cheap, and no weights are read."""
    from tasks.common.model import load_tokenizer
    from tasks.ppo.train import resolve_stop_ids

    try:
        tok = load_tokenizer(cfg.model)
    except OSError as e:
        field = "model.tokenizer" if cfg.model.tokenizer else "model.pretrain"
        raise ConfigError(f"`{field}` ({cfg.model.tokenizer or cfg.model.pretrain!r}): no tokenizer could be loaded "
                          f"({type(e).__name__}: {str(e).splitlines()[0]}); point it at a folder or hub name with tokenizer files") from None
    resolve_stop_ids(cfg.ppo, cfg.model, tok)


def check_lora_targets(cfg: PipelineConfig) -> None:
    """LoRA target names against a weightless (meta-device) skeleton of the model."""
    from tasks.common.lora import model_skeleton, resolve_target_modules

    resolve_target_modules(cfg.sft.target_modules, model_skeleton(cfg.model), builtin=cfg.model.is_builtin, field="sft.target_modules")
    if cfg.rm.lora_rank > 0:
        resolve_target_modules(cfg.rm.target_modules, model_skeleton(cfg.model, body_only=True), field="rm.target_modules")


_KEYS: dict[str, dict[str, str]] = {}  # config -> its known keys, once the input checks passed
_BUILDS_CHECKED: set[str] = set()  # configs whose build checks passed too


def preflight(cfg: PipelineConfig) -> dict[str, str]:
    """Every check that needs no model, before any server, Ray or model starts; returns the keys
    known now (``flows.plan.known_keys``).

    What a run reads is always checked: the store takes a write, every data source parses (its
    content hash keys the data stage). What a build loads (Ray address, GPUs, strategy library,
    model, tokenizer, LoRA targets) is checked only when a stage will build: when every stage is
    a hit, an artifact was built at each key, from this same config and code, and nothing loads.
    Memoised per process: the CLI checks before it starts the server, the flow again.
    """
    from flows.plan import all_hit, known_keys, open_store
    from tasks.common.model import check_model_exists
    from tasks.data.prepare import check_data

    fingerprint = cfg.model_dump_json()
    if fingerprint not in _KEYS:
        _checked(lambda: check_store(cfg), lambda: check_data(cfg.data))
        _KEYS[fingerprint] = _checked(lambda: known_keys(cfg, open_store(cfg)))
    keys = _KEYS[fingerprint]
    if fingerprint in _BUILDS_CHECKED or all_hit(cfg, open_store(cfg), keys):
        return keys
    from tasks.ppo.rewards import check_reward_sources
    from tasks.ppo.train import check_ppo

    _checked(lambda: check_ray_address(ray_address(cfg.ray)), lambda: check_local_gpus(cfg), lambda: check_ppo(cfg.ppo),
             lambda: check_model_exists(cfg.model), lambda: check_tokenizer(cfg), lambda: check_data(cfg.data, cfg.model),
             lambda: check_lora_targets(cfg), lambda: check_reward_sources(cfg.ppo, cfg.data.prompt_metadata))
    _BUILDS_CHECKED.add(fingerprint)
    return keys


def _checked(*fns):
    """Run the checks in order; a ValueError or FileNotFoundError is the user's input: a ConfigError."""
    out = None
    for fn in fns:
        try:
            out = fn()
        except ConfigError:
            raise
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
    return out
