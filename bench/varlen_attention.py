"""The learners' packed attention alone: aten's flash varlen kernel against tasks/ppo/varlen_kernel.py.

    python3 bench/varlen_attention.py                        # CUDA: the 0.4b, 1.5b and 8b heads, 64 sequences of 40-256 tokens
    python3 bench/varlen_attention.py --settings 0,0,0,0,0,0,128,64,8,64,8,3   # CUDA: two launch settings of the Triton kernel
    TRITON_INTERPRET=1 python3 bench/varlen_attention.py --shapes tiny --seqs 4 --reps 1   # a CPU smoke run

One call of ``tasks/ppo/varlen.packed_attention`` as a learner's layer makes it (one bin holding
``--seqs`` sequences of random lengths in ``--lengths``, bf16, causal, the shape's query / KV
heads and head dimension), with ``varlen.KERNEL`` 'flash' and 'triton': milliseconds of the
forward and of forward + backward (median of ``--reps`` after 3 warm-ups, host and device; and the
kernels' device time alone, under torch.profiler: on an H100 the Triton op's eager forward +
backward here took 1.29-1.45 ms, where the learn epoch's profile gave its kernels ~0.28 ms a call,
bench/RESULTS.md 2026-12-08), the causal FLOPs' rate,
and each kernel's largest error against an fp32 attention of each sequence alone (output and the
three gradients), side by side with the ratio: flash's time over the fastest Triton entry's.
The Triton kernel runs once per ``--settings`` entry (its launch settings: BLOCK_M, BLOCK_N,
FWD_WARPS, BLOCK_BWD, BWD_WARPS, NUM_STAGES of tasks/ppo/varlen_kernel.py, 0 for its choice by
head dim). The 0.4B learn epoch of bench/RESULTS.md (twelfth session) makes 48 such calls of
~9,300 tokens, and took 14.4 ms in them with flash.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import SHAPES, kernel_ms, machine, median_ms, write_json  # noqa: E402
from tasks.ppo import varlen  # noqa: E402
from tasks.ppo import varlen_kernel  # noqa: E402

DEFAULTS = (varlen_kernel.BLOCK_M, varlen_kernel.BLOCK_N, varlen_kernel.FWD_WARPS, varlen_kernel.BLOCK_BWD, varlen_kernel.BWD_WARPS,
            varlen_kernel.NUM_STAGES)  # the module's own, where a --settings entry gives 0

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Layer(torch.nn.Module):
    is_causal = True


def alone(q, k, v, cu):
    """fp32 causal attention of each sequence by itself: (T, H, D) q, (T, H_kv, D) k / v -> (T, H, D)."""
    g = q.shape[1] // k.shape[1]
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0),
                                                  is_causal=True).transpose(0, 1))
    return torch.cat(out)


def run(kernel: str, q, k, v, cu, max_len: int, grad, reps: int) -> dict:
    """``kernel``'s forward and forward + backward ``reps`` times after 3 warm-ups -> ms and its outputs."""
    varlen.KERNEL = kernel
    T, H, D = q.shape
    # one bin of every sequence: (1, T, H, D) leaves, given as the (1, H, T, D) views a layer's projections give
    qb, kb, vb = (t.detach()[None].clone().requires_grad_() for t in (q, k, v))

    def forward():
        return varlen.packed_attention(Layer(), qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), None,
                                       cu_seq_lens_q=cu, max_length_q=max_len)[0]

    def both():
        qb.grad = kb.grad = vb.grad = None
        forward().backward(grad)

    times = {}
    for name, fn in (("forward", lambda: torch.no_grad()(forward)()), ("forward_backward", both)):
        times[name + "_ms"] = median_ms(fn, reps, warmup=3)
        times[name + "_kernel_ms"] = kernel_ms(fn, reps)
    out = forward()
    qb.grad = kb.grad = vb.grad = None
    out.backward(grad)
    return {**times, "out": out.reshape(T, H, D).float(), "grads": [t.grad[0].float() for t in (qb, kb, vb)]}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.4b,1.5b,8b")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--lengths", default="40,256", help="lo,hi: each sequence's length uniform in [lo, hi]")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--settings", default=None, help="groups of 6 comma-separated ints: BLOCK_M,BLOCK_N,FWD_WARPS,BLOCK_BWD,BWD_WARPS,"
                    "NUM_STAGES (0: tasks/ppo/varlen_kernel.py's choice by head dim); default: the module's own")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with varlen.attend_packed(__import__("transformers").LlamaConfig()):  # registers the function, reads the GPU's generation
        pass
    lo, hi = map(int, a.lengths.split(","))
    ints = [int(x) for x in a.settings.split(",")] if a.settings else []
    assert len(ints) % 6 == 0, "--settings: groups of 6 ints"
    settings = [tuple(ints[i:i + 6]) for i in range(0, len(ints), 6)] or [None]
    g = torch.Generator().manual_seed(0)
    res = {"command": " ".join(["bench/varlen_attention.py", *sys.argv[1:]]), "machine": machine(), "rows": []}
    for shape in a.shapes.split(","):
        s = SHAPES[shape]
        H, Hkv = s["num_attention_heads"], s["num_key_value_heads"]
        D = s["hidden_size"] // H
        lens = torch.randint(lo, hi + 1, (a.seqs,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(DEV, torch.int32)
        T = int(lens.sum())
        q, k, v = (torch.randn(T, h, D, generator=g).to(DEV, torch.bfloat16) for h in (H, Hkv, Hkv))
        grad = torch.randn(1, T, H, D, generator=g).to(DEV, torch.bfloat16)
        qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
        want = alone(qf, kf, vf, cu)
        want_grads = torch.autograd.grad(want, (qf, kf, vf), grad[0].float())
        flops = 4 * H * D * sum(n * (n + 1) / 2 for n in lens.tolist())  # QK^T and PV over the causal pairs
        row = {"shape": shape, "heads": H, "kv_heads": Hkv, "head_dim": D, "tokens": T, "seqs": a.seqs, "max_len": int(lens.max())}
        runs = [("flash", None)] if DEV == "cuda" else []
        runs += [("triton" if i == 0 else f"triton{i}", st) for i, st in enumerate(settings)]
        for kernel, st in runs:
            if st:
                (varlen_kernel.BLOCK_M, varlen_kernel.BLOCK_N, varlen_kernel.FWD_WARPS, varlen_kernel.BLOCK_BWD, varlen_kernel.BWD_WARPS,
                 varlen_kernel.NUM_STAGES) = (x or d for x, d in zip(st, DEFAULTS))
            r = run(kernel.rstrip("0123456789"), q, k, v, cu, int(lens.max()), grad, a.reps)
            err = [(r["out"] - want).abs().max().item()] + [(x - y).abs().max().item() for x, y in zip(r["grads"], want_grads)]
            row[kernel] = {"settings": varlen_kernel.settings(D), "forward_ms": r["forward_ms"], "forward_backward_ms": r["forward_backward_ms"],
                           "forward_kernel_ms": r["forward_kernel_ms"], "forward_backward_kernel_ms": r["forward_backward_kernel_ms"],
                           "forward_tflops": flops / r["forward_ms"] / 1e9,
                           "forward_backward_tflops": 3.5 * flops / r["forward_backward_ms"] / 1e9,  # backward ~2.5x the forward
                           "max_err_out_dq_dk_dv": err}
            print(f"{shape} ({T} tokens, {H}/{Hkv} heads x {D}) {kernel}: forward {r['forward_ms']:.3f} ms, forward + backward "
                  f"{r['forward_backward_ms']:.3f} ms (kernels {r['forward_kernel_ms']:.3f}, {r['forward_backward_kernel_ms']:.3f}); "
                  f"errors {', '.join(f'{e:.1e}' for e in err)}", flush=True)
        if "flash" in row:
            ours = [row[name] for name, _ in runs[1:]]
            for kind in ("", "kernel_"):
                for part in ("forward", "forward_backward"):
                    key = f"{part}_{kind}ms"
                    row[f"{kind}speedup_{part}"] = row["flash"][key] / min(r[key] for r in ours)
            print(f"{shape}: flash / fastest triton time, forward {row['speedup_forward']:.2f}x, forward + backward "
                  f"{row['speedup_forward_backward']:.2f}x; kernels only {row['kernel_speedup_forward']:.2f}x, "
                  f"{row['kernel_speedup_forward_backward']:.2f}x", flush=True)
        res["rows"].append(row)
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
