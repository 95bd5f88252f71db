"""A real multi-node Ray cluster on 127.0.0.1 for the cluster tests: ``ray start --head`` and
``ray start --address`` worker nodes, each its own raylet with logical CPUs and a ``node_k``
custom resource, torn down by process id.

Safety on a shared machine: every node gets a private ``--temp-dir`` (so the address file
``ray_current_cluster`` lands there, never in /tmp/ray where other runs' bare ``ray.init()``
would find it), every port is picked free on 127.0.0.1, and teardown kills only the processes
of the sessions this helper started (``ray stop`` would stop every Ray on the machine).
Worker nodes start from their own empty folder without PYTHONPATH, as on a machine without a
checkout: the project reaches them only through the job's runtime_env.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")
PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
              "--runtime-env-agent-port", "--metrics-export-port")  # a node's own ports, each picked free


def free_ports(n: int, avoid: set[int] = frozenset()) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1, none in ``avoid``: all held open while picked, since a
    port freed and asked for again can come back (a node given one port for two of its components
    fails to start: "trying to use a port number ... that is used by other components")."""
    while True:
        socks = [socket.socket() for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        if not avoid.intersection(ports):
            return ports


def session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` (everything one ``ray start`` left running)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    pids.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


class RayNodes:
    """``head`` plus ``workers`` nodes; ``nodes[name]`` is the session id of that node's processes."""

    def __init__(self, worker_cpus: list[float], head_cpus: float = 0, env: dict | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix="rlhf-cl-", dir="/tmp"))  # short: Ray's socket paths have a length limit
        self.temp_dir = self.tmp / "ray"  # what RAY_TMPDIR=self.tmp makes Ray look in
        self.port = free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self.env = {k: v for k, v in (env or os.environ).items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
        self.env.update(RAY_TMPDIR=str(self.tmp), RAY_USAGE_STATS_ENABLED="0")
        self.nodes: dict[str, int] = {}
        self._killed: list[int] = []
        self.driver_cwd = self.tmp / "driver"  # a folder for drivers outside any checkout
        self.driver_cwd.mkdir()
        self.worker_cpus, self.head_cpus = worker_cpus, head_cpus

    def _start(self, name: str, cpus: float, *head_args: str, attempts: int = 3) -> None:
        """``ray start`` one node; tried again (fresh ports, the failed try's processes killed) when
        Ray gives up on it: a port picked free can be taken before the node binds it, and on a
        loaded 2-core machine a raylet can miss Ray's 30 s window to register with the GCS (a CI
        run lost every cluster test to one such node_2 start)."""
        for attempt in range(1, attempts + 1):
            failed = self._start_once(name, cpus, *head_args)
            if failed is None:
                return
            if attempt == attempts:
                raise RuntimeError(f"ray start of {name} failed {attempts} times; the last: {failed}")

    def _start_once(self, name: str, cpus: float, *head_args: str) -> str | None:
        cwd = self.tmp / name
        cwd.mkdir(exist_ok=True)
        ports = [str(p) for p in free_ports(len(PORT_FLAGS) + 1, avoid={self.port})]
        if "--head" in head_args:
            head_args = (*head_args, "--ray-client-server-port", ports[-1])
        args = [RAY, "start", "--node-ip-address", "127.0.0.1", "--temp-dir", str(self.temp_dir),
                "--num-cpus", str(cpus), "--resources", json.dumps({name: 1}), "--disable-usage-stats",
                *(x for pair in zip(PORT_FLAGS, ports) for x in pair),
                "--object-store-memory", str(200 * 2**20), *head_args]
        log = open(self.tmp / f"{name}.start.log", "w")
        started = time.time()
        proc = subprocess.Popen(args, cwd=cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if proc.wait(120) == 0:
            self.nodes[name] = proc.pid  # the session id of the daemons it left
            return None
        for pid in session_pids(proc.pid):  # what the failed try left running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # the raylet's own words on why it did not register (its logs sit in the shared session dir)
        logs = {p.resolve() for p in self.temp_dir.glob("session_*/logs/raylet*")}  # session_latest links one
        raylet = sorted((p for p in logs if p.stat().st_mtime >= started), key=lambda p: p.stat().st_mtime)[-2:]
        tails = "".join(f"\n--- {p.name}: {p.read_text(errors='replace')[-1500:]}" for p in raylet)
        return (self.tmp / f"{name}.start.log").read_text()[-2000:] + tails

    def start(self) -> "RayNodes":
        self._start("head", self.head_cpus, "--head", "--port", str(self.port), "--include-dashboard", "false")
        for k, cpus in enumerate(self.worker_cpus, 1):
            self._start(f"node_{k}", cpus, "--address", self.address)
        return self

    def kill_node(self, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """Every process of one node (raylet, agents, its workers), as a crashed machine would go."""
        sid = self.nodes.pop(name)
        self._killed.append(sid)
        pids = session_pids(sid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def node_of_pid(self, pid: int) -> str:
        return next(n for n, sid in self.nodes.items() if sid == session_of(pid))

    def stop(self) -> None:
        """SIGKILL every node's processes (a test cluster holds nothing to save), then its temp dir."""
        for name in list(self.nodes):
            self.kill_node(name)
        deadline = time.time() + 20
        while any(session_pids(sid) for sid in self._killed) and time.time() < deadline:
            time.sleep(0.2)
        shutil.rmtree(self.tmp, ignore_errors=True)
