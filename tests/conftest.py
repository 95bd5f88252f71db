"""Shared fixtures: real servers on 127.0.0.1, started once per session.

- ``s3_server``: moto's S3 API server (a real HTTP S3 endpoint for s3fs), with a bucket.
- ``ray_cluster``: a local Ray (no dashboard), shut down at the end.
- ``mlflow_server``: a real ``mlflow server`` (sqlite backend) on a free loopback port.
- ``prefect_api``: a real ``prefect server start`` on a free loopback port; PREFECT_API_URL is
  exported so flows, tasks and Ray workers started afterwards report to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# As `rlhf` sets it (flows/console.py RUN_ENV): stage functions called outside a flow log to rlhf.*
# too, once a test's `main()` has made it a Prefect extra logger.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches_on_cuda():
    """On a GPU, each test module starts with dynamo's caches empty. FastGenerator compiles its
    decode functions on CUDA, and one pytest process of the GPU checks (bench/gpu_run.sh tests)
    builds dozens of generators of other shapes, dtypes and kernels before the decode-attention
    tests: there the RoPE-attention test failed after tests/test_fast_generate.py's 27 tests and
    passed alone (bench/RESULTS.md, 2026-12-07, eleventh session), as recompile limits would make
    it. A user's process builds one or two. On the CPU (CI) nothing is compiled by default: no-op."""
    import torch

    if torch.cuda.is_available():
        torch._dynamo.reset()
    yield


def free_port() -> int:
    """One free port on 127.0.0.1 (tests/ray_nodes.py ``free_ports``: the one picker)."""
    from tests.ray_nodes import free_ports

    return free_ports(1)[0]


def _wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@pytest.fixture(scope="session")
def rlhf_cache(tmp_path_factory) -> Path:
    """One cache (built-in model, downloaded artifacts) for the session, inherited by Ray workers."""
    path = tmp_path_factory.mktemp("rlhf-cache")
    os.environ["RLHF_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def s3_server():
    """(endpoint_url, bucket): a moto S3 server on loopback with one bucket."""
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_http(endpoint, 30, proc)
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            os.environ[k] = v
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="rlhf-test")
        yield endpoint, "rlhf-test"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def ray_cluster(rlhf_cache):
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real Prefect server on 127.0.0.1; yields its API URL."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=open(home / "server.log", "w"), stderr=subprocess.STDOUT, env=env,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        _wait_http(api + "/health", 90, proc)
        os.environ["PREFECT_API_URL"] = api
        os.environ["PREFECT_HOME"] = str(home)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """The tracking URI of a real ``mlflow server`` on 127.0.0.1 with a sqlite backend."""
    import signal

    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
         "--default-artifact-root", str(home / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=open(home / "server.log", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_http(uri + "/health", 120, proc)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the uvicorn worker it started
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
