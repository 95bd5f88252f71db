"""What the console shows (flows/console.py): bars on a terminal, plain lines elsewhere, and no
library notices for what we expect. Each case runs in a child process: a real local Ray whose
worker runs a stage's console with a Tracker, its output read from a pipe or from a pseudo-terminal.
The whole pipeline's piped output is checked in tests/test_flow.py (``assert_quiet``).
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOISE = ("FutureWarning", "LOAD REPORT", "save_embedding_layers", "attempted to send logs to the API",
         "Loading weights", "Started a local Ray instance", "Connecting to an existing Ray instance")

STAGE = r"""
import logging, time, ray
from flows.config import RayConfig
from flows.console import setup_cli
from flows.runtime import ray_init_kwargs

setup_cli("run")
ray.init(**{**ray_init_kwargs(RayConfig(num_cpus=1)), "_temp_dir": __import__("os").environ["RAY_TMPDIR"]})

@ray.remote
def stage():
    from flows.console import stage_console
    from tasks.common.tracking import Tracker, TrackingConfig

    log = logging.getLogger("rlhf.sft")
    with stage_console("sft"), Tracker("sft", TrackingConfig(tensorboard=False), total=12) as tracker:
        for step in range(1, 13):
            tracker.log(step, {"sft/loss": 2.0 / step})
            log.info("sft step %d/%d loss %.4f", step, 12, 2.0 / step)
            time.sleep(0.15)
        log.info("sft eval step %d eval_loss %.4f", 12, 0.5)
    return "done"

print("result", ray.get(stage.remote()))
time.sleep(1.5)  # the driver prints what the worker wrote last
ray.shutdown()
"""


def assert_quiet(out: str) -> None:
    """No library notice for an expected situation in ``out`` (a run's console)."""
    found = [n for n in NOISE if n in out]
    assert not found, f"library noise {found} in:\n{out[-4000:]}"


@pytest.fixture
def ray_tmp():
    """A private, short Ray temp dir (Ray's socket paths must stay under 108 bytes)."""
    path = tempfile.mkdtemp(prefix="rlhf-console-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(ray_tmp) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RLHF_PROGRESS", "RAY_COLOR_PREFIX", "PREFECT_API_URL")}
    return {**env, "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp}


def test_piped_output_has_plain_step_lines_without_colour(ray_tmp):
    p = subprocess.run([sys.executable, "-c", STAGE], capture_output=True, text=True, timeout=180, env=_env(ray_tmp), cwd=REPO)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "result done" in out
    steps = [line for line in out.splitlines() if " rlhf.sft sft step " in line]
    assert len(steps) == 12 and steps[0].startswith("(stage pid="), out[-4000:]  # every step, Ray's plain prefix
    assert "sft eval step 12 eval_loss 0.5000" in out
    assert "\x1b[" not in out and "\r" not in out and "__ray_tqdm_magic_token__" not in out
    assert_quiet(out)


def test_terminal_output_is_one_updating_bar_instead_of_step_lines(ray_tmp):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))  # a terminal 140 columns wide
    proc = subprocess.Popen([sys.executable, "-c", STAGE], stdin=slave, stdout=slave, stderr=slave, env=_env(ray_tmp), cwd=REPO)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 180)
        if not ready:
            proc.kill()
            pytest.fail("no output from the child for 180 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(30) == 0
    out = b"".join(chunks).decode(errors="replace")
    assert "result done" in out, out[-4000:]
    assert "sft step" not in out  # the bar replaces the step lines...
    assert "sft eval step 12 eval_loss 0.5000" in out  # ...not the eval lines
    final = [seg for seg in out.replace("\n", "\r").split("\r") if "100%|" in seg]
    assert final and "sft loss 0.1667" in final[-1] and "12.0/12.0" in final[-1], out[-3000:]
    assert_quiet(out)


def test_model_loads_print_no_library_notices(tmp_path):
    """The reward model's body from a causal LM's checkpoint (transformers' load report) and a
    LoRA wrap (PEFT reading transformers' deprecated `is_gradient_checkpointing`), with Python's
    default warning filters, in a run's environment."""
    from flows.console import RUN_ENV

    code = r"""
import logging, warnings
from peft import LoraConfig, get_peft_model
from tasks.common.model import ModelConfig, load_causal_lm
from tasks.rm.model import build_reward_model

logging.basicConfig(level=logging.INFO)
cfg = ModelConfig()
get_peft_model(load_causal_lm(cfg), LoraConfig(r=4, target_modules=["q_proj"]))
build_reward_model(cfg)
print("loaded")
"""
    p = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=180,
                       env={**_env(str(tmp_path)), **RUN_ENV, "RLHF_CACHE": str(tmp_path / "cache")}, cwd=REPO)
    assert p.returncode == 0 and "loaded" in p.stdout, p.stderr[-4000:]
    assert_quiet(p.stdout + p.stderr)
    assert "not sharded" not in p.stderr and "Warning" not in p.stderr, p.stderr[-4000:]
