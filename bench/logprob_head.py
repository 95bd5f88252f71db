"""The actor's log-prob head alone, eager against compiled (tasks/ppo/generation.py ``action_head``).

    python3 bench/logprob_head.py                                  # CUDA: 4k / 8k actions x 32k / 152k vocabularies
    python3 bench/logprob_head.py --actions 512 --vocabs 32000     # a CPU-sized check

The learner's head takes the bf16 logits of K action positions (K, V) and returns each action's
log-probability under softmax(logits / T), with the gradient back into the logits: the eager way
copies the logits to fp32 and divides them (two (K, V) fp32 tensors alive at once), then takes
logsumexp in pieces of 1024 positions; the compiled way (the stage's actor when ``ppo.compile``
is on) reads the bf16 logits in one graph and writes only their bf16 gradient. Reported per (K, V):
milliseconds of forward + backward (median of ``--reps``, after two warm-up calls that compile),
and the peak memory above the logits and their gradient (CUDA), side by side with the ratio.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, median_ms, sync, write_json  # noqa: E402
from tasks.ppo.generation import action_head  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(logits: torch.Tensor, actions: torch.Tensor, compiled: bool, reps: int) -> dict:
    """fwd + bwd of the head ``reps`` times after 2 warm-ups: {ms, extra_peak_gib}."""
    x = logits.clone().requires_grad_()
    w = torch.randn(actions.shape, device=logits.device)

    def once():
        x.grad = None
        logp, _ = action_head(x, actions, 0.7, compiled=compiled)
        (logp * w).sum().backward()

    for _ in range(2):
        once()
    sync()
    base = 0
    if DEV == "cuda":
        x.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(once, reps)
    grad_bytes = x.numel() * x.element_size()  # the gradient both ways must write: not counted as extra
    extra = (torch.cuda.max_memory_allocated() - base - grad_bytes) / 2**30 if DEV == "cuda" else None
    return {"ms": ms, "extra_peak_gib": extra}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", default="4096,8192" if DEV == "cuda" else "512")
    ap.add_argument("--vocabs", default="32000,151936" if DEV == "cuda" else "32000")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {"command": " ".join(["bench/logprob_head.py", *sys.argv[1:]]), "machine": machine(), "rows": []}
    g = torch.Generator().manual_seed(0)
    for v in map(int, a.vocabs.split(",")):
        for k in map(int, a.actions.split(",")):
            logits = (torch.randn(k, v, generator=g) * 3).to(DEV, torch.bfloat16)
            actions = torch.randint(0, v, (k,), generator=g).to(DEV)
            eager, comp = run(logits, actions, False, a.reps), run(logits, actions, True, a.reps)
            row = {"actions": k, "vocab": v, "logits_gib": logits.numel() * 2 / 2**30, "eager": eager, "compiled": comp,
                   "speedup": eager["ms"] / comp["ms"]}
            res["rows"].append(row)
            mem = (f", extra peak {eager['extra_peak_gib']:.2f} -> {comp['extra_peak_gib']:.2f} GiB" if DEV == "cuda" else "")
            print(f"K {k} x V {v} ({row['logits_gib']:.2f} GiB bf16 logits): eager {eager['ms']:.2f} ms, compiled {comp['ms']:.2f} ms "
                  f"({row['speedup']:.2f}x){mem}", flush=True)
            del logits
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
