"""GRPO (n samples per prompt, no critic, a rule reward) against PPO (critic + reward model) on
one GPU, one iteration at a time, the same number of responses per iteration, in one process.

    python bench/grpo_iteration.py --shape 0.4b --batch 64 --prompt-len 128 --new-tokens 128 --n 8 --out grpo.json
    python bench/grpo_iteration.py --shape tiny --batch 16 --prompt-len 16 --new-tokens 16 --iters 2   # CPU smoke run

PPO: ``batch`` prompts, one response each; policy, reference, critic (fp32, learns) and reward
model (bf16), GAE, a policy + value learn step. GRPO: ``batch / n`` prompts answered ``n`` times
(the PPO stage's in-place repetition), reference log-probs, a rule reward computed on the CPU from
the tokens (a stand-in for a verifier), ``grpo_advantages``, a policy learn step; the critic and
the reward model are never built. Both use the PPO stage's own functions (FastGenerator rollouts,
``action_logprobs``, the losses). Reported: samples/s and the phase split of each, and the GPU
memory each holds (models + optimizer state after a step, and the iteration's peak): what dropping
the critic saves.
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (VOCAB, build_policy, build_value_model, machine, n_params, peak_gib, reset_peak,  # noqa: E402
                          timed, workload_args, write_json)
from tasks.ppo.advantages import grpo_advantages, returns_to_go  # noqa: E402
from tasks.ppo.fast_generate import FastGenerator  # noqa: E402
from tasks.ppo.generation import action_logprobs  # noqa: E402
from tasks.ppo.losses import gae, kl_k1, masked_whiten, ppo_clip_loss, token_rewards, value_loss  # noqa: E402

PAD = 0
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script only


def autocast():
    return torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda")


def allocated_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if DEV == "cuda" else float("nan")


def rule_reward(responses: torch.Tensor) -> torch.Tensor:
    """A verifier stand-in on the CPU: the share of even token ids in each response, (B,)."""
    return (responses.cpu() % 2 == 0).float().mean(1)


def ppo_iteration(m, prompts, attn, kw, n_new, t):
    with timed(t, "rollout"):
        ro = m["fg"].generate(prompts, attn, **kw)
    seqs, am, mask = ro.sequences, ro.attention_mask, ro.action_mask
    with timed(t, "experience"), torch.no_grad(), autocast():
        old = action_logprobs(m["policy"], seqs, am, n_new)
        ref = action_logprobs(m["ref"], seqs, am, n_new)
        values = m["critic"].values(seqs, am)[:, -n_new - 1:-1].float()
        score = m["rm"](seqs, am).float()
        adv, ret = gae(token_rewards(score, kl_k1(old, ref), mask, 0.05), values, mask, 1.0, 0.95)
        adv = masked_whiten(adv, mask)
    with timed(t, "learn"):
        with autocast():
            logp = action_logprobs(m["policy"], seqs, am, n_new)
            v = m["critic"].values(seqs, am)[:, -n_new - 1:-1].float()
            loss = ppo_clip_loss(logp, old, adv, mask).loss + value_loss(v, values, ret, mask).loss
        loss.backward()
        m["opt"].step()
        m["opt"].zero_grad(set_to_none=True)


def grpo_iteration(m, prompts, attn, kw, n_new, n, t):
    with timed(t, "rollout"):
        ro = m["fg"].generate(prompts.repeat_interleave(n, 0), attn.repeat_interleave(n, 0), **kw)
    seqs, am, mask = ro.sequences, ro.attention_mask, ro.action_mask
    with timed(t, "experience"), torch.no_grad(), autocast():
        old = action_logprobs(m["policy"], seqs, am, n_new)
        ref = action_logprobs(m["ref"], seqs, am, n_new)
        base = grpo_advantages(rule_reward(seqs[:, -n_new:]), n).to(DEV)
        adv = returns_to_go(token_rewards(base, kl_k1(old, ref), mask, 0.05), mask)
    with timed(t, "learn"):
        with autocast():
            loss = ppo_clip_loss(action_logprobs(m["policy"], seqs, am, n_new), old, adv, mask).loss
        loss.backward()
        m["opt"].step()
        m["opt"].zero_grad(set_to_none=True)


def run(name, a, build, step) -> dict:
    reset_peak()
    m = build()
    step(m, {})  # warm-up: the decode graph, optimizer state
    held = allocated_gib()
    reset_peak()
    splits = []
    for _ in range(a.iters):
        t = {}
        step(m, t)
        t["total"] = sum(t.values())
        splits.append(t)
    med = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    out = {"s": med, "s_all": splits, "samples_per_s": a.batch / med["total"], "held_gib_after_step": held,
           "peak_gib": peak_gib(), "split_pct": {k: 100 * v / med["total"] for k, v in med.items() if k != "total"}}
    print(f"{name}: {out['samples_per_s']:.1f} samples/s ({med['total']:.3f} s/iteration: "
          + ", ".join(f"{k} {v:.0f}%" for k, v in out["split_pct"].items())
          + f"); held {held:.2f} GiB, peak {out['peak_gib']:.2f} GiB")
    del m
    gc.collect()
    return out


def main() -> None:
    ap = workload_args(__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8, help="GRPO responses per prompt (must divide --batch)")
    ap.add_argument("--iters", type=int, default=4)
    a = ap.parse_args()
    if a.batch % a.n:
        raise SystemExit(f"--n ({a.n}) must divide --batch ({a.batch})")
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    g = torch.Generator(device=DEV).manual_seed(0)
    prompts = torch.randint(4, VOCAB, (B, P), device=DEV, generator=g)
    attn = torch.ones_like(prompts)
    kw = dict(max_new_tokens=N, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, top_k=0, top_p=1.0)

    def policy_and_ref():
        policy = build_policy(a.shape, DEV)
        return policy, copy.deepcopy(policy).to(torch.bfloat16).eval()

    def build_ppo():
        policy, ref = policy_and_ref()
        critic = build_value_model(a.shape, DEV, seed=1)
        rm = build_value_model(a.shape, DEV, torch.bfloat16, seed=2).eval()
        opt = torch.optim.AdamW(list(policy.parameters()) + list(critic.parameters()), lr=1e-6, fused=DEV == "cuda")
        fg = FastGenerator(policy, max_batch=B, max_len=P + N, dtype=torch.bfloat16 if DEV == "cuda" else None)
        return dict(policy=policy, ref=ref, critic=critic, rm=rm, opt=opt, fg=fg)

    def build_grpo():
        policy, ref = policy_and_ref()
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=DEV == "cuda")
        fg = FastGenerator(policy, max_batch=B, max_len=P + N, dtype=torch.bfloat16 if DEV == "cuda" else None)
        return dict(policy=policy, ref=ref, opt=opt, fg=fg)

    res = {"machine": machine(), "shape": a.shape, "batch": B, "prompt_len": P, "new_tokens": N, "n": a.n,
           "params": n_params(build_policy(a.shape, "meta"))}
    res["ppo"] = run("ppo (critic + reward model)", a, build_ppo, lambda m, t: ppo_iteration(m, prompts, attn, kw, N, t))
    res["grpo"] = run(f"grpo n={a.n} (no critic, rule reward)", a, build_grpo,
                      lambda m, t: grpo_iteration(m, prompts[: B // a.n], attn[: B // a.n], kw, N, a.n, t))
    res["grpo_vs_ppo_samples_per_s"] = res["grpo"]["samples_per_s"] / res["ppo"]["samples_per_s"]
    res["memory_saved_gib"] = res["ppo"]["held_gib_after_step"] - res["grpo"]["held_gib_after_step"]
    print(f"grpo/ppo samples/s {res['grpo_vs_ppo_samples_per_s']:.2f}x; GPU memory held without critic and reward model: "
          f"{res['memory_saved_gib']:.2f} GiB less")
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
