"""The CLI's local Prefect server: started by the first run, reused by the next, stopped when idle.

``rlhf run`` / ``rlhf serve`` without $PREFECT_API_URL use the server recorded in
``$PREFECT_HOME/rlhf-server.json`` when it answers; otherwise they start ``prefect server start``
on 127.0.0.1 under a small watchdog (``python -m flows.server``, its own session, so it outlives
the run) and record it. So the "View at" links a run prints keep working after it, and the next
run does not pay the server's start (3-5 s on 2 cores). The watchdog stops the server once no
run has used it for ``RLHF_PREFECT_IDLE_S`` seconds (default 1800; 0: at the end of each run);
``rlhf server stop`` stops it now, ``rlhf server`` says where it is.

Locks, both flock(2) on files in $PREFECT_HOME (released by the kernel when a holder dies): a run
holds ``rlhf-server.lock`` shared while it uses the server, and the watchdog stops the server only
when it gets that lock exclusively; ``rlhf-server.start.lock`` serialises finding-or-starting, so
two runs started together share one server.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEFAULT_IDLE_S = 1800.0


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")


def idle_timeout_s() -> float:
    raw = os.environ.get("RLHF_PREFECT_IDLE_S", "")
    try:
        value = float(raw) if raw else DEFAULT_IDLE_S
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"RLHF_PREFECT_IDLE_S ({raw!r}): expected seconds >= 0 that the CLI's local Prefect server "
                         f"stays up with no run using it, e.g. 1800 (0 stops it at the end of each run)")
    return value


def _paths(home: Path) -> dict[str, Path]:
    return {name: home / f"rlhf-server{suffix}" for name, suffix in
            (("record", ".json"), ("use", ".lock"), ("start", ".start.lock"), ("log", ".log"))}


def healthy(api: str, timeout: float = 2) -> bool:
    try:
        urllib.request.urlopen(api + "/health", timeout=timeout)
        return True
    except Exception:
        return False


def read_record(home: Path) -> dict | None:
    """The recorded server ({api, pid, idle_s, started}) if its watchdog still runs, else None."""
    try:
        rec = json.loads(_paths(home)["record"].read_text())
        os.kill(rec["pid"], 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:  # a dead watchdog's pid may have been reused: only ours is ever signalled
        if b"flows.server" not in Path(f"/proc/{rec['pid']}/cmdline").read_bytes():
            return None
    except OSError:
        pass  # no /proc (not Linux): trust the pid
    return rec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lock(path: Path, mode: int):
    f = open(path, "a")
    fcntl.flock(f, mode)
    return f


class LocalPrefectServer:
    """The server a CLI run reports to: $PREFECT_API_URL if set, else the recorded local server,
    else a new one (see the module docstring). ``started`` says whether this run started it."""

    def __init__(self, timeout_s: float = 90):
        self.timeout_s, self.api, self.started, self._use = timeout_s, None, False, None

    def __enter__(self) -> "LocalPrefectServer":
        if os.environ.get("PREFECT_API_URL"):
            return self
        idle_s = idle_timeout_s()
        home = prefect_home()
        home.mkdir(parents=True, exist_ok=True)
        paths = _paths(home)
        self._use = _lock(paths["use"], fcntl.LOCK_SH)  # waits while a watchdog is stopping the server
        with _lock(paths["start"], fcntl.LOCK_EX):
            rec = read_record(home)
            if rec is None or not healthy(rec["api"]):
                # (a watchdog whose server hangs is left to stop it once idle; the new record is not its)
                rec, self.started = self._start(home, idle_s), True
        self.api = rec["api"]
        os.environ["PREFECT_API_URL"] = self.api
        return self

    def _start(self, home: Path, idle_s: float) -> dict:
        paths = _paths(home)
        port = _free_port()
        api = f"http://127.0.0.1:{port}/api"
        with open(paths["log"], "ab") as log:
            # `python -m`, not <python's folder>/prefect: packages may come from PYTHONPATH or a user site
            proc = subprocess.Popen([sys.executable, "-m", "flows.server", str(port), str(idle_s)], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=Path(__file__).resolve().parents[1],
                                    env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        deadline = time.time() + self.timeout_s
        while not healthy(api):
            if proc.poll() is not None or time.time() > deadline:
                _kill_group(proc.pid)
                raise RuntimeError(f"the local Prefect server did not start; see {paths['log']} "
                                   "(or set PREFECT_API_URL to a running server)")
            time.sleep(0.2)
        rec = {"api": api, "pid": proc.pid, "idle_s": idle_s, "started": time.time()}
        paths["record"].write_text(json.dumps(rec))
        return rec

    def __exit__(self, *exc) -> None:
        if self._use is None:
            return
        os.environ.pop("PREFECT_API_URL", None)
        os.utime(self._use.name)  # the watchdog's idle clock starts now
        self._use.close()  # releases the shared lock
        self._use = None


def stop(home: Path, on_wait=None) -> dict | None:
    """Stop the recorded server and its watchdog once no run uses it (``on_wait()`` is called
    if one does); returns the record, or None when no server was running."""
    paths = _paths(home)
    if read_record(home) is None:
        paths["record"].unlink(missing_ok=True)
        return None
    use = open(paths["use"], "a")
    try:
        try:
            fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                on_wait()
            fcntl.flock(use, fcntl.LOCK_EX)
        rec = read_record(home)
        if rec is not None:
            _kill_group(rec["pid"])
        paths["record"].unlink(missing_ok=True)
        return rec
    finally:
        use.close()


def _kill_group(pid: int, timeout_s: float = 30) -> None:
    """SIGTERM the watchdog's process group (the watchdog and the server), SIGKILL after timeout_s."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # our child (a test, or a start that failed): reap it, no zombie
        except ChildProcessError:
            pass
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def watch(port: int, idle_s: float) -> int:
    """The watchdog: run the server; stop it when no run has held the use lock for ``idle_s``."""
    home = prefect_home()
    paths = _paths(home)
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `rlhf server stop`: the finally below stops the server
    poll_s = min(15.0, max(0.5, idle_s / 4))
    try:
        while server.poll() is None:
            time.sleep(poll_s)
            try:
                if time.time() - paths["use"].stat().st_mtime < idle_s:
                    continue
            except FileNotFoundError:
                pass
            use = open(paths["use"], "a")
            try:
                fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no run uses the server; new ones wait for this lock
            except BlockingIOError:
                use.close()
                continue
            rec = read_record(home)
            if rec is not None and rec["pid"] == os.getpid():
                paths["record"].unlink(missing_ok=True)
            break  # `use` stays locked until this process exits, after the server
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), float(sys.argv[2])))
