"""Experiment tracking against a real MLflow tracking server (sqlite backend, 127.0.0.1).

The TensorBoard event files of each stage are checked where the stages' own tests train
(test_sft, test_rm, test_ppo: read back with TensorBoard's reader, compared with the manifest
and metrics.jsonl); here a short SFT and RM run inside the pipeline's MLflow run.
"""

from __future__ import annotations

import time

import pytest

from flows.config import load_config
from storage.store import ArtifactStore
from tasks.common.tracking import TrackingConfig, check_mlflow, flatten, run_pipeline_tracked, scalars
from tasks.data.prepare import prepare_data
from tasks.rm.train import train_reward_model
from tasks.sft.train import train_sft


def test_mlflow_pipeline_run_with_a_nested_run_per_stage(mlflow_server, rlhf_cache):
    from mlflow.tracking import MlflowClient

    cfg = load_config(overrides=[f"tracking.mlflow_uri={mlflow_server}", "tracking.mlflow_experiment=test-tracking",
                                 "store.uri=memory://tracking-test", "sft.max_steps=6", "sft.eval_every=3",
                                 "rm.max_steps=6", "rm.eval_every=3"])
    store = ArtifactStore(cfg.store.uri)

    def stages(c):
        assert c.tracking.mlflow_parent_run_id  # the stages get the pipeline run to nest under
        data = prepare_data(c.data, c.model, store, c.seed)
        return {"data": data, "sft": train_sft(c.sft, c.model, store, data, c.seed, tracking=c.tracking),
                "rm": train_reward_model(c.rm, c.model, store, data, c.seed, tracking=c.tracking)}

    t = time.perf_counter()
    refs = run_pipeline_tracked(cfg, stages)
    print(f"\ntracked data+sft+rm: {time.perf_counter() - t:.1f}s")

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("test-tracking")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "FINISHED" and parent.info.run_name == "rlhf"
    assert parent.data.params["sft.lr"] == "0.005" and parent.data.params["store.uri"] == "memory://tracking-test"
    assert parent.data.params == flatten(cfg.model_dump(mode="json"))  # the whole config, nothing else
    assert {s: parent.data.tags[f"rlhf.artifact.{s}"] for s in refs} == {s: r.uri for s, r in refs.items()}

    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"data", "sft", "rm"}  # data prep trains nothing: its run comes from its manifest
    for stage in ("data", "sft", "rm"):
        run = children[stage]
        assert run.info.status == "FINISHED" and run.data.tags["rlhf.artifact_uri"] == refs[stage].uri
        assert run.data.tags["rlhf.cached"] == "false" and run.data.tags["rlhf.stage"] == stage
    assert children["sft"].data.params["sft.max_steps"] == children["rm"].data.params["rm.max_steps"] == "6"
    assert children["data"].data.metrics["data/sft_train"] == store.manifest(refs["data"].key)["metrics"]["data/sft_train"]
    m = store.manifest(refs["sft"].key)["metrics"]
    evals = sorted(client.get_metric_history(children["sft"].info.run_id, "sft/eval_loss"), key=lambda e: e.step)
    expected = [[0, m["sft/eval_loss_start"]], *m["sft/eval_history"]]
    assert [e.step for e in evals] == [s for s, _ in expected]
    assert [e.value for e in evals] == pytest.approx([v for _, v in expected])
    assert [e.step for e in sorted(client.get_metric_history(children["sft"].info.run_id, "sft/loss"), key=lambda e: e.step)] == list(range(1, 7))
    acc = client.get_metric_history(children["rm"].info.run_id, "rm/eval_accuracy")
    assert sorted(e.step for e in acc) == [0, 3, 6]

    # The same pipeline again: every stage is cached, and each still gets its nested run, made
    # from its manifest: the config as params, the manifest's metrics, the artifact URI, cached.
    again = run_pipeline_tracked(cfg, stages)
    assert again == refs
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    (parent2,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags and r.info.run_id != parent.info.run_id]
    cached = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent2.info.run_id}
    assert set(cached) == {"data", "sft", "rm"}
    for stage, run in cached.items():
        m = store.manifest(refs[stage].key)
        assert run.info.status == "FINISHED" and run.data.tags["rlhf.cached"] == "true"
        assert run.data.tags["rlhf.artifact_uri"] == refs[stage].uri == parent2.data.tags[f"rlhf.artifact.{stage}"]
        assert run.data.params == flatten(m["config"]) and run.data.metrics == pytest.approx(scalars(m["metrics"]))
    assert cached["sft"].data.params["sft.max_steps"] == children["sft"].data.params["sft.max_steps"]  # same names as a trained run
    assert cached["sft"].data.metrics["sft/eval_loss"] == pytest.approx(m_sft := store.manifest(refs["sft"].key)["metrics"]["sft/eval_loss"])
    assert children["sft"].data.metrics["sft/eval_loss"] == pytest.approx(m_sft)


def test_unreachable_mlflow_server_is_a_config_error_in_seconds():
    from tests.conftest import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"tracking.mlflow_uri 'http://127.0.0.1:\d+' does not answer .*mlflow server"):
        check_mlflow(TrackingConfig(mlflow_uri=uri))
    assert time.perf_counter() - t < 15
