"""One PPO iteration on one GPU, phase by phase, with the alternatives in the same process.

    python bench/ppo_iteration.py --shape 0.4b --batch 64 --prompt-len 128 --new-tokens 128 --out ours.json

Rollout: HF ``model.generate`` vs the plain KV-cache loop (tasks/ppo/generation.py) vs
FastGenerator (static cache, whole step as a CUDA graph) on bf16 weights, on fp32 master weights,
and on a PEFT LoRA actor (bf16 base, fp32 adapter: what the PPO stage's actor holds); same
sampling (temperature 1, no top-k/p; EOS never hit, so every row makes ``new_tokens`` tokens).

``--attention sdpa,triton``: the decode attention variants (FastGenerator's ``attention``) on the
same bf16 policy, one FastGenerator each, side by side: graph-replayed decode step (ms) against
its floors, new tokens/s, and the ratios to the first variant; a variant that cannot be built or
run (no triton, no CUDA, a compile error) is recorded as an error string, not raised.

Learn: the PPO stage's own functions (``action_logprobs`` with the clipped policy loss on the
policy, ``RewardModel.values`` with the clipped value loss on the critic), bf16 autocast over
fp32 master weights, fused AdamW (``--weights bf16``: bf16 weights with fp32 masters in
tasks/common/optim.py's MasterAdamW, the stage's default on CUDA); eager, then with ``compile_blocks`` (the ``ppo.compile`` path),
in the same run. Iteration: rollout + old / ref log-probs + values + reward + GAE + one learn
step (one epoch, one minibatch: what bench/trl_ppo.py runs in TRL), samples/s and the split.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (H200_BF16_DENSE_TFLOPS, build_policy, build_value_model, copy_gbps,  # noqa: E402
                          machine, matmul_tflops, n_params, peak_gib, profile_top, reset_peak, shape_vocab, sync, timed,
                          train_flops, workload_args, write_json)
from tasks.common.optim import MasterAdamW, params_to_bf16  # noqa: E402
from tasks.ppo.fast_generate import FastGenerator  # noqa: E402
from tasks.ppo.generation import action_logprobs, generate  # noqa: E402
from tasks.ppo.group import compile_blocks  # noqa: E402
from tasks.ppo.losses import gae, kl_k1, masked_whiten, ppo_clip_loss, token_rewards, value_loss  # noqa: E402
from tasks.ppo.roles import _Values, score_rows  # noqa: E402

PAD = 0
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script only


def autocast():
    return torch.autocast(DEV, dtype=torch.bfloat16)


PACK = 0  # --pack-tokens: ppo.pack_tokens of every forward (tasks/ppo/packing.py)
HEAD = {"compiled": False}  # the policy's log-prob head compiled once its blocks are (the stage's actor: generation.action_head)


def values(critic, seqs, attn, n):
    return _Values(critic, PACK)(seqs, attn, n)  # the PPO critic's forward


def reward_scores(rm, rollout):
    return score_rows(rm, rollout, PACK, DEV)  # the reward role's forward


def learn_step(policy, critic, opt, exp, n):
    with autocast():
        logp = action_logprobs(policy, exp["seqs"], exp["attn"], n, pack_tokens=PACK, compiled=HEAD["compiled"])
        pl = ppo_clip_loss(logp, exp["old_logp"], exp["adv"], exp["amask"])
        vl = value_loss(values(critic, exp["seqs"], exp["attn"], n), exp["old_values"], exp["returns"], exp["amask"])
    (pl.loss + vl.loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def make_experience(policy, ref, critic, rm, rollout, n, split: dict | None = None):
    seqs, attn, amask = rollout.sequences, rollout.attention_mask, rollout.action_mask
    t = {} if split is None else split
    with autocast():
        with timed(t, "policy_logprobs"):
            old_logp = action_logprobs(policy, seqs, attn, n, pack_tokens=PACK, compiled=HEAD["compiled"])
        with timed(t, "ref_logprobs"):
            ref_logp = action_logprobs(ref, seqs, attn, n, pack_tokens=PACK)
        with timed(t, "values"):
            old_values = values(critic, seqs, attn, n)
        with timed(t, "reward"):
            score = reward_scores(rm, rollout).to(DEV)
    with timed(t, "gae"):
        adv, ret = gae(token_rewards(score, kl_k1(old_logp, ref_logp), amask, 0.05), old_values, amask, 1.0, 0.95)
    return dict(seqs=seqs, attn=attn, amask=amask, old_logp=old_logp, old_values=old_values,
                adv=masked_whiten(adv, amask), returns=ret)


def time_reps(fn, reps: int) -> list[float]:
    ts, out = [], {}
    for _ in range(reps):
        with timed(out, "t"):
            fn()
        ts.append(out["t"])
    return ts


def rollout_kw(N: int) -> dict:
    """The sampling of every timed rollout: temperature 1, no top-k / top-p, EOS never hit."""
    return dict(max_new_tokens=N, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, top_k=0, top_p=1.0)


def bench_rollout(policy, prompts, attn, a, res):
    B, N = prompts.shape[0], a.new_tokens
    kw = rollout_kw(N)
    bf16 = copy.deepcopy(policy).to(torch.bfloat16)
    # HF generate (fp32 master weights + bf16 autocast, as TRL runs it) and on bf16 weights
    for name, model, ac in (("hf_generate_autocast", policy, True), ("hf_generate_bf16", bf16, False)):
        def run(model=model, ac=ac):
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=ac):
                return model.generate(input_ids=prompts, attention_mask=attn, do_sample=True, max_new_tokens=N,
                                      min_new_tokens=N, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=PAD)
        run()
        ts = time_reps(run, a.hf_reps)
        res[name] = {"s": statistics.median(ts), "new_tokens_per_s": B * N / statistics.median(ts)}
    ts = time_reps(lambda: generate(bf16, prompts, attn, **kw), 1)
    res["plain_loop_bf16"] = {"s": ts[0], "new_tokens_per_s": B * N / ts[0]}

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(bf16), LoraConfig(r=16, target_modules="all-linear", init_lora_weights=False),
                          autocast_adapter_dtype=True)  # fp32 adapter on a bf16 base, as the PPO actor holds
    variants = [("fast_bf16", bf16, None), ("fast_fp32_master_bf16_copy", policy, torch.bfloat16), ("fast_lora_bf16_base", lora, None)]
    for name, model, dtype in variants:
        reset_peak()
        fg, res[name] = time_fast(model, prompts, attn, kw, a, dtype=dtype)
        res[name].update(refresh_weights_s=statistics.median(time_reps(fg.refresh_weights, 3)),
                         weight_copy_gib=fg.weight_copy_bytes() / 2**30, peak_gib=peak_gib())
        if name == "fast_bf16" and DEV == "cuda":
            res[name]["decode_step"] = decode_step_numbers(fg, prompts, attn, kw, a)
        del fg
    base = res["hf_generate_autocast"]["new_tokens_per_s"]
    for k in [v[0] for v in variants] + ["hf_generate_bf16", "plain_loop_bf16"]:
        res[k]["speedup_vs_hf_generate_autocast"] = res[k]["new_tokens_per_s"] / base
    res["fast_bf16"]["speedup_vs_hf_generate_bf16"] = res["fast_bf16"]["new_tokens_per_s"] / res["hf_generate_bf16"]["new_tokens_per_s"]


def bench_attention(policy, prompts, attn, a, res) -> None:
    """``--attention``: one FastGenerator per decode attention variant on the same bf16 copy of the
    policy; each variant's numbers, or its error, under ``res[variant]``; ratios to the first
    variant that ran (>1: the variant is faster)."""
    bf16 = copy.deepcopy(policy).to(torch.bfloat16)
    for variant in a.attention:
        try:
            res[variant] = time_attention_variant(bf16, variant, prompts, attn, a)
        except Exception as e:  # a bench of alternatives: record why one is missing, keep the others
            res[variant] = {"error": f"{type(e).__name__}: {e}"}
    ran = [v for v in a.attention if "error" not in res[v]]
    for v in ran:
        r, base = res[v], res[ran[0]]
        r[f"tokens_per_s_vs_{ran[0]}"] = r["new_tokens_per_s"] / base["new_tokens_per_s"]
        if "decode_step" in r and "decode_step" in base:
            r[f"decode_step_speedup_vs_{ran[0]}"] = base["decode_step"]["graph_replay_ms"] / r["decode_step"]["graph_replay_ms"]


def time_attention_variant(model, variant: str, prompts, attn, a) -> dict:
    """One variant's rollout new tokens/s and (CUDA) graph-replayed decode step; raises what
    building or running it raises. Its setup time includes compiling the layer only when no
    earlier FastGenerator of the process compiled the same variant (``_layer``'s cache)."""
    kw = rollout_kw(a.new_tokens)
    fg, r = time_fast(model, prompts, attn, kw, a, attention=variant)
    if DEV == "cuda":
        r["decode_step"] = decode_step_numbers(fg, prompts, attn, kw, a)
        del fg
        torch.cuda.empty_cache()
    return r


def time_fast(model, prompts, attn, kw, a, **fg_kw) -> tuple[FastGenerator, dict]:
    """A FastGenerator on ``model`` (``fg_kw``: its dtype, attention): the setup (compile and graph
    capture, in the first generate) and ``a.reps`` timed rollouts of ``prompts`` with ``kw``."""
    B, N = prompts.shape[0], kw["max_new_tokens"]
    t0 = time.perf_counter()
    fg = FastGenerator(model, max_batch=B, max_len=prompts.shape[1] + N, **fg_kw)
    fg.generate(prompts, attn, **kw)  # compiles and captures the graph
    sync()
    setup = time.perf_counter() - t0
    ts = time_reps(partial(fg.generate, prompts, attn, **kw), a.reps)
    return fg, {"s": statistics.median(ts), "s_all": ts, "new_tokens_per_s": B * N / statistics.median(ts),
                "setup_compile_capture_s": setup, "info": fg.info()}


def decode_step_numbers(fg, prompts, attn, kw, a) -> dict:
    """One graph replay's time against its floors (weights + the whole KV cache read once at the
    measured copy bandwidth; and with only the visible cache columns read, the average over the
    timed steps, what an attention that skips masked columns needs), and the top kernels of the
    same step run eagerly (profiler)."""
    B = prompts.shape[0]
    key = next(iter(fg._graphs))
    g = fg._graphs[key]
    fg._reset(B, attn, PAD)
    for _ in range(3):
        g.replay()
    fg._reset(B, attn, PAD)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    steps = a.new_tokens - 1
    start.record()
    for _ in range(steps):
        g.replay()
    end.record()
    sync()
    ms = start.elapsed_time(end) / steps
    weight_bytes = sum(t.numel() * t.element_size() for t in fg._weights if t is not None and t is not fg._w_embed)
    cache_bytes = sum(c[:B].numel() * c.element_size() for c in fg.k_cache + fg.v_cache)
    floor_ms = (weight_bytes + cache_bytes) / (a.copy_gbps * 1e9) * 1e3
    visible = (attn.sum() / B + steps / 2 + 0.5).item() / fg.max_len  # full prompts: column P + i in replay i
    floor_visible_ms = (weight_bytes + cache_bytes * visible) / (a.copy_gbps * 1e9) * 1e3
    out = {"graph_replay_ms": ms, "floor_ms_at_measured_copy_bw": floor_ms, "bytes_read": weight_bytes + cache_bytes,
           "floor_ms_visible_columns_only": floor_visible_ms, "visible_cache_fraction": visible}
    if a.profile:
        from tasks.ppo.fast_generate import GREEDY

        fg._reset(B, attn, PAD)
        out["top_kernels_eager_step"] = profile_top(lambda: fg._decode(B, GREEDY), 8, a.profile_rows)
    return out


def learn_epoch(policy, critic, opt, exp, n, mb):
    """One PPO epoch over ``exp`` in minibatches of ``mb`` rows, one optimizer step each."""
    for i in range(0, exp["seqs"].shape[0], mb):
        learn_step(policy, critic, opt, {k: v[i:i + mb] for k, v in exp.items()}, n)


def bench_learn(policy, critic, opt, exp, a, res, tag):
    cfg, B, N = policy.config, exp["seqs"].shape[0], a.new_tokens
    mb = a.minibatch or B
    t0 = time.perf_counter()
    learn_epoch(policy, critic, opt, exp, N, mb)  # warm-up: optimizer state, cuBLAS, compilation
    sync()
    first = time.perf_counter() - t0
    reset_peak()
    ts = time_reps(lambda: learn_epoch(policy, critic, opt, exp, N, mb), a.learn_reps)
    t = statistics.median(ts)
    tokens, L = exp["seqs"].numel(), exp["seqs"].shape[1]
    flops = (train_flops(cfg, tokens, L, B * (N + 1), cfg.vocab_size, frozen=bool(a.lora_actor))
             + train_flops(cfg, tokens, L, B * L, 1))
    res[tag] = {"s": t, "s_all": ts, "first_step_s": first, "minibatch": mb, "tokens": tokens, "flops": flops, "tflops": flops / t / 1e12,
                "mfu_vs_datasheet": flops / t / 1e12 / H200_BF16_DENSE_TFLOPS,
                "mfu_vs_measured_matmul": flops / t / 1e12 / res["matmul_bf16_tflops_measured"],
                "train_tokens_per_s": tokens / t, "peak_gib": peak_gib()}
    if a.profile:
        res[tag]["top_kernels"] = profile_top(lambda: learn_epoch(policy, critic, opt, exp, N, mb), 2, a.profile_rows)


def main() -> None:
    ap = workload_args(__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hf-reps", type=int, default=2)
    ap.add_argument("--learn-reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=4, help="full iterations; samples/s is the median of all but the first (which compiles)")
    ap.add_argument("--skip-rollout-baselines", action="store_true")
    ap.add_argument("--skip-eager-learn", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also record the top GPU kernels of a decode step and a learn step")
    ap.add_argument("--profile-rows", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size of the random models (default: the shape's, bench/common.py; the PPO stage bench's built-in tokenizer: 512)")
    ap.add_argument("--lora-actor", type=int, default=0, help="rank of a LoRA actor (bf16 base, fp32 adapter on every linear layer, as the PPO stage's actor); 0: a full fp32-master policy")
    ap.add_argument("--epochs", type=int, default=1, help="PPO epochs over each rollout in the iteration")
    ap.add_argument("--minibatch", type=int, default=None, help="rows per optimizer step in the learn bench and the iteration (default: the whole batch)")
    ap.add_argument("--attention", default="", help="decode attention variants to time side by side on the bf16 policy, "
                    "comma-separated FastGenerator attention= values (e.g. sdpa,triton)")
    ap.add_argument("--weights", default="fp32", choices=["fp32", "bf16"], help="the learners' weights: fp32 under bf16 autocast "
                    "(TRL's way; the stage's before ppo.learner_weights), or bf16 with fp32 masters in MasterAdamW (the stage's default on "
                    "CUDA, ppo.learner_weights 'auto'); cast after the rollout baselines")
    ap.add_argument("--pack-tokens", type=int, default=0, help="ppo.pack_tokens of the learn and scoring forwards (0: unpacked, the attended columns)")
    a = ap.parse_args()
    a.vocab = a.vocab or shape_vocab(a.shape)
    global PACK
    PACK = a.pack_tokens
    a.attention = [v.strip() for v in a.attention.split(",") if v.strip()]
    torch.backends.cuda.matmul.allow_tf32 = True
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    a.copy_gbps = copy_gbps() if DEV == "cuda" else float("nan")
    res = {"machine": machine(), "shape": a.shape, "batch": B, "prompt_len": P, "new_tokens": N,
           "matmul_bf16_tflops_measured": matmul_tflops() if DEV == "cuda" else float("nan"),
           "copy_gbps_measured": a.copy_gbps, "peak_tflops_datasheet": H200_BF16_DENSE_TFLOPS}
    res.update(vocab=a.vocab, lora_actor=a.lora_actor, epochs=a.epochs, minibatch=a.minibatch or B)
    policy = build_policy(a.shape, DEV, vocab=a.vocab)
    ref = copy.deepcopy(policy).to(torch.bfloat16).eval()
    res["params"] = n_params(policy)
    if a.lora_actor:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(copy.deepcopy(ref), LoraConfig(r=a.lora_actor, lora_alpha=32, target_modules="all-linear"),
                                autocast_adapter_dtype=True)  # fp32 adapter on the bf16 base
    critic = build_value_model(a.shape, DEV, seed=1, vocab=a.vocab)
    rm = build_value_model(a.shape, DEV, torch.bfloat16, seed=2, vocab=a.vocab).eval()
    g = torch.Generator(device=DEV).manual_seed(0)
    prompts = torch.randint(4, a.vocab, (B, P), device=DEV, generator=g)
    attn = torch.ones_like(prompts)

    rr = res.setdefault("rollout", {})
    if not a.skip_rollout_baselines:
        bench_rollout(policy, prompts, attn, a, rr)
    if DEV == "cuda":
        torch.cuda.empty_cache()

    # ---- learn phase: eager, then compiled blocks (ppo.compile), same models and optimizer
    res["weights"] = a.weights
    if a.weights == "bf16":  # as group.wrap_learner does for ppo.learner_weights 'bf16'
        for model in (policy, critic):
            params_to_bf16(model)
    trainable = [p for p in list(policy.parameters()) + list(critic.parameters()) if p.requires_grad]
    opt = (MasterAdamW(trainable, lr=1e-6, weight_decay=0.01) if a.weights == "bf16"
           else torch.optim.AdamW(trainable, lr=1e-6, fused=DEV == "cuda"))
    fg = FastGenerator(policy, max_batch=B, max_len=P + N, dtype=torch.bfloat16)
    kw = dict(max_new_tokens=N, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, top_k=0, top_p=1.0)  # as TRL's run: no EOS
    exp = make_experience(policy, ref, critic, rm, fg.generate(prompts, attn, **kw), N)
    if not a.skip_eager_learn:
        bench_learn(policy, critic, opt, exp, a, res, "learn_eager")
    res["compiled_blocks"] = compile_blocks(policy) + compile_blocks(critic)
    HEAD["compiled"] = True
    bench_learn(policy, critic, opt, exp, a, res, "learn_compiled")
    res["weight_sync"] = {"refresh_after_optimizer_step_s": statistics.median(time_reps(fg.refresh_weights, 3)),
                          "note": f"{a.weights} weights -> packed bf16 decode weights, in place"}

    # ---- full iteration: samples/s and split
    from torch._dynamo.utils import counters

    mb = a.minibatch or B
    reset_peak()
    splits, parts, graphs_before = [], [], counters["stats"]["unique_graphs"]
    for _ in range(a.iters):
        s, e = {}, {}
        with timed(s, "rollout"):
            rollout = fg.generate(prompts, attn, **kw)
        with timed(s, "experience"):
            exp = make_experience(policy, ref, critic, rm, rollout, N, e)
        with timed(s, "learn"):
            for _ in range(a.epochs):
                learn_epoch(policy, critic, opt, exp, N, mb)
        s["total"] = sum(s.values())
        splits.append(s)
        parts.append(e)
    steady = splits[1:] or splits  # the first iteration compiles the experience forwards: not a steady one
    med = {k: statistics.median(s[k] for s in steady) for k in splits[0]}
    res["iteration"] = {"s": med, "s_all": splits, "experience_parts_s": {k: statistics.median(e[k] for e in (parts[1:] or parts)) for k in parts[0]},
                        "graphs_compiled_during_iterations": counters["stats"]["unique_graphs"] - graphs_before,
                        "samples_per_s": B / med["total"],
                        "split_pct": {k: 100 * v / med["total"] for k, v in med.items() if k != "total"},
                        "rollout_new_tokens_per_s": B * N / med["rollout"], "peak_gib": peak_gib()}
    if a.attention:  # last: a variant that fails inside graph capture may leave CUDA unusable
        if a.out:
            write_json(a.out, res)
        bench_attention(policy, prompts, attn, a, res.setdefault("attention", {}))
    report(res)
    if a.out:
        write_json(a.out, res)


def report(res) -> None:
    r = res["rollout"]
    if r:
        f = r["fast_bf16"]
        print(f"rollout B={res['batch']} {res['prompt_len']}+{res['new_tokens']}: HF generate (autocast) "
              f"{r['hf_generate_autocast']['new_tokens_per_s']:.0f} tok/s, HF bf16 {r['hf_generate_bf16']['new_tokens_per_s']:.0f}, "
              f"plain loop {r['plain_loop_bf16']['new_tokens_per_s']:.0f}, fast bf16 {f['new_tokens_per_s']:.0f} "
              f"({f['speedup_vs_hf_generate_autocast']:.1f}x), fast fp32 master {r['fast_fp32_master_bf16_copy']['new_tokens_per_s']:.0f}, "
              f"fast LoRA {r['fast_lora_bf16_base']['new_tokens_per_s']:.0f}; setup {f['setup_compile_capture_s']:.1f} s")
        d = f.get("decode_step", {})
        if d:
            print(f"decode step: {d['graph_replay_ms']:.3f} ms per graph replay, floor {d['floor_ms_at_measured_copy_bw']:.3f} ms")
            for row in d.get("top_kernels_eager_step", []):
                print("   ", row)
    for tag in ("learn_eager", "learn_compiled"):
        if tag in res:
            L = res[tag]
            print(f"{tag}: {L['s'] * 1e3:.0f} ms/step (first {L['first_step_s']:.1f} s), {L['tflops']:.0f} TFLOP/s, "
                  f"MFU {100 * L['mfu_vs_datasheet']:.1f}% of 989 ({100 * L['mfu_vs_measured_matmul']:.1f}% of measured "
                  f"{res['matmul_bf16_tflops_measured']:.0f}), peak {L['peak_gib']:.1f} GiB")
            for row in L.get("top_kernels", []):
                print("   ", row)
    for v, r in res.get("attention", {}).items():
        if "error" in r:
            print(f"attention {v}: error {r['error']}")
            continue
        d = r.get("decode_step", {})
        step = (f", decode step {d['graph_replay_ms']:.3f} ms (floor {d['floor_ms_at_measured_copy_bw']:.3f}, visible columns "
                f"{d['floor_ms_visible_columns_only']:.3f})" if d else "")
        ratios = ", ".join(f"{k} {x:.2f}" for k, x in r.items() if "_vs_" in k)
        print(f"attention {v}: {r['new_tokens_per_s']:.0f} tok/s{step}; {ratios}")
    it = res["iteration"]
    print(f"iteration: {it['s']['total']:.3f} s, {it['samples_per_s']:.1f} samples/s, split "
          + ", ".join(f"{k} {v:.0f}%" for k, v in it["split_pct"].items())
          + f"; refresh after opt step {1e3 * res['weight_sync']['refresh_after_optimizer_step_s']:.2f} ms; peak {it['peak_gib']:.1f} GiB")
    print("experience parts (s):", {k: round(v, 4) for k, v in it["experience_parts_s"].items()},
          "graphs compiled during the iterations:", it["graphs_compiled_during_iterations"],
          "iterations (s):", [round(x["total"], 3) for x in it["s_all"]])


if __name__ == "__main__":
    main()
