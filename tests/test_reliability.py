"""Reliability: faults injected for real, nothing lost, nothing half-written trusted.

- a PPO role's Ray worker process is SIGKILLed mid-iteration: the stage fails fast, the rerun
  resumes from the last checkpoint and completes;
- the whole ``rlhf run`` process group is SIGKILLed mid-PPO: no listed artifact is incomplete,
  the rerun reuses data/SFT/RM and resumes PPO from its checkpoint;
- a published SFT file is truncated: the next run detects it and rebuilds;
- two runs at once on one file:// store: both succeed, nothing is clobbered;
- a read-only artifact root: the run stops at preflight with an error naming store.uri;
- credentials in the environment never reach manifests, Prefect or logs; servers bind loopback.

Key escapes out of the store root are covered by
tests/test_storage.py::test_keys_outside_the_store_are_rejected (not repeated here).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from storage import ArtifactStore
from tasks.common.model import ModelConfig
from tasks.data.config import DataConfig
from tasks.data.prepare import prepare_data
from tasks.ppo.checkpoint import checkpoint_prefix, latest_checkpoint
from tasks.ppo.config import PPOConfig
from tasks.ppo.train import ppo_key, train_ppo
from tasks.rm.config import RewardConfig
from tasks.rm.train import train_reward_model
from tasks.sft.config import SFTConfig
from tasks.sft.train import train_sft
from tests.test_storage import drop_root_file_override

REPO = Path(__file__).resolve().parents[1]
RLHF = str(Path(sys.executable).parent / "rlhf")
SEED = 42
MODEL = ModelConfig()
# A pipeline small enough for 2 CPU cores; PPO checkpoints at iteration 2 of 4.
SMALL = ["sft.max_steps=6", "sft.eval_every=3", "rm.max_steps=4", "ppo.num_iterations=4", "ppo.checkpoint_every=2",
         "ppo.rollout_batch_size=8", "ppo.max_new_tokens=8", "ppo.eval_every=100", "ppo.eval_prompts=8",
         "resources.ppo.retries=0"]


def small_args(store_uri: str, *extra: str) -> list[str]:
    out = ["run"]
    for s in [f"store.uri={store_uri}", *SMALL, *extra]:
        out += ["--set", s]
    return out


def run_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # each run starts its own local Ray
    return {**env, "PYTHONPATH": str(REPO), **extra}


def every_key_verifies(store: ArtifactStore) -> list[str]:
    keys = store.list()
    for k in keys:
        store.verify(k)  # each manifest names a complete, matching data folder
    return keys


def published(store: ArtifactStore) -> dict[str, dict]:
    """key -> manifest of every stage artifact (checkpoints and SFT partials left out)."""
    return {k: store.manifest(k) for k in store.list() if "/" not in k.partition("/")[2] and "-" not in k.partition("/")[2]}


def stage_manifests(store: ArtifactStore) -> dict[str, dict]:
    """stage -> manifest of its one published artifact."""
    out = {}
    for k, m in published(store).items():
        assert k.split("/")[0] not in out, (k, list(out))
        out[k.split("/")[0]] = m
    return out


def session_pids(sid: int) -> list[int]:
    """Processes still in session ``sid`` (what a run started with start_new_session left)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                    pids.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group, then anything else of its session (Ray may setsid)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    deadline = time.time() + 30
    while (left := session_pids(proc.pid)) and time.time() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


# -- 1. kill -9 of a PPO role's Ray worker ---------------------------------------------------------
@pytest.fixture(scope="module")
def stages(rlhf_cache, ray_cluster, tmp_path_factory):
    store = ArtifactStore(f"file://{tmp_path_factory.mktemp('rel-store')}")
    data = prepare_data(DataConfig(), MODEL, store, SEED)
    sft = train_sft(SFTConfig(max_steps=6, eval_every=3), MODEL, store, data, SEED)
    rm = train_reward_model(RewardConfig(max_steps=4), MODEL, store, data, SEED)
    return store, data, sft, rm


def policy_worker_pids() -> list[int]:
    """PIDs of the Ray worker processes hosting a PolicyWorker actor: Ray titles them
    ray::PolicyWorker...; processes they forked inherit the title, so only those whose parent
    is not one of them (the raylet started them) count."""
    found = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "cmdline").read_bytes().startswith(b"ray::PolicyWorker"):
                    found[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


@pytest.mark.slow
def test_kill_9_of_a_ppo_worker_fails_fast_and_the_rerun_resumes(stages, ray_cluster, caplog):
    store, data, sft, rm = stages
    cfg = PPOConfig(num_iterations=5, checkpoint_every=2, rollout_batch_size=8, max_new_tokens=8, eval_every=100, eval_prompts=8)
    key = ppo_key(cfg, MODEL, data, sft, rm, SEED)
    killed = []

    def kill_during_iteration_3(it, metrics):
        if it == 2:  # the iter-2 checkpoint is published; iteration 3 starts right after this returns
            def kill():  # from a thread, so it lands while the driver is inside iteration 3
                time.sleep(0.05)
                pids = policy_worker_pids()
                killed.append(pids)
                os.kill(pids[0], signal.SIGKILL)

            threading.Thread(target=kill, daemon=True).start()

    t = time.perf_counter()
    with pytest.raises(Exception) as err:
        train_ppo(cfg, MODEL, store, data, sft, rm, SEED, on_iteration=kill_during_iteration_3)
    took = time.perf_counter() - t
    import ray

    assert len(killed) == 1 and len(killed[0]) == 1, killed  # exactly one PolicyWorker process, killed
    assert isinstance(err.value, ray.exceptions.RayActorError), repr(err.value)
    assert "PolicyWorker" in str(err.value) or "actor" in str(err.value).lower()
    assert took < 240, took  # failed, did not hang
    assert not store.exists(key) and latest_checkpoint(store, key) == f"{checkpoint_prefix(key)}/iter-000002"
    every_key_verifies(store)
    # the roles' placement groups and CPUs are given back (Ray frees them asynchronously)
    deadline = time.time() + 30
    while ray.available_resources().get("CPU") != pytest.approx(ray.cluster_resources()["CPU"]):
        assert time.time() < deadline, (ray.available_resources(), ray.cluster_resources())
        time.sleep(0.5)

    seen = []
    with caplog.at_level(logging.INFO, logger="rlhf.ppo"):
        ref = train_ppo(cfg, MODEL, store, data, sft, rm, SEED, on_iteration=lambda it, m: seen.append(it))
    assert seen == [3, 4, 5]  # lost only the interrupted iteration (at most one checkpoint interval)
    assert f"ppo resumed from {checkpoint_prefix(key)}/iter-000002 at iteration 2" in caplog.text
    history = [json.loads(x) for x in (store.fetch(ref.key) / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history if "ppo/reward_mean" in h] == [1, 2, 3, 4, 5]
    assert ref.key == key and key in every_key_verifies(store)


# PPO long enough after its first checkpoint (iteration 2) that the kill lands inside the stage.
KILL_RUN = ["ppo.num_iterations=12", "ppo.checkpoint_every=2"]


# -- 2. SIGKILL of the whole flow process mid-PPO, then rerun; 3. a truncated SFT file ------------
@pytest.fixture(scope="module")
def killed_then_rerun(rlhf_cache, prefect_api, tmp_path_factory):
    """`rlhf run` killed (SIGKILL to its process group) once a PPO checkpoint is published, then rerun."""
    tmp = tmp_path_factory.mktemp("flow-kill")
    uri = f"file://{tmp / 'store'}"
    args = small_args(uri, *KILL_RUN)
    store = ArtifactStore(uri)
    log1 = open(tmp / "run1.log", "w")
    proc = subprocess.Popen([RLHF, *args], cwd=tmp, stdout=log1, stderr=subprocess.STDOUT,
                            env=run_env(), start_new_session=True)
    ckpt, deadline = None, time.time() + 400
    try:
        while ckpt is None:
            assert proc.poll() is None, (tmp / "run1.log").read_text()[-3000:]
            assert time.time() < deadline, "no PPO checkpoint within 400 s"
            ckpt = next((k for k in store.list("ppo") if "-ckpt/iter-" in k), None)
            time.sleep(0.05)
    finally:
        kill_session(proc)
    after_kill = {"keys": every_key_verifies(store), "manifests": stage_manifests(store), "ckpt": ckpt,
                  "ckpt_manifest": store.manifest(ckpt)}
    t = time.perf_counter()
    run2 = subprocess.run([RLHF, *args], cwd=tmp, capture_output=True, text=True, timeout=500, env=run_env())
    return {"tmp": tmp, "args": args, "store": store, "after_kill": after_kill, "run2": run2,
            "run2_s": time.perf_counter() - t, "killed_rc": proc.returncode}


@pytest.mark.slow
def test_flow_killed_mid_ppo_leaves_nothing_half_done_and_resumes(killed_then_rerun):
    r = killed_then_rerun
    store, before = r["store"], r["after_kill"]
    assert r["killed_rc"] == -signal.SIGKILL
    assert set(before["manifests"]) == {"data", "sft", "rm"}  # PPO's final artifact does not look complete
    assert r["run2"].returncode == 0, r["run2"].stdout[-2000:] + r["run2"].stderr[-4000:]
    after = stage_manifests(store)
    assert set(after) == {"data", "sft", "rm", "ppo"}
    for stage in ("data", "sft", "rm"):  # reused, not retrained: the very same published folder
        assert (after[stage]["data"], after[stage]["created_at"], after[stage]["content_hash"]) == \
            (before["manifests"][stage]["data"], before["manifests"][stage]["created_at"], before["manifests"][stage]["content_hash"])
    # PPO resumed: the checkpoint the killed run wrote was loaded, not rewritten by a fresh start
    assert store.manifest(before["ckpt"])["data"] == before["ckpt_manifest"]["data"]
    ppo = [k for k in store.list("ppo") if "-ckpt" not in k][0]
    assert before["ckpt"].startswith(checkpoint_prefix(ppo) + "/")
    history = [json.loads(x) for x in (store.fetch(ppo) / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history if "ppo/reward_mean" in h] == list(range(1, 13))
    every_key_verifies(store)


@pytest.mark.slow
def test_truncated_sft_file_is_detected_and_rebuilt(killed_then_rerun):
    r = killed_then_rerun
    store = r["store"]
    before = stage_manifests(store)
    sft = next(k for k in store.list("sft") if "-" not in k.split("/")[1])
    victim = max(before["sft"]["files"], key=lambda rel: before["sft"]["files"][rel]["size"])
    path = Path(store.root) / sft / before["sft"]["data"] / victim
    path.write_bytes(path.read_bytes()[: before["sft"]["files"][victim]["size"] // 2])
    assert not store.is_good(sft)

    run3 = subprocess.run([RLHF, *r["args"]], cwd=r["tmp"], capture_output=True, text=True, timeout=500, env=run_env())
    assert run3.returncode == 0, run3.stdout[-2000:] + run3.stderr[-4000:]
    after = {k.split("/")[0]: m for k, m in published(store).items() if not k.startswith("ppo/")}
    assert after["sft"]["data"] != before["sft"]["data"]  # rebuilt into a fresh folder, and it is whole
    assert "failed its check and will be rebuilt" in run3.stderr + run3.stdout
    store.verify(sft)
    for stage in ("data", "rm"):  # not downstream of SFT: untouched
        assert after[stage]["data"] == before[stage]["data"]
    # PPO keys on the SFT adapter's bytes (read_parts). Builds are reproducible, so the rebuilt adapter
    # is the same and PPO's artifact is reused (SFT's TensorBoard files, with wall times, differ);
    # a different adapter would give PPO a new key and a fresh artifact from the rebuilt SFT.
    adapter = lambda m: {rel: f["sha256"] for rel, f in m["files"].items() if rel.startswith("adapter/")}  # noqa: E731
    ppo = {k: m for k, m in published(store).items() if k.startswith("ppo/")}
    if adapter(after["sft"]) == adapter(before["sft"]):
        assert re.search(r"rlhf: ppo\s+cached", run3.stdout + run3.stderr), run3.stderr[-3000:]
    else:
        fresh = [k for k, m in ppo.items() if m["inputs"]["sft"] == after["sft"]["content_hash"]]
        assert len(fresh) == 1 and store.manifest(fresh[0])["created_at"] >= after["sft"]["created_at"]
    every_key_verifies(store)


# -- 4. two runs at once on one store --------------------------------------------------------------
@pytest.mark.slow
def test_two_concurrent_runs_do_not_clobber_each_other(rlhf_cache, prefect_api, tmp_path):
    uri = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([RLHF, *small_args(uri)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=run_env(), start_new_session=True) for _ in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=560))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_session(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    uris = [sorted(line.split()[-1] for line in out.splitlines() if line.strip().startswith(("data ", "sft ", "rm ", "ppo ")))
            for out, _ in outs]
    by_stage = [{u.rsplit("/", 2)[-2]: u for u in us} for us in uris]
    assert all(set(b) == {"data", "sft", "rm", "ppo"} for b in by_stage), by_stage
    # same inputs, same keys: the two runs share data/sft/rm. PPO keys on the SFT adapter's content
    # hash, and two SFT trainings racing on one key are not bit-identical, so each run's PPO may get
    # its own key; what matters is that both publish whole artifacts (checked below).
    assert [{s: b[s] for s in ("data", "sft", "rm")} for b in by_stage][0] == {s: by_stage[1][s] for s in ("data", "sft", "rm")}
    store = ArtifactStore(uri)
    keys = every_key_verifies(store)
    assert {k.split("/")[0] for k in published(store)} == {"data", "sft", "rm", "ppo"} and len(keys) >= 5


# -- 5. a read-only artifact root ------------------------------------------------------------------
def test_read_only_store_root_stops_the_run_at_preflight(rlhf_cache, tmp_path):
    """Tests run as root, which ignores file modes: the child drops CAP_DAC_OVERRIDE first
    (as tests/test_storage.py does), so it meets the checks any non-root user would."""
    root = tmp_path / "ro-store"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(1024))
    ref = ArtifactStore(f"file://{root}").publish("data/old", src, kind="dataset")
    files_before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    for p in [root, *root.rglob("*")]:
        if p.is_dir():
            p.chmod(0o555)
    try:
        t = time.perf_counter()
        proc = subprocess.run([RLHF, *small_args(f"file://{root}")], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env=run_env(PREFECT_API_URL=""),
                              preexec_fn=drop_root_file_override if os.geteuid() == 0 else None)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert f"`store.uri` ('file://{root}'): cannot write to the artifact store (PermissionError" in proc.stderr
        assert "make the folder writable by this user" in proc.stderr and "point store.uri elsewhere" in proc.stderr
        assert time.perf_counter() - t < 60 and "local Prefect server" not in proc.stdout
    finally:
        for p in [root, *root.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == files_before
    assert ArtifactStore(f"file://{root}").verify("data/old")["content_hash"] == ref.content_hash


# -- 6. security -----------------------------------------------------------------------------------
async def _prefect_records(since) -> tuple[list, list, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime, LogFilter, LogFilterTimestamp

    async with get_client() as c:
        runs = await c.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)))
        arts = await c.read_artifacts()
        logs, offset = [], 0
        while batch := await c.read_logs(log_filter=LogFilter(timestamp=LogFilterTimestamp(after_=since)), offset=offset, limit=200):
            logs += batch
            offset += len(batch)
    return runs, arts, logs


@pytest.mark.slow
def test_credentials_never_leave_the_environment(rlhf_cache, prefect_api, s3_server, tmp_path):
    from datetime import datetime, timedelta, timezone

    import boto3

    endpoint, bucket = s3_server
    token = "tok-" + secrets.token_hex(16)
    prefix = f"sec-{secrets.token_hex(4)}"
    since = datetime.now(timezone.utc) - timedelta(seconds=5)
    args = small_args(f"s3://{bucket}/{prefix}", f"store.storage_options={{client_kwargs: {{endpoint_url: '{endpoint}'}}}}")
    proc = subprocess.run([RLHF, *args], cwd=tmp_path, capture_output=True, text=True, timeout=500,
                          env=run_env(AWS_SECRET_ACCESS_KEY=token, AWS_ACCESS_KEY_ID="testing"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert token not in proc.stdout and token not in proc.stderr

    s3 = boto3.client("s3", endpoint_url=endpoint)
    objects = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
               for o in page.get("Contents", [])]
    assert any(k.endswith("MANIFEST.json") for k in objects)
    for k in objects:  # manifests, configs, checkpoints, tokenizers: every stored byte
        assert token.encode() not in s3.get_object(Bucket=bucket, Key=k)["Body"].read(), k

    runs, arts, logs = asyncio.run(_prefect_records(since))
    ours = [r for r in runs if prefix in json.dumps(r.parameters, default=str)]
    assert {r.name for r in ours} and {r.state_type.value for r in ours} == {"COMPLETED"}
    for r in runs:
        assert token not in json.dumps(r.parameters, default=str)
    assert arts and logs
    for a in arts:
        assert token not in f"{a.data} {a.description}"
    for rec in logs:
        assert token not in rec.message


def test_local_servers_bind_to_loopback(monkeypatch, tmp_path):
    """The CLI's Prefect server listens on 127.0.0.1 only (read from /proc/net/tcp); a local Ray
    dashboard, when asked for, is bound to ray.dashboard_host, 127.0.0.1 by default."""
    from flows.config import RayConfig
    from flows.runtime import ray_init_kwargs
    from flows.server import LocalPrefectServer, stop

    kw = ray_init_kwargs(RayConfig(dashboard=True))
    assert kw["include_dashboard"] is True and kw["dashboard_host"] == "127.0.0.1"
    assert ray_init_kwargs(RayConfig())["include_dashboard"] is False

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    with LocalPrefectServer() as server:
        port = int(server.api.rsplit(":", 1)[1].split("/")[0])
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    listening.append(local.rsplit(":", 1)[0])
    assert stop(tmp_path)["api"] == server.api  # the server outlives the run (flows/server.py): stop it
    assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing on 0.0.0.0 or ::
