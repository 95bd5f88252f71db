"""Every check that needs no model: run before a stage starts, so a bad run fails in seconds."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from flows.config import ConfigError, PipelineConfig


def check_ray_address(address: str | None) -> None:
    """An address we would connect to must answer (a TCP connect, 5 s)."""
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
    """A local Ray gets the GPUs torch sees: asking for more can never schedule."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return  # the PPO stage checks the cluster's resources itself
    import torch

    have = cfg.ray.num_gpus if cfg.ray.num_gpus is not None else torch.cuda.device_count()
    for stage, r in cfg.resources.items():
        if r.num_gpus > have:
            raise ConfigError(f"`resources.{stage}.num_gpus` ({r.num_gpus}): this machine has {have} GPU(s) for a local Ray; "
                              f"set it to 0 or run against a cluster with GPUs (`ray.address`)")
    for role in ("actor", "critic", "initial", "reward"):
        g = getattr(cfg.ppo, role).gpus_per_worker
        if g > 0 and have == 0:
            raise ConfigError(f"`ppo.{role}.gpus_per_worker` ({g}): no GPU here (torch sees none); set it to 0 on CPU")


def preflight(cfg: PipelineConfig) -> None:
    from tasks.common.model import check_model_exists
    from tasks.data.prepare import check_data
    from tasks.ppo.train import check_ppo

    for fn in (lambda: check_ray_address(cfg.ray.address), lambda: check_local_gpus(cfg), lambda: check_data(cfg.data),
               lambda: check_model_exists(cfg.model), lambda: check_ppo(cfg.ppo)):
        try:
            fn()
        except ConfigError:
            raise
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
