"""What a person running ``rlhf`` sees on the console, set up in one place.

- **Terminal** (stderr is a TTY): one updating bar per training stage, with its latest headline
  metrics. The bar is drawn by the driver (the ``rlhf`` process) from the state the stage's Ray
  worker sends it: Ray's distributed tqdm protocol (``ray.experimental.tqdm_ray``), whose driver
  side Ray runs for every forwarded line that carries its token. The per-step lines the stages
  log are left out; eval lines, warnings and errors still print above the bars.
- **Anything else** (CI, a pipe, a Prefect worker's log): the stages' plain step lines, without
  colour codes.

Library notices for situations we expect are silenced where they arise (tasks/common/model.py,
tasks/rm/model.py); here only what is about processes: environment, handlers, levels.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

MODE_ENV = "RLHF_PROGRESS"  # "bars" or "lines": how stage processes show their steps

# Every process of a run: set in the CLI's environment, forwarded to Ray workers (flows/runtime.py).
RUN_ENV = {
    "RAY_AUTH_MODE": "disabled",  # local Ray without a token file
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf",  # stage progress lines reach Prefect's logs
    # rlhf.* loggers also log outside a flow run (PPO role workers, stage functions called on
    # their own): those lines are for the console, not a mistake worth a UserWarning each.
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # No transformers/hub bars ("Loading weights", "Writing model shards"): a Ray worker's output
    # reaches the console line by line, where a redrawn bar is one garbled line, and the run's
    # own bars say where it is. `rlhf export` / `generate` keep them.
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
RUN_COMMANDS = ("run", "serve", "config", "verify", "ls")

# The messages of per-step lines (``record.msg``, before formatting) a bar replaces.
STEP_LINES = ("sft step %d/%d", "rm step %d/%d", "ppo %d/%d ")
# What each stage's bar shows after its counter: metric -> label.
BAR_METRICS = {"sft": {"sft/loss": "loss", "sft/eval_loss": "eval_loss"},
               "rm": {"rm/loss": "loss", "rm/eval_accuracy": "eval_acc"},
               "ppo": {"ppo/reward_mean": "reward", "ppo/kl": "kl", "ppo/response_length": "len", "eval/true_score": "true"}}


def bars() -> bool:
    return os.environ.get(MODE_ENV) == "bars"


def setup_cli(cmd: str) -> None:
    """The CLI process: environment for the whole run, one console handler, library levels."""
    for k, v in RUN_ENV.items():
        if cmd in RUN_COMMANDS or k != "HF_HUB_DISABLE_PROGRESS_BARS":
            os.environ.setdefault(k, v)
    os.environ.setdefault(MODE_ENV, "bars" if sys.stderr.isatty() else "lines")
    if not bars():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray's "(sft pid=...)" prefixes without ANSI colours
    handler = BarSafeHandler() if bars() else logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler.addFilter(_quiet_driver)
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("rlhf").setLevel(logging.INFO)


def _quiet_driver(record: logging.LogRecord) -> bool:
    """A filter on the console handler (loggers' own levels are reset when Prefect configures logging):
    prefect-ray's "Connecting to an existing Ray instance at local" and node count; rlhf.flow says which Ray."""
    return not (record.name == "prefect.task_runner.ray" and record.levelno < logging.WARNING)


@contextmanager
def stage_console(stage: str) -> Iterator[None]:
    """The process running a stage (a Ray worker): ``rlhf.*`` lines on its stderr, which Ray
    forwards to the driver's console; with bars, the stage's steps as a bar instead of lines."""
    lg = logging.getLogger("rlhf")
    lg.setLevel(logging.INFO)
    handler = next((h for h in lg.handlers if getattr(h, "_rlhf", False)), None)
    if handler is None:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s", "%H:%M:%S"))
        handler._rlhf = True
        lg.addHandler(handler)
        lg.propagate = False
    if not bars() or stage not in BAR_METRICS or not _in_ray_worker():  # a cached stage runs in the driver
        yield
        return
    from tasks.common.tracking import listen

    bar = _RayBar(stage)
    step_filter = _DropStepLines()
    handler.addFilter(step_filter)
    try:
        with listen(bar.on_log):
            yield
    finally:
        handler.removeFilter(step_filter)
        bar.close()


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is at each record (a test's capture, a redirect),
    not the stream of the moment it was made, which may be closed by then."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE


class _DropStepLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(STEP_LINES))


class _RayBar:
    """One stage's bar, sent as Ray's tqdm_ray state lines on stderr (at most one a second, and
    the last). Not ``tqdm_ray.tqdm`` itself: it prints to stdout, which Prefect's ``log_prints``
    turns into log records inside a task, so the driver would never see the token."""

    def __init__(self, stage: str):
        from ray._private.services import get_node_ip_address

        self.stage, self.values, self.sent = stage, {}, 0.0
        self.state = {"x": 0, "pos": 0, "desc": stage, "total": None, "unit": "it", "ip": get_node_ip_address(),
                      "pid": os.getpid(), "uuid": uuid.uuid4().hex, "closed": False}

    def on_log(self, stage: str, step: int, total: int | None, metrics: dict) -> None:
        if stage != self.stage:
            return
        self.values.update((k, v) for k, v in metrics.items() if k in BAR_METRICS[stage] and isinstance(v, (int, float)))
        shown = " ".join(f"{label} {self.values[k]:.4g}" for k, label in BAR_METRICS[stage].items() if k in self.values)
        self.state.update(x=max(self.state["x"], step), total=total, desc=f"{stage} {shown}".strip())
        if time.monotonic() - self.sent > 1.0 or (total and step >= total):
            self._send()

    def close(self) -> None:
        if self.sent:  # no bar when this process heard no step (the ranks of a multi-worker stage log elsewhere)
            self.state["closed"] = True
            self._send()

    def _send(self) -> None:
        from ray.experimental.tqdm_ray import RAY_TQDM_MAGIC

        sys.stderr.write(json.dumps({"__magic_token__": RAY_TQDM_MAGIC, **self.state}) + "\n")
        sys.stderr.flush()
        self.sent = time.monotonic()


class BarSafeHandler(logging.StreamHandler):
    """The driver's console handler with bars: clears the bars Ray draws before a line, redraws after.
    (Public name: Prefect replaces a root handler whose class name starts with "_".)"""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm_ray = sys.modules.get("ray.experimental.tqdm_ray")
        if tqdm_ray is None or tqdm_ray._manager is None:  # no bar drawn yet
            return super().emit(record)
        tqdm_ray.instance().hide_bars()
        try:
            super().emit(record)
        finally:
            tqdm_ray.instance().unhide_bars()
