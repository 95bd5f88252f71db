"""The ColossalAI strategies' install closure and its preflight check (issue 19).

CI has no ColossalAI, and these tests install nothing: the check (``import_failure``) runs the
exact imports in a fresh interpreter, so a partial install is made honestly from what exists — a
bare virtual environment (the standard library only) with this checkout on PYTHONPATH, where a
real project module is present and the real library it imports is not. That is the shape of the
failure the issue hit (``colossalai.booster`` present, ``galore_torch`` it imports absent). The
check over the real closure with ColossalAI installed was run in a scratch venv of the project's
pins (issue 19's report); its output is the record used in ``test_problem_names_the_piece``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.ppo.config import PPOConfig
from tasks.ppo.group import COLOSSALAI_DISTRIBUTIONS, colossalai_imports, colossalai_problem, import_failure
from tasks.ppo.train import check_ppo

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A virtual environment with no packages (not even pip), and an environment putting this
    checkout, and nothing else, on its path."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return str(venv / "bin" / "python"), {**env, "PYTHONPATH": str(ROOT)}


def test_the_check_imports_what_the_workers_import():
    """Derived from tasks/ppo/group.py's own import statements, in the order the workers run them:
    launch_from_torch (init_group), then the Booster, both plugins and HybridAdam (wrap_learner)."""
    assert colossalai_imports() == [("colossalai", None), ("colossalai", "launch_from_torch"),
                                    ("colossalai.booster", "Booster"), ("colossalai.booster.plugin", "GeminiPlugin"),
                                    ("colossalai.booster.plugin", "LowLevelZeroPlugin"),
                                    ("colossalai.nn.optimizer", "HybridAdam")]
    assert set(COLOSSALAI_DISTRIBUTIONS) >= {"colossalai", "galore_torch", "bitsandbytes"}


def test_the_extra_is_the_closure_less_colossalai():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["colossalai"]
    assert sorted(extra) == sorted(v for k, v in COLOSSALAI_DISTRIBUTIONS.items() if k != "colossalai")


def test_a_missing_dependency_of_a_present_module_is_named(bare_python):
    """A present module whose import chain reaches an absent one: the absent one is named, not
    the module asked for; what came before it passed."""
    python, env = bare_python
    f = import_failure([("json", "dumps"), ("tasks.ppo.losses", "ppo_clip_loss")], python=python, env=env)
    assert f == {"module": "tasks.ppo.losses", "name": "ppo_clip_loss", "type": "ModuleNotFoundError",
                 "error": "No module named 'torch'", "missing": "torch"}
    msg = colossalai_problem("colossalai_gemini", f)
    assert "`from tasks.ppo.losses import ppo_clip_loss` fails here" in msg
    assert "the missing piece is 'torch', not one this project knew ColossalAI to need" in msg
    assert "scripts/setup.sh --colossalai" in msg and "or use ppo.strategy 'ddp'" in msg


def test_a_name_the_module_lacks_is_a_failure(bare_python):
    """API drift (a renamed class in another ColossalAI release) fails the check too."""
    python, env = bare_python
    f = import_failure([("json", "dumps"), ("json", "no_such_plugin")], python=python, env=env)
    assert (f["module"], f["name"], f["type"], f["missing"]) == ("json", "no_such_plugin", "AttributeError", None)
    assert import_failure([("json", "dumps"), ("tasks.ppo", None)], python=python, env=env) is None  # all present


def test_the_real_closure_without_colossalai(bare_python):
    """The real list of imports, where ColossalAI is absent: the first import fails, named with
    its pinned distribution and the install command."""
    python, env = bare_python
    f = import_failure(colossalai_imports(), python=python, env=env)
    assert (f["module"], f["missing"]) == ("colossalai", "colossalai")
    msg = colossalai_problem("colossalai_zero2", f)
    assert "the missing piece is 'colossalai' (pip distribution colossalai==0.5.0)" in msg
    assert "`scripts/setup.sh --colossalai` (= pip install --no-deps colossalai==0.5.0 galore-torch==1.0 bitsandbytes==0.50.2" in msg


def test_problem_names_the_piece():
    """The failure the check reported in the scratch venv (the project's pins + colossalai 0.5.0,
    einops, contexttimer, without galore-torch): the issue's late ModuleNotFoundError, now named
    at preflight with its distribution."""
    f = {"module": "colossalai.booster", "name": "Booster", "type": "ModuleNotFoundError",
         "error": "No module named 'galore_torch'", "missing": "galore_torch"}
    msg = colossalai_problem("colossalai_gemini", f)
    assert msg.startswith("ppo.strategy 'colossalai_gemini' needs ColossalAI: `from colossalai.booster import Booster` fails here")
    assert "the missing piece is 'galore_torch' (pip distribution galore-torch==1.0)" in msg


def test_check_ppo_stops_before_the_cuda_check():
    """In this environment (no ColossalAI) check_ppo names the import, for either strategy, even
    where the config also asks for CPU learners."""
    for strategy in ("colossalai_zero2", "colossalai_gemini"):
        with pytest.raises(ValueError, match=rf"ppo.strategy '{strategy}' needs ColossalAI: `import colossalai` fails here"):
            check_ppo(PPOConfig(strategy=strategy, device="cpu"))


def test_gemini_is_eager_under_compile_auto_and_refuses_compile_on():
    """Gemini's chunk hooks do not trace (an InternalTorchDynamoError in colossalai's
    cuda_accelerator.stream on the H200, a 0.3B model through the flow): 'auto' leaves its
    learners eager, 'on' is refused with the fields named and the fix."""
    from tasks.ppo.group import wants_compile

    # model None: no size to check, so only the device and the strategy decide
    assert wants_compile("auto", "cuda", None, "colossalai_zero2")
    assert not wants_compile("auto", "cuda", None, "colossalai_gemini")
    assert wants_compile("on", "cpu", None, "ddp")
    with pytest.raises(ValueError, match=r"ppo.compile 'on' with ppo.strategy 'colossalai_gemini'.*use ppo.compile 'auto'"):
        PPOConfig(compile="on", strategy="colossalai_gemini")
    assert PPOConfig(compile="auto", strategy="colossalai_gemini").compile == "auto"


def test_the_offloading_strategies_say_how_many_threads_adam_gets():
    """ZeRO-2 / Gemini step Adam on the CPU with the learner's CPUs as threads (6.1 s against DDP's
    0.68 s at 0.3B on the H200 with the default 0.5): the placement log says so with the fix,
    naming only the learners that run and have fewer than 2."""
    from tasks.ppo.train import offload_thread_hint

    assert offload_thread_hint(PPOConfig(strategy="ddp")) is None
    hint = offload_thread_hint(PPOConfig(strategy="colossalai_zero2", critic={"cpus_per_worker": 8}))
    assert "actor has 0.5" in hint and "critic" not in hint and "--set ppo.actor.cpus_per_worker=4" in hint
    hint = offload_thread_hint(PPOConfig(strategy="colossalai_gemini", advantage="grpo", n_samples_per_prompt=2))
    assert "actor has 0.5" in hint and "critic" not in hint  # critic-free: no critic group
    assert offload_thread_hint(PPOConfig(strategy="colossalai_zero2", actor={"cpus_per_worker": 2},
                                         critic={"cpus_per_worker": 4})) is None


def test_gemini_with_its_parameters_offloaded_says_what_that_costs_whatever_its_threads():
    """Gemini's 'seed' offload copies every parameter to the GPU at each forward (no 0.3B PPO
    iteration in 190 s on the H200): the placement log says so, with the fields that keep them there."""
    from tasks.ppo.train import offload_thread_hint

    threads = {"actor": {"cpus_per_worker": 4}, "critic": {"cpus_per_worker": 4}}
    hint = offload_thread_hint(PPOConfig(strategy="colossalai_gemini", **threads))
    assert "keeps Gemini's parameters on the CPU too" in hint and "threads" not in hint
    assert "--set ppo.colossalai_offload=optimizer" in hint and hint.endswith("(--set ppo.colossalai_offload=none)")
    hint = offload_thread_hint(PPOConfig(strategy="colossalai_gemini"))
    assert "actor has 0.5" in hint and "Gemini's parameters" in hint
    assert offload_thread_hint(PPOConfig(strategy="colossalai_gemini", colossalai_offload="optimizer", **threads)) is None
    assert "Gemini's parameters" not in offload_thread_hint(PPOConfig(strategy="colossalai_zero2"))


def test_colossalai_offload_picks_what_stays_on_the_cpu_and_only_for_colossalai():
    """ppo.colossalai_offload: 'seed' as the seed has it, 'none' keeps Adam on the GPU (so no
    thread hint), and the field is refused beside a strategy it does not shape."""
    from tasks.ppo.train import offload_thread_hint

    assert PPOConfig().colossalai_offload == "seed"
    assert offload_thread_hint(PPOConfig(strategy="colossalai_gemini", colossalai_offload="none")) is None
    hint = offload_thread_hint(PPOConfig(strategy="colossalai_gemini", colossalai_offload="optimizer"))
    assert "--set ppo.colossalai_offload=none" in hint
    with pytest.raises(ValueError, match=r"ppo.colossalai_offload 'none' applies to ppo.strategy 'colossalai_zero2'.*not 'fsdp'"):
        PPOConfig(strategy="fsdp", colossalai_offload="none")
    with pytest.raises(ValueError, match=r"colossalai_offload"):
        PPOConfig(strategy="colossalai_zero2", colossalai_offload="params")
