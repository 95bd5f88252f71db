"""The PPO stage on one GPU: the real chain, all four roles colocated on fractions of the GPU.

    python bench/ppo_stage_gpu.py --out bench/results/ppo_stage_gpu.json            # on the H200
    python bench/ppo_stage_gpu.py --device cpu --runs tiny --iters 2 --out /tmp/x.json  # smoke run

Each run is prepare_data -> train_sft -> train_reward_model -> train_ppo (the stage functions the
flow calls) in a local Ray with one GPU, with ppo.device cuda, ppo.colocate true and every role at
gpus_per_worker 0.25 (one placement group, bundle {CPU: 4, GPU: 1}). Reported per run: the
per-iteration time split (generate / score / learn, as train_ppo measures it), the real tokens
each learner passed over a second (``time/learn_tokens_per_s``) and, for the 0.3b runs, the
learn phase's useful-token MFU (``learn_mfu``), samples/s, the peak GPU memory of each role's
actor process (torch.cuda.max_memory_allocated, read just before the roles stop) and which
rollout path the actor took (ppo.fast_generate 'auto').

Runs: ``tiny`` is the built-in model with the default stage configs (the CPU test's run, 10
iterations); ``0.3b`` is a random-weight Llama (bench/common.py's 0.4b shape, d 1024, 24 layers,
MLP 2816, with the built-in 512-token vocabulary instead of 32000, so 0.31B parameters) saved
with the built-in tokenizer as a local ``model.pretrain``, short SFT / RM, and PPO at batch 64
with 64 new tokens (ppo.compile 'auto': the learners' blocks compiled); ``0.3b-plain`` is the
same PPO with ppo.fast_generate 'off', ``0.3b-unpacked`` with ppo.pack_tokens 0, ``0.3b-eager`` with ppo.compile 'off', ``0.3b-fsdp`` with
ppo.strategy 'fsdp', ``0.3b-fp32`` with model.dtype 'float32' and ppo.learner_weights 'fp32' (both
eager), ``0.3b-fp32w`` with ppo.learner_weights 'fp32' (fp32 trainable weights under autocast;
``0.3b``'s are bf16 with fp32 masters, the 'auto' on CUDA), ``0.3b-anomaly`` is
``0.3b-eager`` with ppo.detect_anomaly (the first backward op that returns a NaN raises with the
forward line that made it: how issue 18's NaN was found).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for k, v in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402

import tasks.ppo.train as ppo_train  # noqa: E402
from bench.common import SHAPES, machine, write_json  # noqa: E402
from storage import ArtifactStore  # noqa: E402
from tasks.common.model import ModelConfig, load_tokenizer  # noqa: E402
from tasks.data.config import DataConfig  # noqa: E402
from tasks.data.prepare import prepare_data  # noqa: E402
from tasks.ppo.config import ROLES, PPOConfig  # noqa: E402
from tasks.rm.config import RewardConfig  # noqa: E402
from tasks.rm.train import train_reward_model  # noqa: E402
from tasks.sft.config import SFTConfig  # noqa: E402
from tasks.sft.train import train_sft  # noqa: E402

SEED = 42
log = logging.getLogger("bench.ppo_stage_gpu")


def random_llama(folder: str, shape: str = "0.4b") -> str:
    """A random-weight Llama of ``shape`` with the built-in tokenizer, saved as a local model (bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(ModelConfig())
    cfg = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id, tie_word_embeddings=False, max_position_embeddings=512,
                      **SHAPES[shape])
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def runs(device: str, iters: int | None, big_model: str | None, pack_tokens: int | None = None, train_batch: int = 16) -> dict[str, tuple]:
    """name -> (model, SFTConfig, RewardConfig, PPOConfig)."""
    gpus = 0.25 if device == "cuda" else 0.0
    common = {r: {"gpus_per_worker": gpus, "cpus_per_worker": 1.0} for r in ROLES}
    if pack_tokens is not None:  # ppo.pack_tokens of every run (None: the config's default)
        common["pack_tokens"] = pack_tokens
    tiny_iters = iters or 10
    out = {"tiny": (ModelConfig(), SFTConfig(device=device), RewardConfig(device=device),
                    PPOConfig(device=device, colocate=True, num_iterations=tiny_iters, eval_every=tiny_iters,
                              checkpoint_every=tiny_iters, **common))}
    if big_model is not None:
        big_iters = iters or 4
        big = PPOConfig(device=device, colocate=True, num_iterations=big_iters, eval_every=big_iters,
                        checkpoint_every=big_iters, rollout_batch_size=64, train_batch_size=train_batch, max_new_tokens=64,
                        eval_prompts=16, actor_lr=1e-5, critic_lr=1e-5, **common)
        model = ModelConfig(pretrain=big_model)
        sft = SFTConfig(device=device, max_steps=30, eval_every=30)
        rm = RewardConfig(device=device, max_steps=30, eval_every=30)
        out["0.3b"] = (model, sft, rm, big)
        out["0.3b-plain"] = (model, sft, rm, big.model_copy(update={"fast_generate": "off"}))
        out["0.3b-unpacked"] = (model, sft, rm, big.model_copy(update={"pack_tokens": 0}))
        out["0.3b-eager"] = (model, sft, rm, big.model_copy(update={"compile": "off"}))
        out["0.3b-fsdp"] = (model, sft, rm, big.model_copy(update={"strategy": "fsdp", "compile": "off"}))
        out["0.3b-fp32"] = (model.model_copy(update={"dtype": "float32"}), sft, rm,
                            big.model_copy(update={"compile": "off", "learner_weights": "fp32"}))
        out["0.3b-fp32w"] = (model, sft, rm, big.model_copy(update={"learner_weights": "fp32"}))
        out["0.3b-anomaly"] = (model, sft, rm, big.model_copy(update={"compile": "off", "detect_anomaly": True}))
    return out


class RoleStats:
    """Reads every role's GPU memory and the actor's rollout path just before train_ppo stops the
    roles (train_ppo builds and tears them down inside; this wraps its ``stop_roles``)."""

    def __init__(self):
        self.last: dict = {}
        self._stop = ppo_train.stop_roles
        ppo_train.stop_roles = self._read_then_stop

    def _read_then_stop(self, groups, pgs):
        import ray

        try:
            if groups:
                self.last = {r: ray.get([w.memory_stats.remote() for w in g.workers]) for r, g in groups.items()}
                self.last["rollout"] = ray.get(groups["actor"].workers[0].rollout_info.remote())
        finally:
            self._stop(groups, pgs)


def learn_mfu(arch, ppo: PPOConfig, m: dict) -> float:
    """The learn phase's useful-token MFU in one iteration's metrics: bench/useful_mfu.py's count
    (bench/common.py ``ppo_epoch_flops``) for the stage's learners, a LoRA actor on a frozen base
    and a full-parameter critic, over ``ppo_epochs`` passes of the rollout's real tokens
    (``ppo/tokens``), against the datasheet peak. Actor and critic share the GPU, so their FLOPs
    add up in one learn time. ``arch``: the model's LlamaConfig."""
    from bench.common import H200_BF16_DENSE_TFLOPS, ppo_epoch_flops

    rows = ppo.rollout_batch_size
    flops = ppo_epoch_flops(arch, m["ppo/tokens"], rows, rows * m["ppo/response_length"], lora_actor=True)
    return ppo.ppo_epochs * flops / m["time/learn_s"] / (H200_BF16_DENSE_TFLOPS * 1e12)


def run_one(name, model, sft_cfg, rm_cfg, ppo_cfg, store, stats: RoleStats, arch=None) -> dict:
    """``arch``: the model's LlamaConfig (the 0.3b runs), for the learn phase's MFU."""
    t = {}
    t0 = time.perf_counter()
    data = prepare_data(DataConfig(), model, store, SEED)
    t["prepare_data_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sft = train_sft(sft_cfg, model, store, data, SEED)
    t["train_sft_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rm = train_reward_model(rm_cfg, model, store, data, SEED)
    t["train_reward_model_s"] = time.perf_counter() - t0
    iters = []
    t0 = time.perf_counter()
    ref = ppo_train.train_ppo(ppo_cfg, model, store, data, sft, rm, SEED, on_iteration=lambda it, m: iters.append(m))
    t["train_ppo_s"] = time.perf_counter() - t0
    summary = store.manifest(ref.key)["metrics"]
    split = [{**{k: m[f"time/{k}_s"] for k in ("generate", "score", "learn", "iteration")},
              "learn_tokens_per_s": m["time/learn_tokens_per_s"], "tokens": m["ppo/tokens"],
              **({"learn_useful_mfu": learn_mfu(arch, ppo_cfg, m)} if arch is not None else {})} for m in iters]
    # iteration 1 holds the graph capture / first-call costs; with compiled blocks, iteration 2 the
    # recompilation for a second shape (which marks the varying dimensions dynamic)
    steady = split[2:] if len(split) > 3 else split[1:] or split
    mean = {k: statistics.mean(s[k] for s in steady) for k in split[0]}
    out = {
        "model": model.pretrain, "ppo": ppo_cfg.model_dump(mode="json"), "stage_s": t,
        "iterations": split, "steady_mean_s": mean,
        "samples_per_s": ppo_cfg.rollout_batch_size / mean["iteration"],
        "split_pct": {k: 100 * mean[k] / mean["iteration"] for k in ("generate", "score", "learn")},
        "first_iteration_s": split[0]["iteration"],
        "roles": {r: stats.last.get(r) for r in ROLES}, "rollout": stats.last.get("rollout"),
        "eval": {k: v for k, v in summary.items() if k.startswith("eval/")},
        "last": {k: iters[-1][k] for k in ("ppo/reward_mean", "ppo/kl", "ppo/policy_loss", "ppo/value_loss")},
    }
    log.info("%s: %s", name, json.dumps({k: out[k] for k in ("steady_mean_s", "samples_per_s", "roles", "rollout")}))
    return out


def table(results: dict) -> str:
    rows = ["| run | rollout | ppo.compile | learner weights | s/iter (steady) | generate | score | learn | learn real tok/s | learn useful MFU | samples/s | first iter s | peak GiB actor / critic / initial / reward (GPU allocated; on CPU, process RSS) |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in results.items():
        m = r["steady_mean_s"]
        peaks = " / ".join(f"{r['roles'][k][0].get('peak_allocated_gib', r['roles'][k][0].get('peak_rss_gib', 0)):.2f}" if r["roles"][k] and r["roles"][k][0] else "-"
                           for k in ROLES)
        mfu = f"{m['learn_useful_mfu']:.1%}" if "learn_useful_mfu" in m else "-"
        used = "graph" if r["rollout"]["cuda_graphs"] else ("eager" if r["rollout"]["fast_generate"] else "off")
        rows.append(f"| {name} | {used} | {r['ppo']['compile']} | {r['ppo'].get('learner_weights', 'fp32')} | {m['iteration']:.3f} | {m['generate']:.3f} | {m['score']:.3f} | "
                    f"{m['learn']:.3f} | {m['learn_tokens_per_s']:,.0f} | {mfu} | {r['samples_per_s']:.1f} | {r['first_iteration_s']:.1f} | {peaks} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runs", default="tiny,0.3b,0.3b-plain", help="comma-separated: tiny, 0.3b, 0.3b-plain, 0.3b-unpacked, 0.3b-eager, 0.3b-fsdp, 0.3b-fp32, 0.3b-fp32w, 0.3b-anomaly")
    ap.add_argument("--iters", type=int, default=None, help="PPO iterations per run (default: tiny 10, 0.3b 4)")
    ap.add_argument("--big-shape", default="0.4b", choices=sorted(SHAPES), help="bench/common.py shape of the 0.3b runs (tiny: smoke run)")
    ap.add_argument("--pack-tokens", type=int, default=None, help="ppo.pack_tokens of every run (default: the config's)")
    ap.add_argument("--train-batch-size", type=int, default=16, help="ppo.train_batch_size of the 0.3b runs (rows an optimizer step; 64 = one step an epoch)")
    ap.add_argument("--out", default="bench/results/ppo_stage_gpu.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import ray
    from transformers import AutoConfig

    work = tempfile.mkdtemp(prefix="ppo-stage-gpu-")
    os.environ.setdefault("RLHF_CACHE", os.path.join(work, "cache"))
    names = args.runs.split(",")
    big = random_llama(os.path.join(work, "llama-0.3b"), args.big_shape) if any(n.startswith("0.3b") for n in names) else None
    ray.init(num_gpus=1 if args.device == "cuda" else 0, num_cpus=8, include_dashboard=False)
    store = ArtifactStore(f"file://{os.path.join(work, 'store')}")
    stats = RoleStats()
    plan = runs(args.device, args.iters, big, args.pack_tokens, args.train_batch_size)
    arch = AutoConfig.from_pretrained(big) if big else None  # the saved model's own config, for the MFU
    results = {}
    failed = {}
    for name in names:
        try:  # one run's failure (its traceback goes to the JSON) must not cost the others' numbers
            results[name] = run_one(name, *plan[name], store, stats, arch if name.startswith("0.3b") else None)
        except Exception:
            log.exception("run %s failed", name)
            failed[name] = traceback.format_exc()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # SFT / RM with one worker ran in this process
        write_json(args.out, {"machine": machine(), "command": " ".join(sys.argv), "runs": results, "failed": failed})
    print(table(results))
    ray.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
