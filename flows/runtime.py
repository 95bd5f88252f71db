"""Where the flow runs: the Ray task runner from config (the CLI's local Prefect server: flows/server.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from flows.config import RayConfig

log = logging.getLogger("rlhf.flow")

# What every Ray worker must see: where Prefect's API is and where our caches live.
_FORWARDED_ENV = ("PREFECT_API_URL", "PREFECT_HOME", "RLHF_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "AWS_ENDPOINT_URL",
                  "FSSPEC_S3_ENDPOINT_URL", "RAY_AUTH_MODE", "PREFECT_LOCAL_STORAGE_PATH",
                  "PREFECT_LOGGING_EXTRA_LOGGERS")


def ray_address(cfg: RayConfig) -> str:
    """The address the run uses: ``ray.address``, else $RAY_ADDRESS, else 'local'.

    'local' always starts a private Ray for the run. Ray's own default (no address) would
    instead attach to whatever cluster ``ray start`` last recorded in its temp dir
    (``<RAY_TMPDIR or /tmp>/ray/ray_current_cluster``), a file that outlives a dead cluster,
    and then reject the local sizing we pass. A cluster on this machine is used only when asked
    for: ``ray.address: auto`` (the recorded one) or its host:port.
    """
    return cfg.address or os.environ.get("RAY_ADDRESS") or "local"


def project_modules() -> list[str]:
    """The project's packages, shipped with the job (runtime_env ``py_modules``) to a cluster's
    nodes: they need the same Python environment, not a checkout, and run the driver's code."""
    import flows
    import storage
    import tasks

    return [str(Path(m.__file__).parent) for m in (flows, storage, tasks)]


def ray_init_kwargs(cfg: RayConfig) -> dict:
    from flows.console import MODE_ENV, RUN_ENV

    env = {k: os.environ[k] for k in (*_FORWARDED_ENV, *RUN_ENV, MODE_ENV) if k in os.environ}
    # logging_level: no "Started a local Ray instance" line; Ray's warnings still print.
    kwargs: dict = {"runtime_env": {"env_vars": env}, "log_to_driver": True, "logging_level": logging.WARNING}
    if ray_address(cfg) == "local":  # a local Ray: we size it; its workers see this checkout
        kwargs["num_cpus"] = cfg.num_cpus or max(8, os.cpu_count() or 1)
        if cfg.num_gpus is not None:
            kwargs["num_gpus"] = cfg.num_gpus
        kwargs["include_dashboard"] = cfg.dashboard
        if cfg.dashboard:
            kwargs["dashboard_host"] = cfg.dashboard_host
    else:
        kwargs["runtime_env"].update(py_modules=project_modules(), excludes=["__pycache__"])
    return kwargs


def ray_task_runner(cfg: RayConfig):
    from prefect_ray import RayTaskRunner

    address = ray_address(cfg)
    log.info("Ray: %s", "a private local Ray for this run (set ray.address to use a cluster)" if address == "local"
             else f"the cluster at {address}")
    return RayTaskRunner(address=address, init_kwargs=ray_init_kwargs(cfg))
