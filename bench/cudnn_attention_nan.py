"""cuDNN's SDPA backward on left-padded rows, with and without tasks.common.model.no_cudnn_attention (issue 18).

    python3 bench/cudnn_attention_nan.py --out $OUT/cudnn_attention_nan.json    # on the GPU machine

The actor's log-prob backward (tests/test_attention_backward.py's model and batch) under bf16
autocast, at lengths around multiples of 128, once with torch's default SDPA backends and once
with cuDNN's switched off: the count of non-finite gradient tensors, and the forward + backward's
time (one call each: the first rows of each setting include warm-up and kernel selection).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, write_json  # noqa: E402
from tasks.common.loop import autocast  # noqa: E402
from tasks.common.model import ModelConfig, load_causal_lm  # noqa: E402
from tasks.ppo.generation import action_logprobs  # noqa: E402
from tests.test_attention_backward import left_padded, save_tiny_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/cudnn_attention_nan.json")
    a = ap.parse_args()
    dev = "cuda"
    folder = save_tiny_llama(tempfile.mkdtemp(), max_len=1024)
    model = load_causal_lm(ModelConfig(pretrain=folder), dev).eval()
    rows = []
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for L in (80, 128, 192, 256, 320, 512):
            ids, mask = left_padded(B=8, L=L, N=64)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with autocast(dev):
                logp = action_logprobs(model, ids, mask, num_actions=64)
            logp.mean().backward()
            torch.cuda.synchronize()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            rows.append({"cudnn_sdp": cudnn, "length": L, "nonfinite_grad_tensors": sum(int(not torch.isfinite(g).all()) for g in grads),
                         "grad_tensors": len(grads), "forward_backward_ms": 1000 * (time.perf_counter() - t0)})
            print(rows[-1], flush=True)
    write_json(a.out, {"machine": machine(), "command": " ".join(sys.argv), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "rows": rows})


if __name__ == "__main__":
    main()
