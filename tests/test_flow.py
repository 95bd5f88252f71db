"""The flow on a real Prefect server and real Ray: runs, cross-run cache, partial invalidation,
retries, refresh, and deployment rlhf/full run by a process worker.

Every run is the user's own command (`rlhf run`, `prefect deployment run`) in a subprocess, so
each gets a fresh local Ray that inherits PREFECT_API_URL; task-run states are read back from
the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.store import ArtifactRef, ArtifactStore
from tests.conftest import free_port
from tests.test_console import assert_quiet

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
SMALL = ["sft.max_steps=30", "rm.max_steps=20", "ppo.num_iterations=3", "ppo.rollout_batch_size=16",
         "ppo.train_batch_size=8", "ppo.checkpoint_every=2", "ppo.eval_every=3"]


def rlhf_run(store_uri: str, *extra: str, env: dict | None = None, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float]:
    args = [str(BIN / "rlhf"), "run"]
    for s in [*SMALL, f"store.uri={store_uri}"]:
        args += ["--set", s]
    args += list(extra)
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)
    wall = time.time() - t0
    assert p.returncode == 0, f"rlhf run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p, wall


async def _latest_task_states() -> dict[str, dict]:
    """Task name -> {state, run_count} of the newest `rlhf-stages` flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    async with get_client() as c:
        runs = await c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rlhf-stages"])),
                                      sort=FlowRunSort.START_TIME_DESC, limit=1)
        tasks = await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])))
        return {t.name.rsplit("-", 1)[0]: {"state": t.state.name, "run_count": t.run_count} for t in tasks}


def task_states() -> dict[str, dict]:
    return asyncio.run(_latest_task_states())


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory, prefect_api, rlhf_cache) -> str:
    return "file://" + str(tmp_path_factory.mktemp("flow-store"))


KINDS = {"dataset": "data", "sft_adapter": "sft", "reward_model": "rm", "ppo_actor": "ppo"}


def result_records(store_uri: str) -> dict[str, Path]:
    """Stage -> the Prefect result record of its (one) artifact in this store."""
    from flows.config import PipelineConfig
    from flows.rlhf import cache_key

    store, cfg = ArtifactStore(store_uri), PipelineConfig(store={"uri": store_uri})
    found = {KINDS[store.manifest(k)["kind"]]: k for k in store.list() if store.manifest(k)["kind"] in KINDS}
    storage = Path(os.environ["PREFECT_HOME"]) / "storage"
    return {stage: storage / cache_key(None, {"cfg": cfg, "key": key}) for stage, key in found.items()}


def test_run_then_cached_rerun_then_only_downstream_reruns(store_uri, prefect_api, mlflow_server):
    p, first = rlhf_run(store_uri, "--set", f"tracking.mlflow_uri={mlflow_server}", "--set", "tracking.mlflow_experiment=flow")
    states = task_states()
    assert {s["state"] for s in states.values()} == {"Completed"}, states
    assert all(re.search(rf"rlhf: {s:5s} built ", p.stdout + p.stderr) for s in ("data", "sft", "rm", "ppo")), p.stderr
    assert_quiet(p.stdout + p.stderr)  # no library notices for what we expect (tests/test_console.py)
    assert re.search(r"\(sft pid=\d+\) \S+ rlhf\.sft sft step 10/30 ", p.stderr) and "\x1b[" not in p.stderr  # piped: plain lines
    store = ArtifactStore(store_uri)
    keys = store.list()
    assert {k.split("/")[0] for k in keys} >= {"data", "sft", "rm", "ppo"}, keys
    for k in keys:
        store.verify(k)
    # Cached results are JSON data. Make each look written before ArtifactRef had `parts`:
    # Prefect still loads it (the rerun is Cached) and it still validates.
    for stage, path in result_records(store_uri).items():
        record = json.loads(path.read_text())
        ref = json.loads(record["result"])
        assert ArtifactRef.model_validate(ref).key.startswith(stage + "/") and record["metadata"]["serializer"]["type"] == "json"
        del ref["parts"]
        assert ArtifactRef.model_validate(ref).parts == {}
        path.write_text(json.dumps({**record, "result": json.dumps(ref)}))

    p, cached = rlhf_run(store_uri, env={"PYTHONPROFILEIMPORTTIME": "1"})  # stderr lists every module imported
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "prefect" in imported and not imported & {"torch", "transformers", "peft", "ray", "prefect_ray"}, \
        sorted(imported & {"torch", "transformers", "peft", "ray", "prefect_ray"})  # hits known before any of them
    states = task_states()
    assert {n: s["state"] for n, s in states.items()} == {n: "Cached" for n in ("data", "sft", "rm", "ppo")}, states
    assert all(re.search(rf"rlhf: {s:5s} cached ", p.stdout + p.stderr) for s in ("data", "sft", "rm", "ppo")), p.stderr
    assert "Ray: a private local Ray" not in p.stdout + p.stderr  # every stage a hit: no Ray
    print(f"\nfirst run {first:.1f}s, fully cached rerun {cached:.1f}s (wall, the whole `rlhf run`)")
    assert cached < first

    # a change to the reward model's config re-runs it and PPO only
    rlhf_run(store_uri, "--set", "rm.lr=5e-4")
    states = {n: s["state"] for n, s in task_states().items()}
    assert states == {"data": "Cached", "sft": "Cached", "rm": "Completed", "ppo": "Completed"}, states


@pytest.fixture
def logged_s3(tmp_path):
    """A moto S3 server of this test's own with its request log in a file: (endpoint, bucket, log)."""
    from tests.conftest import _wait_http

    port, log = free_port(), tmp_path / "moto.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_http(endpoint, 30, proc)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="rlhf-warm")
        yield endpoint, "rlhf-warm", log, {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    finally:
        proc.terminate()
        proc.wait(10)


def test_warm_run_on_s3_reads_only_manifests(store_uri, prefect_api, logged_s3, monkeypatch):
    """Keys do not depend on where the store is: a copy of the file store on S3 is all cached, and
    a warm run GETs manifests only (bytes summed from the S3 server's request log)."""
    endpoint, bucket, log, creds = logged_s3
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    local, uri = ArtifactStore(store_uri), f"s3://{bucket}/warm"
    s3 = ArtifactStore(uri, {"client_kwargs": {"endpoint_url": endpoint}})
    for p in Path(local.root).rglob("*"):
        if p.is_file():
            s3.fs.put_file(str(p), f"{s3.root}/{p.relative_to(local.root).as_posix()}")
    extra = ["--set", f"store.storage_options.client_kwargs.endpoint_url={endpoint}"]
    rlhf_run(uri, *extra, env=creds)  # no Prefect records for this store yet: each task finds the artifact itself
    offset = log.stat().st_size
    p, wall = rlhf_run(uri, *extra, env=creds)
    assert {n: s["state"] for n, s in task_states().items()} == {n: "Cached" for n in ("data", "sft", "rm", "ppo")}
    requests = re.findall(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP', log.read_text()[offset:])
    got = sorted({path.lstrip("/") for verb, path in requests if verb == "GET" and "?" not in path})
    got_bytes = sum(s3.fs.info(path)["size"] for path in got)
    total = sum(s3.fs.du(f"{s3.root}/{k}") for k in s3.list() if "-ckpt" not in k)
    print(f"\nwarm run on s3: {wall:.1f}s, {len(requests)} requests, GET {len(got)} objects = {got_bytes} bytes "
          f"(the artifacts hold {total} bytes)")
    assert got and all(path.endswith("/MANIFEST.json") for path in got), got
    assert got_bytes < 64_000 < total, (got_bytes, total)


def test_the_first_run_is_an_mlflow_run_with_a_nested_run_per_stage(store_uri, mlflow_server):
    """The first run of the test above, read back from the MLflow server through its client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("flow").experiment_id
    (parent,) = client.search_runs([exp], filter_string=f"tags.`rlhf.store` = '{store_uri}'")
    assert parent.info.status == "FINISHED" and parent.data.params["ppo.num_iterations"] == "3"
    children = {r.info.run_name: r for r in client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert set(children) == {"data", "sft", "rm", "ppo"}  # data prep's from its manifest (tests/test_tracking.py: cached stages)
    for stage, run in children.items():
        assert run.info.status == "FINISHED" and run.data.tags["rlhf.artifact_uri"] == parent.data.tags[f"rlhf.artifact.{stage}"]
        assert run.data.tags["rlhf.cached"] == "false"  # all built by this first run
    kl = client.get_metric_history(children["ppo"].info.run_id, "ppo/kl")
    assert sorted(m.step for m in kl) == [1, 2, 3]


def test_refresh_rebuilds_the_stage(store_uri, prefect_api):
    rlhf_run(store_uri, "--refresh", "sft")
    states = {n: s["state"] for n, s in task_states().items()}
    assert states["sft"] == "Completed" and states["data"] == "Cached" and states["rm"] == "Cached", states


def test_stage_failing_once_is_retried(store_uri, prefect_api, tmp_path):
    marker = tmp_path / "rm-failed-once"
    p, _ = rlhf_run(store_uri, "--set", "rm.lr=7e-4", "--set", "resources.rm.retry_delay_s=0.5",
                    env={"RLHF_FAIL_ONCE": f"rm:{marker}"})
    assert marker.exists(), "the injected fault did not fire"
    states = task_states()
    assert states["rm"] == {"state": "Completed", "run_count": 2}, states
    assert "injected fault" in p.stdout + p.stderr


def test_corrupt_cached_artifact_is_rebuilt_not_trusted(store_uri, prefect_api):
    store = ArtifactStore(store_uri)
    sft_key = next(k for k in store.list("sft") if not k.endswith("-partial"))
    m = store.manifest(sft_key)
    victim = Path(store.fetch(sft_key, verify=False)) / "adapter" / "adapter_model.safetensors"
    assert "adapter/adapter_model.safetensors" in m["files"]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated on disk
    rlhf_run(store_uri)
    states = {n: s["state"] for n, s in task_states().items()}
    assert states["sft"] == "Completed" and states["data"] == "Cached", states
    store.verify(sft_key)  # republished whole


def test_deployment_full_runs_on_a_process_worker_one_run_at_a_time(prefect_api, tmp_path, rlhf_cache):
    """Two runs of rlhf/full triggered together (a scheduled retrain and a manual run): the
    deployment's concurrency limit (1) makes the second wait for the first to finish
    (AwaitingConcurrencySlot), and then every stage of it is Cached from the first's artifacts."""
    pool = "rlhf-test-pool"
    store_uri = "file://" + str(tmp_path / "deployed-store")
    sets = [a for s in [*SMALL, f"store.uri={store_uri}"] for a in ("--set", s)]
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    subprocess.run([sys.executable, "deployments/deploy.py", "--pool", pool, "--cron", "0 3 * * 0", *sets],
                   check=True, cwd=REPO, env=env, timeout=120, capture_output=True)
    worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"],
                              cwd=REPO, env=env, stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        t0 = time.time()
        runs = asyncio.run(_run_deployment_twice("rlhf/full", timeout=900))
        print(f"\ntwo deployment runs of rlhf/full, one after the other: {time.time() - t0:.1f}s")
        log = (tmp_path / "worker.log").read_text()
        assert [r["state"] for r in runs] == ["Completed", "Completed"], f"{runs}\nworker:\n{log[-4000:]}"
        first, second = sorted(runs, key=lambda r: r["start"])
        assert second["start"] >= first["end"], runs  # no overlap
        assert "AwaitingConcurrencySlot" in second["states"], runs  # it waited for the slot
        assert {t["state"] for t in task_states().values()} == {"Cached"}, task_states()  # then found it all built
        # A run that fails (RM, forced, fails once), retried through the API as the UI's Retry does
        # (its state set to Scheduled): the retry reuses every finished stage. The RM it rebuilds has
        # the same weights (reproducible builds), so PPO, keyed on them, is Cached too.
        retried = asyncio.run(_fail_then_retry("rlhf/full", tmp_path / "rm-failed-once", timeout=600))
        log = (tmp_path / "worker.log").read_text()
        assert retried == ["Failed", "Completed"], f"{retried}\nworker:\n{log[-4000:]}"
        states = {stage: t["state"] for stage, t in task_states().items()}
        assert states == {"data": "Cached", "sft": "Cached", "rm": "Completed", "ppo": "Cached"}, states
    finally:
        os.killpg(worker.pid, signal.SIGINT)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
    store = ArtifactStore(store_uri)
    ppo = [k for k in store.list("ppo") if "-ckpt" not in k]
    assert len(ppo) == 1 and store.manifest(ppo[0])["kind"] == "ppo_actor"
    sched, limit = asyncio.run(_deployment_schedule("rlhf/full"))
    assert sched == ["0 3 * * 0"] and limit == (1, "ENQUEUE"), (sched, limit)


async def _fail_then_retry(name: str, marker: Path, timeout: float) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    async with get_client() as c:
        d = await c.read_deployment_by_name(name)
        config = {**d.parameters["config"], "refresh": ["rm"]}
        config["resources"] = {**config.get("resources", {}), "rm": {**config.get("resources", {}).get("rm", {}), "retries": 0}}
        run = await c.create_flow_run_from_deployment(d.id, parameters={"config": config},
                                                      job_variables={"env": {"RLHF_FAIL_ONCE": f"rm:{marker}"}})
        finals = []
        for attempt in range(2):
            deadline = time.time() + timeout
            while time.time() < deadline:
                r = await c.read_flow_run(run.id)
                if r.state and r.state.is_final():
                    break
                await asyncio.sleep(2)
            finals.append(r.state.name)
            if attempt == 0:
                await c.set_flow_run_state(run.id, Scheduled(), force=True)  # the UI's Retry
                await asyncio.sleep(1)
        return finals


async def _run_deployment_twice(name: str, timeout: float) -> list[dict]:
    from prefect.client.orchestration import get_client

    async with get_client() as c:
        d = await c.read_deployment_by_name(name)
        ids = [(await c.create_flow_run_from_deployment(d.id)).id for _ in range(2)]
        deadline = time.time() + timeout
        while time.time() < deadline:
            runs = [await c.read_flow_run(i) for i in ids]
            if all(r.state and r.state.is_final() for r in runs):
                break
            await asyncio.sleep(2)
        return [{"state": r.state.name, "start": r.start_time, "end": r.end_time,
                 "states": [s.name for s in await c.read_flow_run_states(r.id)]} for r in runs]


async def _deployment_schedule(name: str) -> list[str]:
    from prefect.client.orchestration import get_client

    async with get_client() as c:
        d = await c.read_deployment_by_name(name)
        strategy = d.concurrency_options.collision_strategy.value if d.concurrency_options else None
        return [s.schedule.cron for s in d.schedules], (d.global_concurrency_limit.limit if d.global_concurrency_limit else None,
                                                        strategy)


def test_retraining_on_new_prompts_reuses_sft_and_rm(store_uri, prefect_api, tmp_path):
    """What a scheduled retrain sees when only the prompt set changed: SFT and RM are reused."""
    from tasks.common.builtin import write_task_files

    files = write_task_files(tmp_path / "data")
    paths = [f"data.sft_path={files['sft']}", f"data.preference_path={files['preference']}",
             f"data.ptx_path={files['ptx']}", f"data.prompts_path={files['prompts']}"]
    rlhf_run(store_uri, *[a for s in paths for a in ("--set", s)])
    lines = files["prompts"].read_text().splitlines()
    files["prompts"].write_text("\n".join(lines[: len(lines) // 2]) + "\n")  # new data: half the prompts
    rlhf_run(store_uri, *[a for s in paths for a in ("--set", s)])
    states = {n: s["state"] for n, s in task_states().items()}
    assert states == {"data": "Completed", "sft": "Cached", "rm": "Cached", "ppo": "Completed"}, states


def test_each_stage_publishes_a_prefect_artifact(store_uri, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as c:
            arts = await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"rlhf-{s}" for s in ("data", "sft", "rm", "ppo")])))
            versions: dict[str, list[str]] = {}
            for art in arts:
                versions.setdefault(art.key, []).append(art.data)
            return versions

    # every run of this session's server publishes a version of each key (the deployment test's
    # runs use another store), so look at the versions that point into this module's store
    arts = {k: [d for d in v if store_uri in d] for k, v in asyncio.run(read()).items()}
    assert set(arts) == {"rlhf-data", "rlhf-sft", "rlhf-rm", "rlhf-ppo"} and all(arts.values()), {k: len(v) for k, v in arts.items()}
    assert all("sft/eval_loss" in d for d in arts["rlhf-sft"]) and all("rm/eval_accuracy" in d for d in arts["rlhf-rm"])
    assert all("| iteration | reward mean | KL" in d for d in arts["rlhf-ppo"])
    # the curves as an image on the page, and the samples side by side (flows/report.py)
    assert all("![" in d and "](data:image/png;base64," in d for s in ("sft", "rm", "ppo") for d in arts[f"rlhf-{s}"])
    assert all("| prompt | SFT policy (it 0) | RM | true | policy (it 3) |" in d for d in arts["rlhf-ppo"])

    async def progress():
        async with get_client() as c:
            return await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rlhf-ppo-progress"])))

    # the session's server also holds the progress of runs other tests kill mid-PPO (they stay below 100)
    got = asyncio.run(progress())
    assert {a.type for a in got} == {"progress"} and all(0.0 <= a.data <= 100.0 for a in got) and max(a.data for a in got) == 100.0
