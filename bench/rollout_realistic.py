"""Rollouts as PPO really makes them, beside the fixed-length case the other benches time.

    python bench/rollout_realistic.py --shape 0.4b --batch 64 --prompt-len 128 --new-tokens 128 --out r.json

Cases, each on the same bf16 random-weight Llama, FastGenerator (CUDA graph decode) and HF
``generate`` side by side:

- ``fixed``: every row makes ``new_tokens`` tokens (no stop token can be hit), full-length prompts.
- ``eos``: ``--stop-ids`` token ids stop a row (a random model picks one with probability
  ~stop_ids / vocab a step, so rows end at many lengths; 400 of 32000, the default of vocab / 80, ends ~86% of
  128-token rows);
  the rollout stops when every row has stopped.
- ``mixed_prompts``: prompts of uniformly random lengths in [prompt_len / 4, prompt_len], left-padded.
- ``top_p_top_k``: ``eos`` with top-k 50 and top-p 0.9 sampling.
- ``realistic``: all of the above at once.

Reported: wall seconds, useful new tokens/s (tokens before and including the stop token, the
tokens a learner sees), all-columns tokens/s (batch x steps run), and mean response length.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_policy, machine, shape_vocab, sync, workload_args, write_json  # noqa: E402
from tasks.ppo.fast_generate import FastGenerator  # noqa: E402

PAD = 0
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script only


def prompts_for(B: int, P: int, vocab: int, mixed: bool, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, vocab, (B, P), device=DEV, generator=g)
    attn = torch.ones_like(ids)
    if mixed:
        lengths = torch.randint(max(1, P // 4), P + 1, (B,), device=DEV, generator=g)
        attn = (torch.arange(P, device=DEV)[None, :] >= P - lengths[:, None]).long()  # left padding
        ids = ids.masked_fill(attn == 0, PAD)
    return ids, attn


def run_case(fgs: dict, model, ids, attn, N, stops, top_k, top_p, reps, hf: bool = True) -> dict:
    """Each FastGenerator of ``fgs`` (variant -> generator; results as 'fast_<variant>') and HF generate."""
    kw = dict(max_new_tokens=N, eos_token_id=stops, pad_token_id=PAD, temperature=1.0, top_k=top_k, top_p=top_p)
    out = {}
    for name in (*(f"fast_{a}" for a in fgs), *(["hf_generate"] if hf else [])):
        def once(name=name):
            if name.startswith("fast_"):
                r = fgs[name.removeprefix("fast_")].generate(ids, attn, **kw)
                return r.action_mask, r.sequences.shape[1] - ids.shape[1]
            never = stops == [-1]  # no stop token: HF makes all N tokens (min_new_tokens) as the fast path does
            seqs = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, max_new_tokens=N, top_k=top_k or None,
                                  top_p=top_p, temperature=1.0, pad_token_id=PAD, eos_token_id=None if never else stops,
                                  min_new_tokens=N if never else 0)
            resp = seqs[:, ids.shape[1]:]
            # HF pads after the stop token; the stop token itself is part of the response
            ended = torch.isin(resp, torch.tensor(stops, device=DEV))
            after = (ended.long().cumsum(-1) - ended.long()) > 0
            return (~after).float(), resp.shape[1]
        sync()
        t0 = time.perf_counter()
        once()  # warm-up: compiles and graph captures (a graph per batch size with compaction) on a generator's first case
        sync()
        first = time.perf_counter() - t0
        ts, useful, steps = [], [], []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            mask, n = once()
            sync()
            ts.append(time.perf_counter() - t0)
            useful.append(float(mask.sum()))
            steps.append(n)
        s = statistics.median(ts)
        out[name] = {"s": s, "s_all": ts, "useful_new_tokens_per_s": statistics.median(useful) / s,
                     "all_columns_tokens_per_s": ids.shape[0] * statistics.median(steps) / s,
                     "mean_response_len": statistics.median(useful) / ids.shape[0], "steps_run": statistics.median(steps),
                     "first_call_s": first}
        if name.startswith("fast_"):
            out[name]["compactions_last_rep"] = fgs[name.removeprefix("fast_")].compactions  # (step, rows decoded from then on)
    for a in fgs if hf else []:
        out[f"fast_{a}_vs_hf_useful_tokens"] = out[f"fast_{a}"]["useful_new_tokens_per_s"] / out["hf_generate"]["useful_new_tokens_per_s"]
    return out


def main() -> None:
    ap = workload_args(__doc__.splitlines()[0])
    ap.add_argument("--stop-ids", type=int, default=None, help="how many token ids stop a row in the eos cases (default: vocab / 80)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default="fixed,eos,mixed_prompts,top_p_top_k,realistic", help="which cases to run, comma-separated")
    ap.add_argument("--attention", default="sdpa", help="FastGenerator variants, comma-separated: a decode attention (sdpa, "
                    "triton), '-nocompact' added for compact=False (every row decoded to the batch's end)")
    ap.add_argument("--skip-hf", action="store_true", help="no HF generate baseline")
    a = ap.parse_args()
    B, P, N, V = a.batch, a.prompt_len, a.new_tokens, shape_vocab(a.shape)
    model = build_policy(a.shape, DEV, torch.bfloat16, vocab=V).eval()
    fgs = {v: FastGenerator(model, max_batch=B, max_len=P + N, dtype=torch.bfloat16, attention=v.split("-")[0],
                            compact=not v.endswith("-nocompact")) for v in a.attention.split(",")}
    g = torch.Generator(device=DEV).manual_seed(0)
    a.stop_ids = a.stop_ids or V // 80
    stops = torch.randperm(V - 4, generator=torch.Generator().manual_seed(1))[: a.stop_ids].add(4).tolist()
    cases = {"fixed": (False, [-1], 0, 1.0), "eos": (False, stops, 0, 1.0), "mixed_prompts": (True, [-1], 0, 1.0),
             "top_p_top_k": (False, stops, 50, 0.9), "realistic": (True, stops, 50, 0.9)}
    res = {"machine": machine(), "command": " ".join(sys.argv), "shape": a.shape, "batch": B, "prompt_len": P, "new_tokens": N,
           "stop_ids": a.stop_ids, "attention": list(fgs), "cases": {}}
    cases = {k: cases[k] for k in a.cases.split(",")}
    for name, (mixed, st, k, p) in cases.items():
        ids, attn = prompts_for(B, P, V, mixed, g)
        res["cases"][name] = c = run_case(fgs, model, ids, attn, N, st, k, p, a.reps, hf=not a.skip_hf)
        for att in fgs:
            f = c[f"fast_{att}"]
            print(f"{name:14s} fast ({att:16s}) {f['useful_new_tokens_per_s']:9.0f} useful tok/s ({f['s']:.3f} s, len "
                  f"{f['mean_response_len']:.1f}, {f['steps_run']} steps, compactions {f['compactions_last_rep']}, first call {f['first_call_s']:.1f} s)"
                  + ("" if a.skip_hf else f"  hf {c['hf_generate']['useful_new_tokens_per_s']:8.0f}  x{c[f'fast_{att}_vs_hf_useful_tokens']:.1f}"),
                  flush=True)
        if a.out:  # after every case: a later one may not finish within a device call
            write_json(a.out, res)
    res["useful_tokens_per_s_vs_fixed"] = {} if "fixed" not in res["cases"] else {
        att: {k: v[f"fast_{att}"]["useful_new_tokens_per_s"] / res["cases"]["fixed"][f"fast_{att}"]["useful_new_tokens_per_s"]
              for k, v in res["cases"].items()} for att in fgs}
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
