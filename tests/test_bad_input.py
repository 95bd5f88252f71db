"""Bad input: every mistake is a clear error naming the field, the value and the fix, raised before
any model loads, and nothing already in the store is lost.

Each case is run through the real CLI entry point (``flows.cli.main(["run", ...])``: load_config
+ preflight) in one child process, so all of them cost one interpreter start. For each case the
child records the exit status, stderr and the time taken; afterwards it reports whether Prefect
or Ray were ever imported (they are imported only once preflight has passed, so "no" proves
that no stage, server or model started). A few cases also run as the real ``rlhf`` console
script. The store the cases point at already holds a published artifact: it must be intact,
and the store root byte-for-byte unchanged, after every failure.

Decided: a prompt longer than ``data.max_prompt_length`` (or a pair longer than
``data.max_length``) is not an error. It is cut from the left (the end of a prompt, where the
response starts, is kept) and counted in the dataset's ``meta.json`` (``truncated``) and in the
``data/truncated`` metric; pairs whose response alone does not fit are dropped and counted in
``dropped``. Only when too few samples remain to split train/eval is it an error naming
data.max_length (tests/test_data.py::test_prepare_user_files_truncates_and_drops covers the
counts; ``test_overlong_prompts_pass_preflight_and_are_counted`` below the whole path).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from storage import ArtifactStore
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-" + secrets.token_hex(8)

# (id, argv after "run", extra env, fragments that must all be on stderr)
# {d}: folder with the bad files, {s3}: the moto endpoint, {s3auth}: a moto endpoint enforcing auth,
# {port}: a closed port. Every case also gets --set store.uri=<a store holding an artifact> first.
CASES = [
    ("empty-data-file", ["--set", "data.sft_path={d}/empty.jsonl"], {},
     ["data.sft_path", "empty.jsonl", "is empty", "needs at least one record"]),
    ("missing-data-file", ["--set", "data.preference_path={d}/nope.jsonl"], {},
     ["data.preference_path", "nope.jsonl", "no such file", "check the path"]),
    ("malformed-jsonl", ["--set", "data.preference_path={d}/malformed.jsonl"], {},
     ["data.preference_path", "malformed.jsonl", "line 3: malformed JSON", "each line must be one JSON object"]),
    ("missing-rejected", ["--set", "data.preference_path={d}/no_rejected.jsonl"], {},
     ["data.preference_path", "line 2: missing key 'rejected'", "a preference record needs chosen and rejected", "data.columns"]),
    ("missing-chosen", ["--set", "data.preference_path={d}/no_chosen.jsonl"], {},
     ["data.preference_path", "line 1: missing key 'chosen'"]),
    ("missing-prompt", ["--set", "data.prompts_path={d}/no_prompt.jsonl"], {},
     ["data.prompts_path", "no_prompt.jsonl", "line 1", "a record needs prompt", "data.columns.prompt=question"]),
    ("non-utf8", ["--set", "data.sft_path={d}/latin1.txt"], {},
     ["data.sft_path", "latin1.txt", "line 2", "not UTF-8", "re-save the file as UTF-8"]),
    ("model-path-missing", ["--set", "model.pretrain=/nonexistent/model"], {},
     ["model.pretrain", "'/nonexistent/model'", "no such folder", "'builtin:tiny'"]),
    ("model-name-offline", ["--set", "model.pretrain=no-such-org/no-such-model-7q"], {"HF_HUB_OFFLINE": "1"},
     ["model.pretrain", "'no-such-org/no-such-model-7q'", "could not be resolved", "give a local path"]),
    ("tokenizer-without-pad", ["--set", "model.tokenizer={d}/tok_nospecial"], {},
     ["model.tokenizer", "tok_nospecial", "neither pad, unk nor eos token", "set model.tokenizer to one that has"]),
    ("tokenizer-missing", ["--set", "model.tokenizer={d}/no_tokenizer_here"], {},
     ["model.tokenizer", "no_tokenizer_here", "no tokenizer could be loaded", "point it at"]),
    ("lora-targets-sft", ["--set", "sft.target_modules=[q_proj, c_attn]"], {},
     ["sft.target_modules", "['c_attn'] not found", "'v_proj'", "or 'auto'"]),
    ("lora-targets-rm", ["--set", "rm.lora_rank=4", "--set", "rm.target_modules=[query]"], {},
     ["rm.target_modules", "['query'] not found", "or 'auto'"]),
    ("ppo-batch-not-dividing", ["--set", "ppo.train_batch_size=12"], {},
     ["ppo.rollout_batch_size (32)", "ppo.train_batch_size (1 x 12 = 12)", "rollout_batch_size=36"]),
    ("ppo-workers-not-dividing", ["--set", "ppo.critic.num_workers=3"], {},
     ["ppo.critic.num_workers", "(3 x 8 = 24)", "rollout_batch_size=24"]),
    ("zero-lr", ["--set", "sft.lr=0"], {}, ["`sft.lr` (0)", "greater than 0"]),
    ("negative-lr", ["--set", "ppo.actor_lr=-0.001"], {}, ["`ppo.actor_lr` (-0.001)", "greater than 0"]),
    ("unknown-strategy", ["--set", "ppo.strategy=deepspeed"], {},
     ["`ppo.strategy` ('deepspeed')", "'ddp'", "'fsdp'", "'colossalai_zero2'"]),
    ("colossalai-missing", ["--set", "ppo.strategy=colossalai_zero2"], {},
     ["ppo.strategy 'colossalai_zero2' needs ColossalAI", "pip install --no-deps colossalai", "or use ppo.strategy 'ddp'"]),
    ("gpu-for-stage", ["--set", "resources.ppo.num_gpus=1"], {},
     ["resources.ppo.num_gpus", "(1.0)", "0 GPU(s)", "set it to 0"]),
    ("gpu-for-role", ["--set", "ppo.actor.gpus_per_worker=1"], {},
     ["ppo.actor.gpus_per_worker", "(1.0)", "no GPU here", "set it to 0"]),
    ("ray-unreachable", ["--set", "ray.address=127.0.0.1:{port}"], {},
     ["ray.address", "127.0.0.1:{port}", "nothing answers", "ray start --head"]),
    ("unknown-scheme", ["--set", "store.uri=foo://x"], {},
     ["store.uri", "foo://x", "unknown or unavailable fsspec protocol 'foo'", "use file://"]),
    ("s3-no-bucket", ["--set", "store.uri=s3://no-such-bucket-rlhf/a",
                      "--set", "store.storage_options={client_kwargs: {endpoint_url: '{s3}'}}"], {},
     ["store.uri", "s3://no-such-bucket-rlhf/a", "cannot write to the artifact store", "that the bucket exists"]),
    ("s3-bad-credentials", ["--set", "store.uri=s3://rlhf-auth/a",
                            "--set", "store.storage_options={client_kwargs: {endpoint_url: '{s3auth}'}}"],
     {"AWS_ACCESS_KEY_ID": "AKIAWRONG0000000", "AWS_SECRET_ACCESS_KEY": SECRET},
     ["store.uri", "s3://rlhf-auth/a", "Access Key Id you provided does not exist", "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"]),
    ("unknown-key", ["--set", "sft.lrr=1e-4"], {}, ["`sft.lrr` is not a known setting of `sft`", "fix its spelling"]),
    ("unknown-section", ["--set", "optimizer.lr=1"], {}, ["`optimizer` is not a known setting", "remove it"]),
    ("not-key-value", ["--set", "sft.lr"], {}, ["override 'sft.lr' is not key=value", "--set sft.lr=1e-4"]),
    ("bad-yaml", ["--config", "{d}/bad.yaml"], {}, ["--config", "bad.yaml", "is not valid YAML", "line 2"]),
    ("yaml-not-mapping", ["--config", "{d}/list.yaml"], {}, ["--config", "list.yaml", "must hold a mapping of sections"]),
    ("config-file-missing", ["--config", "{d}/nope.yaml"], {}, ["--config", "nope.yaml", "no such file"]),
    ("credentials-in-store-options", ["--set", f"store.storage_options={{secret: {SECRET}}}"], {},
     ["store.storage_options", "credential keys ['secret']", "set them in the environment"]),
    ("credentials-in-data-options", ["--set", f"data.storage_options={{key: AKIA1, token: {SECRET}}}"], {},
     ["data.storage_options", "['key', 'token']", "set them in the environment"]),
    ("template-without-placeholder", ["--set", "data.prompt_template=Q: A:"], {},
     ["data.prompt_template", "'Q: A:'", "no {prompt} placeholder", "write e.g."]),
    ("refresh-unknown-stage", ["--refresh", "sfft"], {}, ["refresh", "['sfft']", "use some of"]),
    # critic-free estimators and rewards by code (tasks/ppo/rewards.py)
    ("grpo-group-not-dividing", ["--set", "ppo.advantage=grpo", "--set", "ppo.n_samples_per_prompt=5"], {},
     ["ppo.n_samples_per_prompt (5) must divide ppo.rollout_batch_size (32)", "rollout_batch_size=30"]),
    ("reward-function-not-importable", ["--set", "ppo.advantage=rloo", "--set", "ppo.n_samples_per_prompt=4",
                                        "--set", "ppo.rewards=[{kind: function, function: 'no_such_pkg.verify:score'}]"], {},
     ["ppo.rewards[0].function 'no_such_pkg.verify:score'", "does not import", "install it on every node"]),
    ("reward-function-wrong-signature", ["--set", "ppo.advantage=rloo", "--set", "ppo.n_samples_per_prompt=4",
                                         "--set", "ppo.rewards=[{kind: function, function: 'math:sqrt'}]"], {},
     ["ppo.rewards[0].function 'math:sqrt'", "cannot be called as fn(prompts, responses, **metadata)",
      "def sqrt(prompts, responses, **metadata)"]),
    ("reward-server-down", ["--set", "ppo.advantage=rloo", "--set", "ppo.n_samples_per_prompt=4",
                            "--set", "ppo.rewards=[{kind: http, url: 'http://127.0.0.1:{port}/score', version: v1}]"], {},
     ["ppo.rewards[0].url 'http://127.0.0.1:{port}/score'", "nothing answers", "start the reward server"]),
    ("reward-server-no-version", ["--set", "ppo.rewards=[{kind: http, url: 'http://127.0.0.1:{port}/score'}]"], {},
     ["ppo.rewards.0", "needs `version`", "version='v1'"]),
    ("prompt-metadata-missing", ["--set", "data.prompt_metadata=[answer]"], {},
     ["data.prompt_metadata lists 'answer'", "add it to every prompts record"]),
    ("decode-attention-without-fast-generate", ["--set", "ppo.decode_attention=triton", "--set", "ppo.fast_generate=off"], {},
     ["ppo.decode_attention 'triton' is FastGenerator's", "ppo.fast_generate is 'off'", "set ppo.decode_attention 'sdpa'"]),
    ("decode-attention-triton-on-cpu", ["--set", "ppo.decode_attention=triton", "--set", "ppo.device=cpu"], {},
     ["ppo.decode_attention 'triton' is a CUDA kernel", "ppo.device 'cpu'", "give the actor a GPU"]),
    ("decode-linear-triton-on-cpu", ["--set", "ppo.decode_linear=triton", "--set", "ppo.device=cpu"], {},
     ["ppo.decode_linear 'triton' is a CUDA kernel", "ppo.device 'cpu'", "set ppo.decode_linear 'cublas'"]),
]

DRIVER = r"""
import contextlib, io, json, os, sys, time
cases = json.loads(sys.argv[1])
from flows.cli import main
out = []
for case in cases:
    saved = {k: os.environ.get(k) for k in case["env"]}
    os.environ.update(case["env"])
    err = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(["run", *case["argv"]])
        except SystemExit as e:
            rc = e.code
        except BaseException as e:
            rc, _ = "raised", print(f"{type(e).__name__}: {e}", file=err)
    out.append({"id": case["id"], "rc": rc, "stderr": err.getvalue(), "seconds": time.perf_counter() - t})
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "ray", "prefect_ray", "peft"})
print(json.dumps({"cases": out, "loaded": loaded}))
"""


def snapshot(root: Path) -> dict[str, str]:
    """Every file (and empty folder) under the store root, with its sha256."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


def write_bad_files(d: Path) -> None:
    lines = lambda *objs: "".join(json.dumps(o) + "\n" for o in objs)  # noqa: E731
    pair = {"prompt": "p", "chosen": "c", "rejected": "r"}
    (d / "empty.jsonl").write_text("\n  \n")
    (d / "malformed.jsonl").write_text(lines(pair, pair) + '{"prompt": "p", "chosen": \n')
    (d / "no_rejected.jsonl").write_text(lines(pair, {"prompt": "p", "chosen": "c"}))
    (d / "no_chosen.jsonl").write_text(lines({"prompt": "p", "rejected": "r"}, pair))
    (d / "no_prompt.jsonl").write_text(lines({"question": "x"}, {"prompt": "y"}))
    (d / "latin1.txt").write_bytes("The cat is kind.\nThe caf\u00e9 is warm.\n".encode("latin-1"))
    (d / "bad.yaml").write_text("sft:\n  lr: [1e-4\nrm: {}\n")
    (d / "list.yaml").write_text("- sft\n- rm\n")
    # A tokenizer with no special tokens at all (no pad, no eos, no unk).
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["the", "cat", "is", "kind", "."])}, unk_token="the"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(str(d / "tok_nospecial"))


@pytest.fixture(scope="module")
def auth_s3():
    """A second moto server that enforces credentials from its first request on
    (INITIAL_NO_AUTH_ACTION_COUNT=0): any key it has not issued through its IAM is refused."""
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        deadline = time.time() + 30
        while True:  # it answers 403 to everything, so wait for the port, not for a 200
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "moto server did not start"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory, rlhf_cache, s3_server, auth_s3):
    """Bad files, a store already holding an artifact, and the substitutions of CASES."""
    d = tmp_path_factory.mktemp("bad-input")
    write_bad_files(d)
    root = tmp_path_factory.mktemp("store-with-artifact")
    src = d / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(4096))
    store = ArtifactStore(f"file://{root}")
    ref = store.publish("sft/preexisting", src, kind="sft_adapter", metrics={"sft/eval_loss": 1.0})
    closed = free_port()  # nothing listens there (free_port closed its socket)
    subs = {"d": str(d), "s3": s3_server[0], "s3auth": auth_s3, "port": str(closed)}
    return {"dir": d, "root": root, "store": store, "ref": ref, "subs": subs, "before": snapshot(root),
            "s3": s3_server}


def expand(s: str, subs: dict) -> str:
    for k, v in subs.items():
        s = s.replace("{" + k + "}", v)
    return s


@pytest.fixture(scope="module")
def cli_results(world):
    """Run every case through ``flows.cli.main`` in one child process (cwd: an empty folder)."""
    cwd = world["dir"] / "cwd"
    cwd.mkdir()
    store_arg = ["--set", f"store.uri=file://{world['root']}"]
    cases = [{"id": cid, "argv": store_arg + [expand(a, world["subs"]) for a in argv], "env": env}
             for cid, argv, env, _ in CASES]
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["total_s"] = time.perf_counter() - t
    out["cwd"] = cwd
    return out


def test_at_least_twenty_cases():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("cid, argv, env, fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error_before_any_model_loads(cli_results, world, cid, argv, env, fragments):
    r = next(c for c in cli_results["cases"] if c["id"] == cid)
    assert r["rc"] == 2, r
    msg = r["stderr"]
    assert "\nrlhf: " in "\n" + msg, msg  # (the built-in model may print its build progress first)
    for f in fragments:
        assert expand(f, world["subs"]) in msg, f"{f!r} not in {msg!r}"
    assert "Traceback" not in msg
    assert SECRET not in msg  # a credential is never echoed back
    assert r["seconds"] < 30, r  # config + data checks only (the hub-name case waits for nothing: offline)
    # nothing already written is lost, nothing new is written
    assert snapshot(world["root"]) == world["before"]
    assert world["store"].verify("sft/preexisting")["content_hash"] == world["ref"].content_hash


def test_no_stage_server_or_model_started(cli_results, world):
    """Prefect, Ray and PEFT are imported only after preflight passes: none was, in any case."""
    assert cli_results["loaded"] == [], cli_results["loaded"]
    assert list(cli_results["cwd"].iterdir()) == []  # not even the default ./artifacts store
    assert world["store"].list() == ["sft/preexisting"]


@pytest.mark.parametrize("cid", ["unknown-scheme", "bad-yaml", "ray-unreachable", "s3-bad-credentials"])
def test_rlhf_console_script_exits_2_within_seconds(world, cid, tmp_path):
    _, argv, env, fragments = next(c for c in CASES if c[0] == cid)
    args = ["--set", f"store.uri=file://{world['root']}"] + [expand(a, world["subs"]) for a in argv]
    t = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).parent / "rlhf"), "run", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env, "PREFECT_API_URL": ""})
    took = time.perf_counter() - t
    assert proc.returncode == 2, proc.stderr[-2000:]
    for f in fragments:
        assert expand(f, world["subs"]) in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    assert "local Prefect server" not in proc.stdout  # no server was started
    assert took < 30, took
    assert list(tmp_path.iterdir()) == [] and snapshot(world["root"]) == world["before"]


def test_s3_preflight_probe_leaves_nothing(world):
    """A reachable S3 store passes the write probe and is left as it was (the probe is removed)."""
    from flows.config import load_config
    from flows.preflight import check_store

    endpoint, bucket = world["s3"]
    prefix = f"probe-{uuid.uuid4().hex[:8]}"
    cfg = load_config(overrides=[f"store.uri=s3://{bucket}/{prefix}",
                                 f"store.storage_options={{client_kwargs: {{endpoint_url: '{endpoint}'}}}}"])
    check_store(cfg)
    import boto3

    listed = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    assert listed.get("KeyCount", 0) == 0


def test_overlong_prompts_pass_preflight_and_are_counted(world, tmp_path):
    """Decided: over-long prompts are truncated from the left and counted, not an error."""
    from flows.config import load_config
    from flows.preflight import preflight
    from storage.store import ArtifactStore as Store
    from tasks.data.prepare import prepare_data

    long = "Describe the cat and the dog and the river and the city and the garden and the lamp. " * 4
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{long} {i}\n" for i in range(6)))
    cfg = load_config(overrides=[f"store.uri=file://{tmp_path / 'store'}", f"data.prompts_path={prompts}",
                                 "data.max_prompt_length=12"])
    preflight(cfg)
    store = Store(cfg.store.resolved_uri())
    ref = prepare_data(cfg.data, cfg.model, store, cfg.seed)
    meta = json.loads((store.fetch(ref.key) / "meta.json").read_text())
    assert meta["truncated"]["prompts"] == 6
    assert store.manifest(ref.key)["metrics"]["data/truncated"] >= 6


def test_bare_on_and_off_reach_the_switch_fields_as_words(tmp_path):
    """YAML reads a bare on / off as a bool: `--set ppo.compile=off` (seen on the H200: "Input
    should be 'auto', 'on' or 'off'") and `compile: off` in a config file mean the words."""
    from flows.config import ConfigError, load_config

    c = load_config(None, ["ppo.compile=off", "ppo.fast_generate=on", "sft.gradient_checkpointing=off"])
    assert (c.ppo.compile, c.ppo.fast_generate, c.sft.gradient_checkpointing) == ("off", "on", "off")
    p = tmp_path / "rlhf.yaml"
    p.write_text("rm:\n  gradient_checkpointing: on\nppo:\n  gradient_checkpointing: off\n")
    c = load_config(p)
    assert (c.rm.gradient_checkpointing, c.ppo.gradient_checkpointing) == ("on", "off")
    with pytest.raises(ConfigError, match="ppo.compile"):
        load_config(None, ["ppo.compile=sometimes"])
