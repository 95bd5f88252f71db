"""The CLI's local Prefect server (flows/server.py): started once, shared, reused, stopped when idle.

Real ``prefect server start`` processes under the real watchdog; each test uses its own PREFECT_HOME.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from flows.server import LocalPrefectServer, healthy, read_record, stop


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_UI_ENABLED", "false")
    yield tmp_path
    stop(tmp_path)


def _wait(cond, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_runs_share_one_server_that_outlives_them_and_stops_when_idle(home, monkeypatch):
    monkeypatch.setenv("RLHF_PREFECT_IDLE_S", "4")
    got, release = [], threading.Event()

    def run():
        with LocalPrefectServer() as s:
            got.append((s.api, s.started))
            release.wait(120)

    threads = [threading.Thread(target=run) for _ in range(2)]  # two runs started together
    for t in threads:
        t.start()
    assert _wait(lambda: len(got) == 2, 120), got
    time.sleep(5)  # longer than the idle timeout: a server in use is not stopped
    api = got[0][0]
    assert got[1][0] == api and sorted(s for _, s in got) == [False, True], got  # one started it, one reused it
    assert healthy(api) and read_record(home)["api"] == api
    release.set()
    for t in threads:
        t.join(30)
    assert "PREFECT_API_URL" not in os.environ
    t0 = time.perf_counter()
    with LocalPrefectServer() as later:  # it outlived them: the next run reuses it at once
        assert (later.api, later.started) == (api, False) and os.environ["PREFECT_API_URL"] == api
    assert time.perf_counter() - t0 < 2
    # then unused for the idle timeout: the watchdog stops the server and drops the record
    assert _wait(lambda: read_record(home) is None and not healthy(api), 40)
    assert stop(home) is None


def test_a_bad_idle_timeout_names_the_variable(home, monkeypatch):
    monkeypatch.setenv("RLHF_PREFECT_IDLE_S", "soon")
    with pytest.raises(ValueError, match=r"RLHF_PREFECT_IDLE_S \('soon'\): expected seconds >= 0"):
        LocalPrefectServer().__enter__()
