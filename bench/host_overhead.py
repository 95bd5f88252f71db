"""The host's floor under a learner step: one minibatch's Python and dispatch work, per module.

    python3 bench/host_overhead.py --out bench/results/host_overhead_cpu.json     # this CPU machine, one thread

On the H200 the learn epoch of bench/useful_mfu.py keeps the GPU busy only part of the time (its
forward takes twice its backward at 0.4B), so what bounds it is the host's work per minibatch,
which no FLOP saving touches. This measures that work where it can be isolated: a model as deep
as the 0.4B shape (24 layers, the same modules and calls) but 64 wide, on a minibatch of 4 rows of
8 tokens (``--rows``, ``--prompt-len``, ``--new-tokens``), on one CPU thread, so that the
arithmetic is close to nothing and what is left is the cost of issuing the ops. One minibatch as
the stage's learners run it (policy ``action_logprobs`` + clipped loss, critic ``_Values`` + value
loss, backward, AdamW step), unpacked and packed (``ppo.pack_tokens``), timed, then under cProfile
with each step's own time split by the module whose Python runs ("builtins / C calls": the time
inside torch's C++ ops and the autograd engine, i.e. dispatch and the small kernels). Eager blocks
(no ``torch.compile``, which fuses ops on CUDA). The absolute numbers are this CPU's.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, write_json  # noqa: E402
from bench.useful_mfu import ragged_batch  # noqa: E402
from tasks.ppo.generation import action_logprobs  # noqa: E402
from tasks.ppo.losses import ppo_clip_loss, value_loss  # noqa: E402
from tasks.ppo.roles import _Values  # noqa: E402

DEEP_NARROW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=4)
GROUPS = [("transformers masks", "transformers/masking_utils"), ("transformers models", "transformers/models/"),
          ("transformers other", "transformers/"), ("peft", "peft/"), ("tasks.ppo.packing", "tasks/ppo/packing"),
          ("tasks.ppo (other)", "tasks/ppo/"), ("torch.nn modules", "torch/nn/modules"), ("torch.nn.functional", "torch/nn/functional"),
          ("torch autograd", "torch/autograd"), ("torch optim", "torch/optim"), ("torch other", "torch/")]


def build(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    from tasks.rm.model import RewardModel

    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=512, pad_token_id=0, attn_implementation="sdpa", **DEEP_NARROW)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), _Values(RewardModel(LlamaModel(cfg)))


def step(policy, critic, opt, exp: dict, N: int, pack_tokens: int) -> None:
    logp = action_logprobs(policy, exp["seqs_cpu"], exp["attn_cpu"], N, pack_tokens=pack_tokens, device="cpu")
    pl = ppo_clip_loss(logp, exp["old_logp"], exp["adv"], exp["amask"])
    critic.pack_tokens = pack_tokens
    vl = value_loss(critic(exp["seqs"], exp["attn"], N), exp["old_values"], exp["returns"], exp["amask"])
    (pl.loss + vl.loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def by_module(prof: cProfile.Profile) -> dict[str, float]:
    """Own (tottime) seconds of every profiled function, summed by the first GROUPS entry its file matches."""
    out = {name: 0.0 for name, _ in GROUPS} | {"builtins / C calls": 0.0, "other": 0.0}
    for (file, _, _), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        name = next((n for n, key in GROUPS if key in file), "builtins / C calls" if file == "~" else "other")
        out[name] += tottime
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pack-tokens", type=int, default=1024)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)  # host work is one thread's; the arithmetic of a 64-wide model is small
    policy, critic = build(a.vocab)
    opt = torch.optim.AdamW([*policy.parameters(), *critic.parameters()], lr=1e-7)
    exp = ragged_batch(a.rows, a.prompt_len, a.new_tokens, a.vocab)
    res = {"machine": machine(), "command": " ".join(sys.argv), "model": DEEP_NARROW, "rows": a.rows, "prompt_len": a.prompt_len,
           "new_tokens": a.new_tokens, "real_tokens": int(exp["attn"].sum()), "variants": {}}
    for name, pk in (("unpacked", 0), (f"packed{a.pack_tokens}", a.pack_tokens)):
        step(policy, critic, opt, exp, a.new_tokens, pk)  # warm-up
        ts = []
        for _ in range(a.reps):
            t = time.perf_counter()
            step(policy, critic, opt, exp, a.new_tokens, pk)
            ts.append(time.perf_counter() - t)
        prof = cProfile.Profile()
        prof.enable()
        step(policy, critic, opt, exp, a.new_tokens, pk)
        prof.disable()
        split = by_module(prof)
        total = sum(split.values())
        res["variants"][name] = {"step_ms": 1e3 * statistics.median(ts), "profiled_ms": 1e3 * total,
                                 "ms_by_module": {k: round(1e3 * v, 2) for k, v in sorted(split.items(), key=lambda kv: -kv[1])}}
        v = res["variants"][name]
        print(f"{name}: {v['step_ms']:.1f} ms a minibatch step (policy + critic, forward + backward + AdamW), "
              f"{v['profiled_ms']:.1f} ms under cProfile:", flush=True)
        for k, ms in v["ms_by_module"].items():
            if ms > 0.01 * v["profiled_ms"]:
                print(f"  {ms:8.2f} ms {100 * ms / v['profiled_ms']:5.1f}%  {k}", flush=True)
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
