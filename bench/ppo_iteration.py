"""One PPO iteration on one GPU, phase by phase, with the alternatives in the same process.

    python bench/ppo_iteration.py --shape 0.4b --batch 64 --prompt-len 128 --new-tokens 128 --out ours.json

Rollout: HF ``model.generate`` vs the plain KV-cache loop (tasks/ppo/generation.py) vs
FastGenerator (static cache + CUDA graph), same sampling (temperature 1, no top-k/p; EOS never
hit, so every row makes ``new_tokens`` tokens). Learn: a PPO-like step (policy forward+backward
over prompt+response with the clipped loss, value model forward+backward with the clipped value
loss, fused AdamW, fp32 master weights with bf16 autocast), its MFU. Iteration: rollout + old /
ref log-probs + values + reward + GAE + one learn step (one epoch, one minibatch: what
bench/trl_ppo.py runs in TRL), samples/s and the time split; and the cost of making the rollout
path see the weights after an optimizer step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (H200_BF16_DENSE_TFLOPS, VOCAB, build_policy, build_scalar_model, machine,  # noqa: E402
                          matmul_tflops, n_params, peak_gib, reset_peak, sync, timed, train_flops, write_json)
from tasks.ppo.fast_generate import FastGenerator  # noqa: E402
from tasks.ppo.generation import generate, position_ids_from_mask  # noqa: E402
from tasks.ppo.losses import gae, kl_k1, ppo_clip_loss, token_rewards, value_loss  # noqa: E402

EOS, PAD = 2, 0
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script only


def right_size(seqs, attn, n_actions):
    """Drop leading columns that are padding in every row (left-padded prompts); the response
    columns stay. Returns (seqs, attn, attention mask to pass: None when there is no padding left)."""
    first = int(attn.any(0).long().argmax())
    seqs, attn = seqs[:, first:], attn[:, first:]
    return seqs, attn, (None if bool(attn.all()) else attn)


def response_hidden(backbone, seqs, attn, mask, n_actions):
    """Last hidden states at the positions that predict the response tokens: (B, N, d)."""
    pos = position_ids_from_mask(attn)
    h = backbone(input_ids=seqs, attention_mask=mask, position_ids=pos).last_hidden_state
    return h[:, -n_actions - 1:-1]


def policy_logprobs(policy, seqs, attn, mask, n_actions):
    h = response_hidden(policy.model, seqs, attn, mask, n_actions)
    logits = policy.lm_head(h).float()  # only response positions go through the head
    return torch.gather(logits.log_softmax(-1), -1, seqs[:, -n_actions:, None]).squeeze(-1)


def values_of(vm, seqs, attn, mask, n_actions):
    return vm.score(response_hidden(vm.model, seqs, attn, mask, n_actions)).squeeze(-1).float()


def learn_step(policy, vm, opt, exp, n_actions):
    seqs, attn, mask = right_size(exp["seqs"], exp["attn"], n_actions)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        logp = policy_logprobs(policy, seqs, attn, mask, n_actions)
        pl = ppo_clip_loss(logp, exp["old_logp"], exp["adv"], exp["amask"])
        v = values_of(vm, seqs, attn, mask, n_actions)
        vl = value_loss(v, exp["old_values"], exp["returns"], exp["amask"])
    (pl.loss + vl.loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def make_experience(policy, ref, vm, rm, rollout, n_actions):
    seqs, attn, mask = right_size(rollout.sequences, rollout.attention_mask, n_actions)
    amask = rollout.action_mask
    with torch.autocast(DEV, dtype=torch.bfloat16):
        old_logp = policy_logprobs(policy, seqs, attn, mask, n_actions)
        ref_logp = policy_logprobs(ref, seqs, attn, mask, n_actions)
        old_values = values_of(vm, seqs, attn, mask, n_actions)
        score = values_of(rm, seqs, attn, mask, 1)[:, -1]  # reward at the last token
    rewards = token_rewards(score, kl_k1(old_logp, ref_logp), amask, 0.05)
    adv = gae(rewards, old_values, amask, 1.0, 0.95)
    a = adv.advantages
    a = (a - a[amask.bool()].mean()) / (a[amask.bool()].std() + 1e-8)
    return dict(seqs=rollout.sequences, attn=rollout.attention_mask, amask=amask, old_logp=old_logp,
                old_values=old_values, adv=torch.where(amask.bool(), a, 0.0), returns=adv.returns)


def bench_rollout(policy, prompts, attn, a, res):
    B, N = prompts.shape[0], a.new_tokens
    kw = dict(max_new_tokens=N, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, top_k=0, top_p=1.0)
    out = {}
    # HF generate (fp32 master weights, bf16 autocast, as TRL runs it) and on bf16 weights
    for name, model, ac in (("hf_generate_autocast", policy, True), ("hf_generate_bf16", a.bf16_policy, False)):
        def run():
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=ac):
                return model.generate(input_ids=prompts, attention_mask=attn, do_sample=True, max_new_tokens=N,
                                      min_new_tokens=N, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=PAD)
        run()
        ts = []
        for _ in range(a.hf_reps):
            with timed(out, "t"):
                run()
            ts.append(out["t"])
        res[name] = {"s": statistics.median(ts), "new_tokens_per_s": B * N / statistics.median(ts)}
    with timed(out, "t"):
        generate(a.bf16_policy, prompts, attn, **kw)
    res["plain_loop_bf16"] = {"s": out["t"], "new_tokens_per_s": B * N / out["t"]}
    for name, model, dtype in (("fast_bf16", a.bf16_policy, None), ("fast_fp32_master_bf16_shadow", policy, torch.bfloat16)):
        reset_peak()
        t0 = time.perf_counter()
        fg = FastGenerator(model, max_batch=B, max_len=prompts.shape[1] + N, dtype=dtype)
        fg.generate(prompts, attn, **kw)  # captures the graph
        sync()
        setup = time.perf_counter() - t0
        ts = []
        for _ in range(a.reps):
            with timed(out, "t"):
                fg.generate(prompts, attn, **kw)
            ts.append(out["t"])
        with timed(out, "refresh"):
            fg.refresh_weights()
        res[name] = {"s": statistics.median(ts), "s_all": ts, "new_tokens_per_s": B * N / statistics.median(ts),
                     "setup_and_capture_s": setup, "refresh_weights_s": out["refresh"], "peak_gib": peak_gib()}
    base = res["hf_generate_autocast"]["new_tokens_per_s"]
    for k in ("hf_generate_bf16", "plain_loop_bf16", "fast_bf16", "fast_fp32_master_bf16_shadow"):
        res[k]["speedup_vs_hf_generate_autocast"] = res[k]["new_tokens_per_s"] / base
    res["fast_bf16"]["speedup_vs_hf_generate_bf16"] = res["fast_bf16"]["new_tokens_per_s"] / res["hf_generate_bf16"]["new_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.4b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hf-reps", type=int, default=2)
    ap.add_argument("--learn-reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--skip-rollout-baselines", action="store_true")
    ap.add_argument("--compile-learn", action="store_true", help="torch.compile each decoder layer of policy and value model")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    res = {"machine": machine(), "shape": a.shape, "batch": B, "prompt_len": P, "new_tokens": N,
           "matmul_bf16_tflops_measured": matmul_tflops() if DEV == "cuda" else float("nan"), "peak_tflops_datasheet": H200_BF16_DENSE_TFLOPS}
    policy = build_policy(a.shape, DEV)
    ref = copy.deepcopy(policy).to(torch.bfloat16).eval()
    vm = build_scalar_model(a.shape, DEV, seed=1)
    rm = build_scalar_model(a.shape, DEV, torch.bfloat16, seed=2).eval()
    a.bf16_policy = copy.deepcopy(policy).to(torch.bfloat16)
    if a.compile_learn:  # regional compilation: one compiled layer, reused by every layer of both models
        for m in (policy, vm):
            for layer in m.model.layers:
                layer.compile(dynamic=False)
    res["params"] = n_params(policy)
    g = torch.Generator(device=DEV).manual_seed(0)
    prompts = torch.randint(4, VOCAB, (B, P), device=DEV, generator=g)
    attn = torch.ones_like(prompts)

    # ---- rollout
    rr = res.setdefault("rollout", {})
    if not a.skip_rollout_baselines:
        bench_rollout(policy, prompts, attn, a, rr)
    del a.bf16_policy
    if DEV == "cuda":
        torch.cuda.empty_cache()

    # ---- learn phase: MFU
    opt = torch.optim.AdamW(list(policy.parameters()) + list(vm.parameters()), lr=1e-6, fused=True)
    fg = FastGenerator(policy, max_batch=B, max_len=P + N, dtype=torch.bfloat16)
    kw = dict(max_new_tokens=N, eos_token_id=EOS, pad_token_id=PAD, temperature=1.0, top_k=0, top_p=1.0)
    rollout = fg.generate(prompts, attn, **kw)
    exp = make_experience(policy, ref, vm, rm, rollout, N)
    learn_step(policy, vm, opt, exp, N)  # warm-up (optimizer state, cuBLAS)
    reset_peak()
    ts, out = [], {}
    for _ in range(a.learn_reps):
        with timed(out, "t"):
            learn_step(policy, vm, opt, exp, N)
        ts.append(out["t"])
    t_learn = statistics.median(ts)
    cfg = policy.config
    tokens = B * (P + N)
    flops = train_flops(cfg, tokens, P + N, B * N, VOCAB) + train_flops(cfg, tokens, P + N, B * N, 1)
    res["learn"] = {"compiled_layers": a.compile_learn, "s": t_learn, "s_all": ts, "tokens": tokens, "flops": flops, "tflops": flops / t_learn / 1e12,
                    "mfu_vs_datasheet": flops / t_learn / 1e12 / H200_BF16_DENSE_TFLOPS,
                    "mfu_vs_measured_matmul": flops / t_learn / 1e12 / res["matmul_bf16_tflops_measured"],
                    "train_tokens_per_s": tokens / t_learn, "peak_gib": peak_gib()}

    # ---- weight sync: the fast path after an optimizer step (in place: graphs stay valid)
    with timed(out, "refresh"):
        fg.refresh_weights()
    res["weight_sync"] = {"refresh_after_optimizer_step_s": out["refresh"],
                          "note": "fp32 master -> bf16 shadow cast copy; 0 copies when the model is bf16"}

    # ---- full iteration: samples/s and split
    reset_peak()
    splits = []
    for _ in range(a.iters):
        s = {}
        with timed(s, "rollout"):
            rollout = fg.generate(prompts, attn, **kw)
        with timed(s, "experience"):
            exp = make_experience(policy, ref, vm, rm, rollout, N)
        with timed(s, "learn"):
            learn_step(policy, vm, opt, exp, N)
        s["total"] = sum(s.values())
        splits.append(s)
    med = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    res["iteration"] = {"s": med, "samples_per_s": B / med["total"],
                        "split_pct": {k: 100 * v / med["total"] for k, v in med.items() if k != "total"},
                        "rollout_new_tokens_per_s": B * N / med["rollout"], "peak_gib": peak_gib()}

    r = res["rollout"]
    if r:
        print(f"rollout B={B} {P}+{N}: HF generate (autocast) {r['hf_generate_autocast']['new_tokens_per_s']:.0f} tok/s, "
              f"HF generate (bf16) {r['hf_generate_bf16']['new_tokens_per_s']:.0f}, plain loop {r['plain_loop_bf16']['new_tokens_per_s']:.0f}, "
              f"fast bf16 {r['fast_bf16']['new_tokens_per_s']:.0f} ({r['fast_bf16']['speedup_vs_hf_generate_autocast']:.1f}x), "
              f"fast fp32+shadow {r['fast_fp32_master_bf16_shadow']['new_tokens_per_s']:.0f}; capture {r['fast_bf16']['setup_and_capture_s']:.2f} s")
    L = res["learn"]
    print(f"learn: {L['s'] * 1e3:.0f} ms/step, {L['tflops']:.0f} TFLOP/s, MFU {100 * L['mfu_vs_datasheet']:.1f}% of 989 "
          f"({100 * L['mfu_vs_measured_matmul']:.1f}% of measured {res['matmul_bf16_tflops_measured']:.0f}), peak {L['peak_gib']:.1f} GiB")
    it = res["iteration"]
    print(f"iteration: {med['total']:.3f} s, {it['samples_per_s']:.1f} samples/s, split "
          + ", ".join(f"{k} {v:.0f}%" for k, v in it["split_pct"].items())
          + f"; refresh after opt step {1e3 * out['refresh']:.2f} ms; peak {it['peak_gib']:.1f} GiB")
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
