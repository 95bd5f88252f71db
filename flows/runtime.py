"""Where the flow runs: the Ray task runner from config, and a local Prefect server for the CLI."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(api: str) -> bool:
    try:
        urllib.request.urlopen(api + "/health", timeout=2)
        return True
    except Exception:
        return False


class LocalPrefectServer:
    """``prefect server start`` on 127.0.0.1 for the length of a CLI run, unless one is configured.

    Prefect's ephemeral mode would start a temporary server in every Ray worker; one real server
    records the whole run (``prefect server start`` later shows it in the UI, same database).
    """

    def __init__(self, timeout_s: float = 90):
        self.timeout_s, self.proc, self.api = timeout_s, None, None

    def __enter__(self) -> "LocalPrefectServer":
        if os.environ.get("PREFECT_API_URL"):
            return self
        port = _free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
        home.mkdir(parents=True, exist_ok=True)
        log = open(home / "rlhf-server.log", "ab")
        self.proc = subprocess.Popen(
            # `python -m prefect`, not <python's folder>/prefect: packages may come from PYTHONPATH or a user site
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        )
        deadline = time.time() + self.timeout_s
        while not _healthy(self.api):
            if self.proc.poll() is not None or time.time() > deadline:
                self.__exit__()
                raise RuntimeError(f"the local Prefect server did not start; see {home / 'rlhf-server.log'} "
                                   "(or set PREFECT_API_URL to a running server)")
            time.sleep(0.3)
        os.environ["PREFECT_API_URL"] = self.api
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        os.environ.pop("PREFECT_API_URL", None)
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc = None
