"""Critic-free RL (ppo.advantage grpo / rloo / reinforce_pp) with rewards by code (ppo.rewards kinds
function and http) on the built-in task, whose ground truth is a rule: data prep and SFT only, no
reward-model stage. Real Ray, real training, a real HTTP reward server on 127.0.0.1; nothing mocked.
Measured numbers (2-core CPU) are in each docstring; the thresholds carry a margin.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import socketserver
import threading
import time

import pytest
from pydantic import ValidationError

from storage import ArtifactStore
from tasks.common.builtin import score_response
from tasks.common.model import ModelConfig
from tasks.data.config import DataConfig
from tasks.data.dataset import read_jsonl
from tasks.data.prepare import prepare_data
from tasks.ppo.checkpoint import latest_checkpoint
from tasks.ppo.config import PPOConfig
from tasks.ppo.rewards import as_rewards, call_http, check_reward_sources, load_function, reward_code_version
from tasks.ppo.train import ppo_key, train_ppo
from tasks.sft.config import SFTConfig
from tasks.sft.train import train_sft

SEED = 42
MODEL = ModelConfig()
SENTIMENT = {"kind": "function", "function": "tasks.common.builtin:sentiment_reward"}
THING = {"kind": "function", "function": "tasks.common.builtin:thing_reward"}
DATA = DataConfig(prompt_metadata=["thing"])


@pytest.fixture(scope="module")
def stages(rlhf_cache, ray_cluster, tmp_path_factory):
    """(store, data, sft, store root): the built-in task with its `thing` column carried as prompt metadata."""
    root = tmp_path_factory.mktemp("rl-store")
    store = ArtifactStore(f"file://{root}")
    data = prepare_data(DATA, MODEL, store, SEED)
    sft = train_sft(SFTConfig(), MODEL, store, data, SEED)
    return store, data, sft, root


def metrics(store, ref) -> dict:
    return store.manifest(ref.key)["metrics"]


def steps(store, ref) -> list[dict]:
    lines = (store.fetch(ref.key) / "metrics.jsonl").read_text().splitlines()
    return [h for h in map(json.loads, lines) if "ppo/reward_mean" in h]


def report(name, m):
    print(f"\n{name}: true {m['eval/true_score_before']:.3f} -> {m['eval/true_score_after']:.3f}, reward "
          f"{m['eval/reward_before']:.3f} -> {m['eval/reward_after']:.3f}, kl -> {m['eval/kl_after']:.3f}, "
          f"{m['time/iteration_s_mean']:.2f}s/iteration")


class _Scorer(http.server.BaseHTTPRequestHandler):
    """A reward server: the built-in rule over POSTed {prompts, responses}; sleeps `delay` first."""
    delay = 0.0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.delay)
        out = json.dumps({"rewards": [score_response(r) for r in body["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    """start(delay) -> url of a real threaded HTTP server on 127.0.0.1 (stopped after the test)."""
    servers = []

    def start(delay: float = 0.0) -> str:
        handler = type("Scorer", (_Scorer,), {"delay": delay})
        srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/score"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


# -- learning ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_grpo_with_the_rule_as_reward_learns_without_critic_or_reward_model(stages):
    """GRPO, 4 responses per prompt, 10 iterations. Measured: true score -0.133 -> 0.978, KL 7.2
    nats per response. No critic, no reward model, no `reward` role: only the actor starts."""
    store, data, sft, _ = stages
    cfg = PPOConfig(advantage="grpo", n_samples_per_prompt=4, num_iterations=10, eval_every=5, rewards=[SENTIMENT])
    ref = train_ppo(cfg, MODEL, store, data, sft, None, SEED)
    m = metrics(store, ref)
    report("grpo", m)
    assert m["eval/true_score_after"] > 0.85 and m["eval/true_score_after"] > m["eval/true_score_before"] + 0.8
    assert m["eval/kl_before"] == 0.0 and 0.0 < m["eval/kl_after"] < 12.0
    assert m["eval/reward_after"] == pytest.approx(m["eval/true_score_after"])  # the reward is the rule
    manifest = store.manifest(ref.key)
    assert set(manifest["config"]["placement"]["roles"]) == {"actor"}
    assert set(manifest["inputs"]) == {"data", "sft"}  # no reward model artifact was needed
    assert not any(k.startswith(("memory/critic", "memory/reward")) or k == "ppo/value_loss" for k in m)
    assert train_ppo(cfg, MODEL, store, data, sft, None, SEED) == ref  # published: a hit, not retrained


@pytest.mark.slow
def test_rloo_with_a_weighted_sum_of_functions_reading_metadata(stages):
    """RLOO, 4 per prompt, 15 iterations, reward = sentiment + 0.5 x [the `thing` metadata column is
    the thing the prompt names] (``aligned_thing``, run in the Ray tasks). Measured: true score
    -0.133 -> 0.933, KL 3.9. The second term is exactly 1 on every row of every iteration and
    evaluation: the metadata stays with its row through the group repetition and the chunks
    (misaligned, it would be ~1/24)."""
    store, data, sft, _ = stages
    assert all("metadata" in r and "thing" in r["metadata"] for r in read_jsonl(store.fetch(data.key) / "prompts_train.jsonl"))
    cfg = PPOConfig(advantage="rloo", n_samples_per_prompt=4, num_iterations=15, eval_every=5,
                    rewards=[SENTIMENT, {"kind": "function", "function": "tests.test_rl:aligned_thing", "weight": 0.5}])
    ref = train_ppo(cfg, MODEL, store, data, sft, None, SEED)
    m = metrics(store, ref)
    report("rloo", m)
    assert m["eval/true_score_after"] > m["eval/true_score_before"] + 0.7
    assert 0.0 < m["eval/kl_after"] < 12.0
    hist = steps(store, ref)
    assert all(h["ppo/reward_1_function_mean"] == 1.0 for h in hist), [h["ppo/reward_1_function_mean"] for h in hist]
    assert m["eval/reward_after"] == pytest.approx(m["eval/true_score_after"] + 0.5, abs=1e-5)
    assert hist[-1]["ppo/reward_mean"] == pytest.approx(hist[-1]["ppo/reward_0_function_mean"] + 0.5 * hist[-1]["ppo/reward_1_function_mean"])


@pytest.mark.slow
def test_reinforce_pp_with_an_http_reward_server(stages, reward_server):
    """REINFORCE++ (one response per prompt, batch-whitened returns), 15 iterations, the rule served
    over HTTP by a real server thread. Measured: true score -0.133 -> 0.911, KL 2.9."""
    store, data, sft, _ = stages
    cfg = PPOConfig(advantage="reinforce_pp", num_iterations=15, eval_every=5,
                    rewards=[{"kind": "http", "url": reward_server(), "version": "rule-v1", "timeout_s": 10}])
    ref = train_ppo(cfg, MODEL, store, data, sft, None, SEED)
    m = metrics(store, ref)
    report("reinforce_pp (http)", m)
    assert m["eval/true_score_after"] > m["eval/true_score_before"] + 0.7
    assert 0.0 < m["eval/kl_after"] < 12.0


class Interrupted(RuntimeError):
    pass


@pytest.mark.slow
def test_dr_grpo_on_two_actor_ranks_with_kl_loss_checkpoints_and_resumes_the_actor_alone(stages, tmp_path):
    """Dr. GRPO (no std division, loss summed over a constant), KL as a k3 loss term, two actor
    workers (each generates whole groups; a minibatch, so a group, goes to one rank): interrupted
    after its checkpoint at iteration 2, a rerun resumes at 3; the checkpoint holds the actor's two
    ranks only; the metadata term is 1 on every row, in training and in the evaluation."""
    _, data, sft, root = stages
    shutil.copytree(root, tmp_path / "store", ignore=shutil.ignore_patterns("ppo"))  # the same inputs, so the same key
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    cfg = PPOConfig(advantage="grpo", n_samples_per_prompt=4, grpo_normalize_std=False, loss_aggregation="constant",
                    kl_penalty="loss", kl_estimator="k3", num_iterations=3, checkpoint_every=2, eval_every=3,
                    rollout_batch_size=16, train_batch_size=4, actor={"num_workers": 2}, eval_prompts=10,
                    rewards=[SENTIMENT, {"kind": "function", "function": "tests.test_rl:aligned_thing", "weight": 0.5}])

    def stop_at_2(it, m):
        if it == 2:
            raise Interrupted()

    with pytest.raises(Interrupted):
        train_ppo(cfg, MODEL, store, data, sft, None, SEED, on_iteration=stop_at_2)
    key = ppo_key(cfg, MODEL, data, sft, None, SEED)
    shards = store.manifest(latest_checkpoint(store, key))["shards"]
    assert set(shards) == {"actor"} and len(shards["actor"]) == 2
    seen = []
    ref = train_ppo(cfg, MODEL, store, data, sft, None, SEED, on_iteration=lambda it, m: seen.append(it))
    assert seen == [3] and ref.key == key
    hist = steps(store, ref)
    assert [h["iteration"] for h in hist] == [1, 2, 3]
    assert all(h["ppo/kl_loss"] >= 0.0 for h in hist) and hist[-1]["ppo/kl_loss"] > 0.0
    assert all(h["ppo/reward_1_function_mean"] == 1.0 for h in hist)
    m = metrics(store, ref)
    assert m["eval/reward_after"] == pytest.approx(m["eval/true_score_after"] + 0.5, abs=1e-5)


# -- the DAG and the key ---------------------------------------------------------------------------
@pytest.mark.slow
def test_rlhf_run_with_code_rewards_skips_the_reward_model_stage(stages, prefect_api, tmp_path):
    """`rlhf run` (the real CLI, a real Prefect server) on a store holding data and SFT: PPO with
    GRPO and the rule is built, no reward-model task runs and none is stored; the rerun is all
    cached and starts no Ray."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.test_flow import task_states

    _, data, sft, root = stages
    shutil.copytree(root, tmp_path / "store", ignore=shutil.ignore_patterns("ppo"))
    argv = [str(Path(sys.executable).parent / "rlhf"), "run"]
    for kv in ("store.uri=file://" + str(tmp_path / "store"), "data.prompt_metadata=[thing]", "ppo.advantage=grpo",
               "ppo.n_samples_per_prompt=4", "ppo.num_iterations=2", "ppo.rollout_batch_size=16", "ppo.eval_every=2",
               "ppo.rewards=[{kind: function, function: 'tasks.common.builtin:sentiment_reward'}]"):
        argv += ["--set", kv]
    for run in ("first", "rerun"):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
        assert p.returncode == 0, f"{run}: {p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        out = p.stdout + p.stderr
        states = {n: s["state"] for n, s in task_states().items()}
        assert set(states) == {"data", "sft", "ppo"}, states  # no reward-model task at all
        outcomes = {s: re.search(rf"rlhf: {s}\s+(\w+)", out).group(1) for s in states}
        assert outcomes == {"data": "cached", "sft": "cached", "ppo": "built" if run == "first" else "cached"}, (run, outcomes)
        assert "rlhf: rm" not in out
    assert states == dict.fromkeys(("data", "sft", "ppo"), "Cached")  # the rerun: every stage a hit
    assert sorted(d.name for d in (tmp_path / "store").iterdir() if not d.name.startswith(".")) == ["data", "ppo", "sft"]


def test_flow_needs_no_reward_model_stage_with_code_rewards_and_no_critic(stages):
    """The flow's keys with data and SFT built: PPO's is known at once, keyed without a reward model."""
    from flows.config import PipelineConfig
    from flows.plan import known_keys

    store, data, sft, _ = stages
    critic_free = PipelineConfig(data=DATA, ppo=PPOConfig(advantage="rloo", n_samples_per_prompt=4, rewards=[SENTIMENT]))
    assert not critic_free.ppo.needs_reward_model and critic_free.ppo.started_roles == ("actor",)
    for needs in (PPOConfig(rewards=[SENTIMENT]),  # gae: the critic starts from the reward model
                  PPOConfig(advantage="grpo", n_samples_per_prompt=4)):  # the reward model as reward
        assert needs.needs_reward_model
    assert PPOConfig(advantage="grpo", n_samples_per_prompt=4).started_roles == ("actor", "reward")
    keys = known_keys(critic_free, store)
    assert keys == {"data": data.key, "sft": sft.key, "ppo": ppo_key(critic_free.ppo, MODEL, data, sft, None, SEED)}
    assert "rm" in known_keys(critic_free.model_copy(update={"ppo": PPOConfig()}), store)
    with pytest.raises(ValueError, match="needs the reward model stage's artifact"):
        ppo_key(PPOConfig(), MODEL, None, None, None, SEED)


def test_reward_function_source_keys_the_stage(tmp_path, monkeypatch):
    mod = tmp_path / "my_verifier_mod.py"
    mod.write_text("def score(prompts, responses, **metadata):\n    return [1.0 for _ in responses]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = PPOConfig(advantage="rloo", n_samples_per_prompt=2, rewards=[{"kind": "function", "function": "my_verifier_mod:score"}])
    before = reward_code_version(cfg)
    mod.write_text("def score(prompts, responses, **metadata):\n    return [2.0 for _ in responses]\n")
    assert reward_code_version(cfg) != before and set(before) == {"0"}
    builtin = reward_code_version(PPOConfig(advantage="rloo", n_samples_per_prompt=2, rewards=[SENTIMENT]))
    from storage.keys import code_version

    assert builtin == {"0": code_version("tasks.common.builtin")}  # a project module: its import closure
    http = PPOConfig(advantage="rloo", n_samples_per_prompt=2, rewards=[{"kind": "http", "url": "http://127.0.0.1:1/s", "version": "v1"}])
    assert reward_code_version(http) == {}  # url and version are in the config, which is keyed


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ({"advantage": "grpo", "n_samples_per_prompt": 5}, r"ppo.n_samples_per_prompt \(5\) must divide ppo.rollout_batch_size \(32\).*rollout_batch_size=30"),
    ({"advantage": "grpo", "n_samples_per_prompt": 3, "rollout_batch_size": 24}, r"must divide ppo.train_batch_size \(8\).*no group is split.*train_batch_size=9"),
    ({"advantage": "rloo"}, r"ppo.n_samples_per_prompt \(1\) must be >= 2"),
    ({"advantage": "grpo", "n_samples_per_prompt": 4, "critic_lora_rank": 8}, r"ppo.critic_lora_rank \(8\).*has no critic"),
    ({"rewards": [{"kind": "function"}]}, r"needs `function`.*mypkg.verify:score"),
    ({"rewards": [{"kind": "function", "function": "no colon here"}]}, r"not an import path 'package.module:function'"),
    ({"rewards": [{"kind": "http", "url": "http://127.0.0.1:9/s"}]}, r"needs `version`"),
    ({"rewards": [{"kind": "model", "url": "http://x"}]}, r"`url` .* is not used by a reward of kind 'model'"),
    ({"rewards": [{"kind": "model"}, {"kind": "model"}]}, r"kind 'model' more than once"),
    ({"rewards": []}, r"at least 1 item"),
])
def test_config_errors_name_the_field_and_the_fix(override, message):
    with pytest.raises(ValidationError, match=message):
        PPOConfig(**override)


def aligned_thing(prompts, responses, thing):
    """1.0 where the metadata's thing is the one the prompt names ("Describe the river.")."""
    return [float(re.search(rf"\bthe {t}\b", p) is not None) for p, t in zip(prompts, thing)]


def nan_reward(prompts, responses, **metadata):
    return [float("nan")] * len(responses)


def short_reward(prompts, responses, **metadata):
    return [1.0] * (len(responses) - 1)


def text_reward(prompts, responses, **metadata):
    return ["good"] * len(responses)


def two_args_only(prompts):
    return [0.0]


def no_metadata(prompts, responses):
    return [0.0] * len(responses)


def test_reward_functions_that_do_not_fit_are_clear_errors():
    with pytest.raises(ValueError, match=r"ppo.rewards\[0\].function 'no_such_pkg.mod:f': module 'no_such_pkg.mod' does not import.*install it"):
        load_function("no_such_pkg.mod:f", "ppo.rewards[0]")
    with pytest.raises(ValueError, match=r"module 'tests.test_rl' has no callable 'nope'"):
        load_function("tests.test_rl:nope", "ppo.rewards[0]")
    with pytest.raises(ValueError, match=r"signature two_args_only\(prompts\).*def two_args_only\(prompts, responses, \*\*metadata\)"):
        load_function("tests.test_rl:two_args_only", "ppo.rewards[0]")
    cfg = PPOConfig(advantage="rloo", n_samples_per_prompt=2, rewards=[{"kind": "function", "function": "tests.test_rl:no_metadata"}])
    with pytest.raises(ValueError, match=r"cannot be called with the metadata columns \['answer'\].*add \*\*metadata"):
        check_reward_sources(cfg, ["answer"])
    needs_thing = PPOConfig(advantage="rloo", n_samples_per_prompt=2, rewards=[THING])
    check_reward_sources(needs_thing)  # its `thing` comes from the data: judged with the columns
    with pytest.raises(ValueError, match=r"metadata columns \[\].*missing a required argument: 'thing'.*data.prompt_metadata"):
        check_reward_sources(needs_thing, [])
    check_reward_sources(needs_thing, ["thing"])
    w = "ppo.rewards[1].function 'm:f'"
    with pytest.raises(ValueError, match=r"returned 2 rewards for 3 responses: return exactly one float per response"):
        as_rewards([1.0, 2.0], 3, w)
    with pytest.raises(ValueError, match=r"returned nan at position 1 \(1 non-finite of 2\).*return finite floats"):
        as_rewards([1.0, float("nan")], 2, w)
    with pytest.raises(ValueError, match=r"a non-number at position 0: 'good' \(str\); return floats"):
        as_rewards(["good"], 1, w)
    with pytest.raises(ValueError, match=r"returned float 0.5, not a list of numbers"):
        as_rewards(0.5, 1, w)
    assert as_rewards([1, 2.5], 2, w).tolist() == [1.0, 2.5]


@pytest.mark.parametrize("fn, message", [
    ("nan_reward", r"ppo.rewards\[0\].function 'tests.test_rl:nan_reward' returned nan"),
    ("short_reward", r"returned 0 rewards for 1 responses"),
    ("text_reward", r"a non-number at position 0: 'good'"),
])
def test_bad_reward_function_stops_the_run_before_any_model_loads(stages, ray_cluster, fn, message):
    store, data, sft, _ = stages
    cfg = PPOConfig(advantage="rloo", n_samples_per_prompt=2, rewards=[{"kind": "function", "function": f"tests.test_rl:{fn}"}])
    pgs_before = len(ray_cluster.util.placement_group_table())
    t = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        train_ppo(cfg, MODEL, store, data, sft, None, SEED)
    assert time.perf_counter() - t < 10 and len(ray_cluster.util.placement_group_table()) == pgs_before


def test_reward_server_down_or_timing_out_is_a_clear_error(stages, ray_cluster, reward_server):
    from tests.conftest import free_port

    down = PPOConfig(advantage="rloo", n_samples_per_prompt=2,
                     rewards=[{"kind": "http", "url": f"http://127.0.0.1:{free_port()}/score", "version": "v1"}])
    with pytest.raises(ValueError, match=r"ppo.rewards\[0\].url 'http://127.0.0.1:\d+/score': nothing answers at .*start the reward server"):
        check_reward_sources(down)
    slow = reward_server(delay=2.0)
    cfg = PPOConfig(advantage="rloo", n_samples_per_prompt=2,
                    rewards=[{"kind": "http", "url": slow, "version": "v1", "timeout_s": 0.3, "retries": 1}])
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"ppo.rewards\[0\].url .*: no answer after 2 tries \(timed out; timeout_s 0.3 each\): "
                                           r"start the reward server or fix the url; raise ppo.rewards\[0\].timeout_s"):
        call_http(cfg.rewards[0], "ppo.rewards[0]", ["p"], ["r"], {})
    assert time.perf_counter() - t < 5
    # through the stage: the probe call fails before any model loads or role starts
    store, data, sft, _ = stages
    pgs_before = len(ray_cluster.util.placement_group_table())
    with pytest.raises(RuntimeError, match=r"ppo.rewards\[0\].url .*no answer after 2 tries"):
        train_ppo(cfg, MODEL, store, data, sft, None, SEED)
    assert len(ray_cluster.util.placement_group_table()) == pgs_before
    fast = reward_server()
    ok = call_http(cfg.rewards[0].model_copy(update={"url": fast}), "ppo.rewards[0]", ["p", "q"],
                   ["The cat is kind, warm and calm.", "The cat is sad."], {})
    assert ok.tolist() == pytest.approx([1.0, -1 / 3])


def test_prompt_metadata_columns_are_carried_into_the_dataset(tmp_path, rlhf_cache):
    """data.prompt_metadata: the named fields of each prompts record land under `metadata` of its
    prompt sample, as written (a nested value too); a record without one is an error naming it."""
    from tasks.data.sources import DataError

    src = tmp_path / "prompts.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "tags": {"level": i % 3}} for i in range(40)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    cfg = DataConfig(prompts_path=str(src), columns={"prompt": "question"}, prompt_metadata=["answer", "tags"])
    ref = prepare_data(cfg, MODEL, store, SEED)
    out = [r for f in ("prompts_train.jsonl", "prompts_eval.jsonl") for r in read_jsonl(store.fetch(ref.key) / f)]
    assert len(out) == 40
    for r in out:
        i = int(re.search(r"What is (\d+)", r["prompt"]).group(1))
        assert r["metadata"] == {"answer": str(2 * i), "tags": {"level": i % 3}}
    rows[7].pop("answer")
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"line 8: data.prompt_metadata lists 'answer' but the record has no such field.*"
                                        r"add it to every prompts record, or drop it from data.prompt_metadata"):
        prepare_data(cfg, MODEL, ArtifactStore(f"file://{tmp_path / 'store2'}"), SEED)
