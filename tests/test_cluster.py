"""The pipeline on a real multi-node Ray cluster: a head and three worker nodes started with
``ray start`` (tests/ray_nodes.py), the store on s3:// (moto), drivers in subprocesses.

- a plain run (no ray.address) next to a running cluster, or a stale address file, starts a
  private local Ray; ``ray.address: auto`` uses the recorded cluster;
- code reaches worker nodes started from another folder without PYTHONPATH (py_modules);
- ``rlhf run`` with RAY_ADDRESS runs every stage on the worker nodes, the four roles under
  STRICT_SPREAD on four different nodes;
- a placement the cluster cannot hold fails in seconds, naming the bundle and the nodes;
- a worker node killed mid-PPO: the stage fails over and resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.ray_nodes import RayNodes

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# head 1 CPU, three worker nodes of 2 logical CPUs (the machine has 2 cores: Ray counts, torch
# threads stay at 1 per role actor)
WORKER_CPUS = [2, 2, 2]


@pytest.fixture(scope="module")
def cluster(rlhf_cache):
    nodes = RayNodes(WORKER_CPUS, head_cpus=1).start()
    try:
        yield nodes
    finally:
        nodes.stop()


def driver(script: str, env: dict, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``script`` as a separate driver process with this checkout importable (the test
    process itself may hold a local Ray already)."""
    return subprocess.run([PY, "-c", textwrap.dedent(script), *args], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=timeout)


RUNNER = """
    import json, sys
    import ray
    from flows.config import RayConfig
    from flows.runtime import ray_task_runner

    with ray_task_runner(RayConfig(address=sys.argv[1] or None, num_cpus=2)):
        print("RESULT", json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                                    "nodes": sum(n["Alive"] for n in ray.nodes())}))
"""


def runner_result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])


@pytest.mark.slow
def test_a_cluster_on_this_machine_does_not_capture_a_plain_run(cluster):
    """Ray's bare ray.init() attaches to the cluster recorded in <RAY_TMPDIR>/ray/ray_current_cluster
    (RAY_TMPDIR points Ray at the test cluster's private temp dir, as /tmp is for a real one)."""
    env = {**os.environ, "RAY_TMPDIR": str(cluster.tmp)}
    env.pop("RAY_ADDRESS", None)
    assert (cluster.temp_dir / "ray_current_cluster").read_text().strip().endswith(f":{cluster.port}")

    plain = runner_result(driver(RUNNER, env, ""))
    assert plain["nodes"] == 1 and not plain["gcs"].endswith(f":{cluster.port}")  # a private local Ray
    auto = runner_result(driver(RUNNER, env, "auto"))
    assert auto["nodes"] == 1 + len(WORKER_CPUS) and auto["gcs"].endswith(f":{cluster.port}")  # asked for: used

    stale = cluster.tmp / "stale"  # short: a local Ray puts its sockets under it
    (stale / "ray").mkdir(parents=True)
    (stale / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # a cluster that died
    plain = runner_result(driver(RUNNER, {**env, "RAY_TMPDIR": str(stale)}, ""))
    assert plain["nodes"] == 1


def test_the_address_decides_local_sizing_or_shipped_code(monkeypatch):
    from flows.config import RayConfig
    from flows.runtime import project_modules, ray_address, ray_init_kwargs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(RayConfig()) == "local"
    local = ray_init_kwargs(RayConfig(num_cpus=3))
    assert local["num_cpus"] == 3 and "py_modules" not in local["runtime_env"]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert ray_address(RayConfig()) == "10.0.0.5:6379" and ray_address(RayConfig(address="auto")) == "auto"
    remote = ray_init_kwargs(RayConfig(num_cpus=3))
    assert "num_cpus" not in remote and remote["runtime_env"]["py_modules"] == project_modules()
    assert sorted(Path(m).name for m in project_modules()) == ["flows", "storage", "tasks"]
    assert all(Path(m).parent == REPO for m in project_modules())
