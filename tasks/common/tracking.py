"""What a stage's run looks like in the tools users watch: TensorBoard and MLflow.

A ``Tracker`` per training stage writes every scalar it is given to TensorBoard event files in a
local folder that the stage publishes as ``tensorboard/`` inside its artifact (so
``tensorboard --logdir`` on a fetched artifact shows the run), and, when ``tracking.mlflow_uri``
is set, to an MLflow run nested under the pipeline's run (``tracking.mlflow_parent_run_id``,
which the flow sets). Stages call it from the process that trains (rank 0); listeners added
with ``listen`` (the flow's Prefect progress artifact) hear every ``log`` made in this process.

Only pydantic at import time: tensorboard and mlflow are imported where they are used.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, Field

TB_DIR = "tensorboard"
_listeners: list[Callable[[str, int, int | None, dict], None]] = []


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = Field(True, description="Write TensorBoard event files into each training stage's artifact (tensorboard/).")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI (http://127.0.0.1:5000, a databricks URI, ...). Set: one MLflow run per pipeline run, a nested run per stage (cached ones too, from their manifests).")
    mlflow_experiment: str = Field("rlhf", description="MLflow experiment the runs go to (created when missing).")
    mlflow_parent_run_id: str | None = Field(None, description="MLflow run the stages' runs nest under. The flow sets it to the pipeline run it opens; set it yourself to nest a stage called on its own.")


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"sft.lr": "0.005", ...}, the shape MLflow params take (values <= 6000 chars)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, name + "."))
        else:
            out[name] = (v if isinstance(v, str) else json.dumps(v, default=str))[:6000]
    return out


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics record (``iteration``/``step`` are the x axis, not a curve)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("iteration", "step")}


def check_mlflow(cfg: TrackingConfig) -> None:
    """An HTTP tracking server that does not answer is a config error, found in seconds (MLflow's
    own client retries for minutes), before any stage starts."""
    import urllib.request

    uri = cfg.mlflow_uri or ""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10).read()
    except Exception as e:  # URLError, timeouts, HTTP errors: the message says which
        raise ValueError(f"tracking.mlflow_uri {uri!r} does not answer ({type(e).__name__}: {e}): start the server "
                         "(mlflow server --host 127.0.0.1 --port 5000) or leave tracking.mlflow_uri unset") from None


def _client(cfg: TrackingConfig):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=cfg.mlflow_uri)


class MlflowRun:
    """One MLflow run driven through ``MlflowClient`` (no global state: safe in Ray workers)."""

    def __init__(self, cfg: TrackingConfig, name: str, params: Mapping[str, str], tags: Mapping[str, str] | None = None):
        self.client = _client(cfg)
        exp = self.client.get_experiment_by_name(cfg.mlflow_experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.mlflow_experiment)
        tags = {"mlflow.runName": name, **(tags or {})}
        if cfg.mlflow_parent_run_id:
            tags["mlflow.parentRunId"] = cfg.mlflow_parent_run_id
        self.run_id = self.client.create_run(exp_id, tags=tags, run_name=name).info.run_id
        self._pending: list = []
        self._flushed = time.monotonic()
        self.log_params(params)

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(k, v, now, step) for k, v in values.items()]
        if len(self._pending) >= 500 or time.monotonic() - self._flushed > 5:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self._pending), 1000):  # at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=self._pending[i:i + 1000])
        self._pending, self._flushed = [], time.monotonic()

    def end(self, status: str, tags: Mapping[str, str] | None = None) -> None:
        self.flush()
        for k, v in (tags or {}).items():
            self.client.set_tag(self.run_id, k, v)
        self.client.set_terminated(self.run_id, status)


class Tracker:
    """Scalars and text of one stage's run. ``active=False`` (ranks > 0) makes every call a no-op.

    Use as a context manager: leaving it with an exception ends the MLflow run as FAILED.
    ``write_into(out)`` puts the event files into the artifact folder about to be published;
    ``finish(uri)`` tags the MLflow run with the published artifact's URI and ends it.
    """

    def __init__(self, stage: str, cfg: TrackingConfig | None, params: Mapping[str, Any] | None = None,
                 total: int | None = None, active: bool = True):
        cfg = cfg or TrackingConfig()
        self.stage, self.total, self.active = stage, total, active
        self.dir = Path(tempfile.mkdtemp(prefix=f"rlhf-{stage}-tb-")) if active else None
        self._tb = self._mlflow = None
        if active and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / TB_DIR), flush_secs=10)
        if active and cfg.mlflow_uri:
            self._mlflow = MlflowRun(cfg, stage, flatten(params or {}), {"rlhf.stage": stage, "rlhf.cached": "false"})

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.fail()
        self.close()

    def fail(self) -> None:
        """The stage raised: its MLflow run ends FAILED."""
        if self._mlflow is not None:
            self._mlflow.end("FAILED")
            self._mlflow = None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.active:
            return
        values = scalars(metrics)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._mlflow is not None:
            self._mlflow.log(step, values)
        for fn in _listeners:
            fn(self.stage, step, self.total, dict(metrics))

    def text(self, tag: str, markdown: str, step: int) -> None:
        """A markdown block in TensorBoard's text tab (tables render)."""
        if self.active and self._tb is not None:
            self._tb.add_text(tag, markdown, step)

    def write_into(self, out: str | Path) -> None:
        """Copy the event files into ``out/tensorboard`` (the artifact folder before publish)."""
        if self.active and self._tb is not None:
            self._tb.flush()
            shutil.copytree(self.dir / TB_DIR, Path(out) / TB_DIR, dirs_exist_ok=True)

    def finish(self, artifact_uri: str) -> None:
        if self.active and self._mlflow is not None:
            self._mlflow.end("FINISHED", {"rlhf.artifact_uri": artifact_uri})
            self._mlflow = None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._mlflow is not None:  # left without finish(): the stage stopped early (a checkpoint)
            self._mlflow.end("KILLED")
            self._mlflow = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


@contextmanager
def listen(fn: Callable[[str, int, int | None, dict], None]) -> Iterator[None]:
    """Call ``fn(stage, step, total, metrics)`` on every ``Tracker.log`` of this process meanwhile."""
    _listeners.append(fn)
    try:
        yield
    finally:
        _listeners.remove(fn)


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files under ``logdir``: tag -> [(step, value)], by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


def read_texts(logdir: str | Path) -> dict[str, list[tuple[int, str]]]:
    """Every text series (``Tracker.text``) under ``logdir``: tag -> [(step, markdown)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        if tag.endswith("/text_summary"):
            out[tag.removesuffix("/text_summary")] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
    return out


def run_pipeline_tracked(cfg, run_stages: Callable[[Any], dict]) -> dict:
    """``run_stages(cfg)`` inside the pipeline's MLflow run when ``cfg.tracking.mlflow_uri`` is set:
    the whole config as params; the stages' runs nest under it (``mlflow_parent_run_id``); every
    stage's artifact URI (cached ones too) as a tag ``rlhf.artifact.<stage>``. ``cfg`` is the
    flow's ``PipelineConfig``; ``run_stages`` returns stage -> ``ArtifactRef``."""
    if not cfg.tracking.mlflow_uri:
        return run_stages(cfg)
    check_mlflow(cfg.tracking)
    started = datetime.now(timezone.utc)
    parent = MlflowRun(cfg.tracking, "rlhf", flatten(cfg.model_dump(mode="json")), {"rlhf.store": cfg.store.uri})
    tracking = cfg.tracking.model_copy(update={"mlflow_parent_run_id": parent.run_id})
    try:
        refs = run_stages(cfg.model_copy(update={"tracking": tracking}))
        record_untracked_stages(cfg, tracking, refs, started)
    except BaseException:
        parent.end("FAILED")
        raise
    parent.end("FINISHED", {f"rlhf.artifact.{stage}": ref.uri for stage, ref in refs.items()})
    return refs


def record_untracked_stages(cfg, tracking: TrackingConfig, refs: Mapping[str, Any], started: datetime) -> None:
    """A nested run, from its manifest, for every stage that made none in this pipeline run: a
    cached stage (its artifact was created before ``started``: tag ``rlhf.cached`` true) and data
    prep, which does not train. Params are the manifest's config, metrics its scalars (step 0),
    the same names a trained stage's run has; a trained stage's run is tagged ``rlhf.cached`` false."""
    from storage.store import ArtifactStore

    client = _client(tracking)
    exp = client.get_experiment_by_name(tracking.mlflow_experiment)
    tracked = {r.data.tags.get("rlhf.stage") for r in client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{tracking.mlflow_parent_run_id}'")}
    store = ArtifactStore(cfg.store.resolved_uri(), cfg.store.storage_options)
    for stage, ref in refs.items():
        if stage in tracked:
            continue
        m = store.manifest(ref.key)
        created = datetime.strptime(m["created_at"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
        cached = created < started
        run = MlflowRun(tracking, stage, flatten(m["config"]), {"rlhf.stage": stage, "rlhf.cached": str(cached).lower(),
                                                                "rlhf.artifact_created_at": m["created_at"]})
        run.log(0, scalars(m["metrics"]))
        run.end("FINISHED", {"rlhf.artifact_uri": ref.uri})

