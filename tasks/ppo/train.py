"""The PPO stage: four Ray actor groups (actor, critic, initial, reward) driven by one loop.

``train_ppo`` knows nothing of Prefect. The driver only samples prompts and moves object refs:
rollouts go from the actor workers straight to the other roles, experience is made in a Ray
task, and each learner rank receives its share of experience refs (``refs[i::n]``). Every
``checkpoint_every`` iterations every learner rank writes its shard of a checkpoint to the store
and the driver publishes the checkpoint over them; a new run with the same key resumes from the
newest one. See tasks/ppo/checkpoint.py for what they hold.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Callable

import torch

from storage.store import ArtifactRef, ArtifactStore
from tasks.common.model import ModelConfig, check_model_exists, load_tokenizer, model_stop_ids
from tasks.common.tracking import Tracker, TrackingConfig
from tasks.data.dataset import read_jsonl
from tasks.ppo.checkpoint import latest_checkpoint, load_checkpoint, publish_final, save_checkpoint
from tasks.ppo.config import DECODE_KERNELS, LEARNERS, PPOConfig, check_gpu_fit, resolve_learner_weights, resolve_placement
from tasks.ppo.fast_generate import check_fast_generate
from tasks.ppo.group import (RoleGroup, check_cluster, colossalai_imports, colossalai_problem, import_failure, role_bundles,
                             role_device, start_roles_on_live_nodes)
from tasks.ppo.key import ppo_key, ppo_seed, read_parts
from tasks.ppo.run import PPORun

log = logging.getLogger("rlhf.ppo")
METRICS = ("reward_mean", "reward_std", "kl", "entropy", "policy_loss", "value_loss", "clip_fraction", "response_length")


def check_ppo(cfg: PPOConfig) -> None:
    """What the config alone cannot know: is the strategy's library here, does it have CUDA, do the
    reward functions import with the right signature."""
    from tasks.ppo.rewards import check_reward_sources

    check_reward_sources(cfg)
    if cfg.strategy.startswith("colossalai"):
        # the exact imports the workers will run (a bare `import colossalai` passes without
        # galore_torch / bitsandbytes, which colossalai.nn.optimizer needs: issue 19)
        if (failure := import_failure(colossalai_imports())) is not None:
            raise ValueError(colossalai_problem(cfg.strategy, failure))
        # unset (None) GPUs are chosen later, for the GPUs there are; 0 written is CPU
        if any(cfg.role(r).gpus_per_worker == 0 for r in cfg.learners) or cfg.device == "cpu":
            raise ValueError(
                f"ppo.strategy {cfg.strategy!r} needs CUDA (on CPU ColossalAI 0.5's LowLevelZero optimizer asserts a "
                "cuda/npu device, and HybridAdam, which Gemini requires, is a CUDA kernel): give ppo.actor and ppo.critic gpus_per_worker > 0, or use ppo.strategy 'ddp' / 'fsdp' on CPU"
            )

    for option, library in DECODE_KERNELS.items():
        if getattr(cfg, option) != "triton":
            continue
        if importlib.util.find_spec("triton") is None:
            raise ValueError(f"ppo.{option} 'triton' needs the triton package, which is not installed here "
                             f"(pip install triton, on Linux with CUDA), or set ppo.{option} {library!r}")
        # Triton's interpreter runs the kernels on CPU (the tests)
        if not importlib.import_module(f"tasks.ppo.{option}").INTERPRETED and (cfg.role("actor").gpus_per_worker == 0 or cfg.device == "cpu"):
            raise ValueError(f"ppo.{option} 'triton' is a CUDA kernel, but the actor runs on CPU (ppo.device "
                             f"{cfg.device!r}, ppo.actor.gpus_per_worker {cfg.role('actor').gpus_per_worker}): give the "
                             f"actor a GPU, or set ppo.{option} {library!r}")


def resolve_stop_ids(cfg: PPOConfig, model: ModelConfig, tok) -> list[int]:
    """Every token id that ends a rollout: the model's own (``model_stop_ids``: eos,
    generation_config's eos ids, the chat template's turn end), then ``ppo.stop_token_ids`` and the
    id of each ``ppo.stop_strings`` entry. A value the tokenizer cannot use is a ValueError that
    names it; only tokenizer and config files are read."""
    vocab = len(tok)
    bad = [i for i in cfg.stop_token_ids if i >= vocab]
    if bad:
        raise ValueError(f"ppo.stop_token_ids {cfg.stop_token_ids}: {bad} not in the tokenizer's vocabulary (ids 0..{vocab - 1}); "
                         "use ids of that tokenizer, or give the token as text in ppo.stop_strings")
    ids = list(cfg.stop_token_ids)
    for text in cfg.stop_strings:
        enc = tok(text, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            raise ValueError(f"ppo.stop_strings entry {text!r} is {len(enc)} tokens {enc} "
                             f"({[tok.decode([i]) for i in enc]}), not one: a stop string must be a single token of the "
                             "tokenizer (a special token such as '<|im_end|>'); put the ids in ppo.stop_token_ids "
                             "if one of them ends a response, or drop the entry")
        ids += enc
    return list(dict.fromkeys(model_stop_ids(model, tok) + ids))


class PromptSampler:
    """Epochs of seeded permutations over the prompt indices; its position is its whole state."""

    def __init__(self, n: int, seed: int, epoch: int = 0, offset: int = 0):
        self.n, self.seed, self.epoch, self.offset = n, seed, epoch, offset

    def _perm(self) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            take = self._perm()[self.offset:self.offset + k - len(out)]
            out += take
            self.offset += len(take)
            if self.offset >= self.n:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}


def train_ppo(cfg: PPOConfig, model: ModelConfig, store: ArtifactStore, data: ArtifactRef, sft: ArtifactRef,
              rm: ArtifactRef | None, seed: int, on_iteration: Callable[[int, dict], None] | None = None,
              *, key: str | None = None, force: bool = False, tracking: TrackingConfig | None = None) -> ArtifactRef:
    """PPO of the SFT policy against the reward model; returns the ``ppo_actor`` artifact.

    ``on_iteration(it, metrics)`` is called after each iteration (and its checkpoint); an
    exception from it stops the run like a crash would (tests use it to interrupt). ``key`` is the
    one the flow computed (``ppo_key``); None computes it. Every record of ``metrics.jsonl`` also
    goes to the artifact's ``tensorboard/`` and to ``tracking``.
    """
    import ray

    key = key or ppo_key(cfg, model, data, sft, rm, seed)
    if not force and store.is_good(key):  # a damaged artifact is rebuilt
        return store.ref(key)
    seed = ppo_seed(cfg, seed)
    check_ppo(cfg)
    check_model_exists(model)
    check_fast_generate(cfg.fast_generate, cfg.strategy, model)
    data_dir = store.fetch(data)
    tokenizer = load_tokenizer(model, str(data_dir / "tokenizer"))
    stop_ids = resolve_stop_ids(cfg, model, tokenizer)
    records = read_jsonl(data_dir / "prompts_train.jsonl")
    eval_records = read_jsonl(data_dir / "prompts_eval.jsonl")[: cfg.eval_prompts]
    prompts, evals = [r["prompt_ids"] for r in records], [r["prompt_ids"] for r in eval_records]
    if len(evals) < cfg.actor.num_workers:
        raise ValueError(f"prompts_eval has {len(evals)} prompts (ppo.eval_prompts {cfg.eval_prompts}) but ppo.actor.num_workers is "
                         f"{cfg.actor.num_workers}: every actor worker needs one; raise ppo.eval_prompts or data.eval_fraction")
    if cfg.ptx_coef > 0 and not read_jsonl(data_dir / "ptx_train.jsonl"):
        raise ValueError(f"ppo.ptx_coef ({cfg.ptx_coef}) > 0 but the dataset's ptx_train.jsonl is empty: set data.ptx_path or ppo.ptx_coef 0")
    from tasks.ppo.rewards import probe_reward_sources

    probe_reward_sources(cfg, records[0])  # a reward function that fails, or a server that is down: before any model loads
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"))
    gpus = ray.cluster_resources().get("GPU", 0.0)
    cfg = resolve_learner_weights(resolve_placement(cfg, gpus), model.dtype)
    check_ppo(cfg)
    check_cluster(cfg)
    check_gpu_fit(cfg, gpus, "the Ray cluster")
    placement = placement_summary(cfg, gpus)
    log.info("ppo placement: %s", describe_placement(placement))
    if (hint := offload_thread_hint(cfg)) is not None:
        log.warning(hint)

    inputs = {"data": data, "sft": sft, **({"rm": rm} if rm is not None else {})}
    config = {"ppo": cfg.model_dump(mode="json"), "model": model.identity(), "seed": seed, "placement": placement}
    pgs, groups = {}, {}
    tracker = Tracker("ppo", tracking, config, cfg.num_iterations)
    try:
        pgs, groups = start_roles_on_live_nodes(
            cfg, lambda pgs: start_roles(cfg, model, store, data, sft, rm, seed, tokenizer, pgs, stop_ids))
        run = PPORun(cfg, groups, tokenizer, evals, model.is_builtin, eval_records)
        sampler = PromptSampler(len(prompts), seed)
        kl_ctl = _kl_controller(cfg)
        history: list[dict] = []
        start = 0
        if not force and (ckpt := latest_checkpoint(store, key)) is not None:
            shards, driver = load_checkpoint(store, ckpt, {r: cfg.role(r).num_workers for r in cfg.learners})
            ray.get([w.load_checkpoint.remote(store, shards[r][0], mine) for r in cfg.learners for w, mine in zip(groups[r].workers, shards[r])])
            start, history = driver["iteration"], driver["history"]
            sampler = PromptSampler(len(prompts), seed, **driver["sampler"])
            kl_ctl.load_state_dict(driver["kl"])
            log.info("ppo resumed from %s at iteration %d", ckpt, start)
            for rec in history:  # the curves of a resumed run start where the checkpointed run began
                _track(tracker, history, rec)
        else:
            history.append(run.evaluate(0))
            _track(tracker, history, history[-1])
        for it in range(start + 1, cfg.num_iterations + 1):
            picked = sampler.next(cfg.rollout_batch_size // cfg.n_samples_per_prompt)
            metrics = run.iteration(it, [prompts[i] for i in picked], kl_ctl, [records[i] for i in picked])
            history.append(metrics)
            _track(tracker, history, metrics)
            if it % cfg.eval_every == 0 or it == cfg.num_iterations:
                history.append(run.evaluate(it))
                _track(tracker, history, history[-1])
            if it % cfg.checkpoint_every == 0 and it < cfg.num_iterations:
                # each rank writes its shard to the store; the driver publishes the checkpoint over them
                shards = {r: ray.get([w.save_checkpoint.remote(store, key, it) for w in groups[r].workers]) for r in cfg.learners}
                driver = {"sampler": sampler.state_dict(), "kl": kl_ctl.state_dict(), "history": history}
                save_checkpoint(store, key, it, shards, driver, config, inputs)
            if on_iteration is not None:
                on_iteration(it, metrics)
        adapter = ray.get([w.adapter_files.remote() for w in groups["actor"].workers])[0]
        memory = peak_memory(groups)
        info = ray.get(groups["actor"].workers[0].rollout_info.remote())
        log.info("ppo rollouts: %s", (f"FastGenerator ({'CUDA graphs, ' if info['cuda_graphs'] else ''}{'compiled, ' if info['compiled'] else ''}"
                                       f"decode attention {info['attention']}, linears {info['linear']}{', compacting stopped rows' if info['compact'] else ''})"
                                       if info["fast_generate"] else "the plain decode loop"))
        log.info("ppo peak memory per role (GiB, max over ranks): %s", ", ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in memory.items()))
        ref = publish_final(store, key, adapter, data_dir / "tokenizer", history, {**_summary(history), **memory}, config, inputs,
                            add_files=tracker.write_into)
        tracker.finish(ref.uri)
        log.info("ppo: published %s", ref.uri)
        return ref
    except BaseException:
        tracker.fail()
        raise
    finally:
        tracker.close()
        stop_roles(groups, pgs)


def _track(tracker: Tracker, history: list[dict], rec: dict) -> None:
    """One metrics.jsonl record to the tracker; an evaluation's samples also as a text table."""
    tracker.log(rec["iteration"], rec)
    if "eval/samples" in rec:
        first = next(h for h in history if "eval/samples" in h)
        tracker.text("eval/samples", samples_markdown(first, rec), rec["iteration"])


def samples_markdown(first: dict, now: dict) -> str:
    """The held-out prompts with the first evaluation's responses (the SFT policy, iteration 0)
    and those of ``now``, side by side with their scores: a markdown table."""
    cols = [c for c in ("rm_score", "reward", "true_score") if c in now["eval/samples"][0]]
    names = " | ".join({"rm_score": "RM", "reward": "reward", "true_score": "true"}[c] for c in cols)
    rows = [f"| prompt | SFT policy (it {first['iteration']}) | {names} | policy (it {now['iteration']}) | {names} |",
            "|" + "---|" * (3 + 2 * len(cols))]
    for a, b in zip(first["eval/samples"], now["eval/samples"]):
        cells = [b["prompt"], a["response"], *(f"{a[c]:.2f}" for c in cols), b["response"], *(f"{b[c]:.2f}" for c in cols)]
        rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ").strip() or "(empty)" for c in cells) + " |")
    return "\n".join(rows)


def check_ppo_memory(cfg: PPOConfig, model: ModelConfig, gpus: float) -> dict[str, float]:
    """Before any model loads, on a machine whose torch sees CUDA: the roles' weights and optimizer
    state fit on the GPUs (``weight_memory_gib``, counted on weightless skeletons). Returns the
    estimate (GiB per worker; empty where no role holds a GPU or torch sees none). Run by
    ``flows.preflight.check_local_gpus`` for a local Ray (on a cluster the driver does not know
    the nodes' GPUs)."""
    from tasks.ppo.config import check_gpu_memory, weight_memory_gib
    from tasks.ppo.fast_generate import fast_generate_applies
    from tasks.common.lora import model_skeleton

    if not torch.cuda.is_available() or not any(cfg.role(r).gpus_per_worker for r in cfg.started_roles):
        return {}
    lm, body = model_skeleton(model), model_skeleton(model, body_only=True)
    fast = fast_generate_applies("auto" if cfg.fast_generate == "on" else cfg.fast_generate, cfg.strategy, "cuda", lm.config)
    est = weight_memory_gib(cfg, sum(p.numel() for p in lm.parameters()), sum(p.numel() for p in body.parameters()), fast)
    check_gpu_memory(cfg, est, gpus, torch.cuda.get_device_properties(0).total_memory / 2**30)
    return est


def placement_summary(cfg: PPOConfig, gpus: float) -> dict:
    """Where the roles run (``cfg`` resolved), for the log and the manifest."""
    from tasks.ppo.group import role_device

    roles = {r: {"num_workers": cfg.role(r).num_workers, "gpus_per_worker": cfg.role(r).gpus_per_worker,
                 "cpus_per_worker": cfg.role(r).cpus_per_worker, "device": role_device(cfg, r)} for r in cfg.started_roles}
    for r in LEARNERS:  # the weights they train
        if r in roles:
            roles[r]["weights"] = "bf16 weights, fp32 masters" if cfg.bf16_learners(roles[r]["device"]) else "fp32 weights"
    return {"cluster_gpus": gpus, "colocate": cfg.colocate, "reference": cfg.reference, "roles": roles,
            "reward_on_critic": cfg.reward_on_critic}


def peak_memory(groups: dict[str, RoleGroup]) -> dict[str, float]:
    """``memory/<role>/<stat>``: each role's peak memory, the largest over its ranks (GiB; CUDA:
    ``torch.cuda.max_memory_allocated`` / reserved, CPU: peak RSS of the worker process)."""
    import ray

    out = {}
    for role, g in groups.items():
        for stats in ray.get([w.memory_stats.remote() for w in g.workers]):
            for k, v in stats.items():
                out[f"memory/{role}/{k}"] = max(v, out.get(f"memory/{role}/{k}", 0.0))
    return out


def describe_placement(p: dict) -> str:
    roles = ", ".join(f"{r} {v['num_workers']}x({v['gpus_per_worker']:g} GPU, {v['cpus_per_worker']:g} CPU, {v['device']}"
                      + (f", {v['weights']}" if "weights" in v else "") + ")" for r, v in p["roles"].items())
    ref = "initial: the actor's base with a frozen SFT adapter" if p["reference"] == "shared" else "initial: its own group"
    reward = ("reward: its own group" if "reward" in p["roles"] else "reward: the critic's base, adapter disabled"
              if p.get("reward_on_critic") else "reward: by code (Ray tasks)")
    if "critic" not in p["roles"]:
        reward += "; no critic (critic-free estimator)"
    return f"{roles}; colocate={p['colocate']}; {ref}; {reward}; cluster GPUs {p['cluster_gpus']:g}"


def offload_thread_hint(cfg: PPOConfig) -> str | None:
    """What ColossalAI's offloading costs, with the fix, for the placement log; None when nothing.

    The optimizer state offloaded (as the seed has it): Adam steps on the CPU with as many threads
    as the learner's CPUs (Ray's OMP_NUM_THREADS, torch's threads), one at the default 0.5, and
    the 0.3B critic's learn step took 6.1 s against DDP's 0.68 s on the H200. Gemini's 'seed' also
    keeps the parameters on the CPU, copied to the GPU at every forward: at 0.3B no PPO iteration
    finished in 190 s, while with nothing offloaded one took 5.5 s."""
    if not cfg.strategy.startswith("colossalai") or cfg.colossalai_offload == "none":
        return None
    parts = []
    few = {r: cfg.role(r).cpus_per_worker for r in LEARNERS if r in cfg.started_roles and cfg.role(r).cpus_per_worker < 2}
    if few:
        sets = " ".join(f"--set ppo.{r}.cpus_per_worker=4" for r in few)
        parts.append(f"ppo.strategy {cfg.strategy!r} steps Adam on the CPU, with one thread per CPU of its learner: "
                     f"{', '.join(f'{r} has {c:g}' for r, c in few.items())}; give them threads where the node has cores ({sets})")
    if cfg.strategy == "colossalai_gemini" and cfg.colossalai_offload == "seed":
        parts.append("ppo.colossalai_offload 'seed' keeps Gemini's parameters on the CPU too, copied to the GPU at every "
                     "forward (a 0.3B model on an H200: no PPO iteration in 190 s, 5.5 s each with nothing offloaded); "
                     "--set ppo.colossalai_offload=optimizer keeps them on the GPU")
    if not parts:
        return None
    return "; ".join(parts) + "; or keep it all on the GPU where it has room (--set ppo.colossalai_offload=none)"


def _kl_controller(cfg: PPOConfig):
    from tasks.ppo.losses import AdaptiveKLController, FixedKLController

    if cfg.kl_controller == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return FixedKLController(cfg.kl_coef)


def start_roles(cfg, model, store, data, sft, rm, seed, tokenizer, pgs, stop_ids: list[int]) -> dict[str, RoleGroup]:
    import ray

    from tasks.ppo.roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker

    classes = {"actor": PolicyWorker, "critic": CriticWorker, "initial": ReferenceWorker, "reward": RewardWorker}
    first = role_bundles(cfg)[1]
    groups = {r: RoleGroup(r, classes[r], cfg.role(r), pgs[r], cfg.strategy, seed, role_device(cfg, r), first[r])
              for r in cfg.started_roles}
    ray.get([ref for g in groups.values() for ref in g.connect()])
    # refs, not keys: every worker's fetch checks that the store holds the content PPO was keyed on
    parts = read_parts(data, sft, rm)
    data, sft, rm = parts["data"], parts["sft"], parts.get("rm")
    loads = [w.load.remote(model, store, sft, data, cfg, tokenizer.pad_token_id, stop_ids) for w in groups["actor"].workers]
    loads += [w.load.remote(model, store, sft, cfg) for w in (groups["initial"].workers if "initial" in groups else [])]
    loads += [w.load.remote(store, rm, cfg) for w in (groups["reward"].workers if "reward" in groups else [])]
    loads += [w.load.remote(store, rm, cfg) for w in (groups["critic"].workers if "critic" in groups else [])]
    ray.get(loads)
    return groups


def stop_roles(groups: dict[str, RoleGroup], pgs: dict) -> None:
    from ray.util.placement_group import remove_placement_group

    for g in groups.values():
        g.kill()
    for pg in {id(p): p for p in pgs.values()}.values():
        remove_placement_group(pg)


def _summary(history: list[dict]) -> dict:
    evals = [h for h in history if "eval/kl" in h]
    steps = [h for h in history if "ppo/reward_mean" in h]
    out = {}
    for k in ("eval/rm_score", "eval/reward", "eval/true_score", "eval/kl"):
        if evals and k in evals[0]:
            out[f"{k}_before"], out[f"{k}_after"] = evals[0][k], evals[-1][k]
    if steps:
        out.update({k: v for k, v in steps[-1].items() if k.startswith("ppo/")})
        for p in ("generate", "score", "learn", "iteration"):
            out[f"time/{p}_s_mean"] = sum(h[f"time/{p}_s"] for h in steps) / len(steps)
        out["iterations"] = steps[-1]["iteration"]
    return out
