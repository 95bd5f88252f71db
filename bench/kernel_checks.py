"""Accuracy checks behind figures of bench/RESULTS.md (issue 18, ninth session), printed, nothing timed.

    python3 bench/kernel_checks.py master-adamw     # CUDA: MasterAdamW's Triton step against torch's AdamW
    python3 bench/kernel_checks.py linear-accuracy  # CUDA: the split-K linear at the 8B layer's shapes, M = 64
    TRITON_INTERPRET=1 python3 bench/kernel_checks.py head-layout   # CPU: FastGenerator at the 8B head layout

master-adamw: tasks/common/optim.py's ``MasterAdamW`` (the Triton step) and torch's AdamW on fp32
copies take the same 3 steps of random bf16 gradients on 3 tensors; per tensor the largest master
difference and bf16 weight difference, then how many bf16 weights differ from their own master's
round-to-nearest-even and from torch's. (In Triton's interpreter the cast rounds otherwise: CUDA.)

linear-accuracy: tasks/ppo/decode_linear.py's split-K product (plain and PDL launch, partials summed
in fp32) and cuBLAS's bf16 F.linear against the fp32 product, at M = 64 on the 8B layer's five
shapes and the 0.4B down projection: largest error and how often each one's argmax per row is
the fp32 product's.

head-layout: a 2-layer Llama with the 8B layer's head layout (head_dim 128, 4 query heads on 1 KV
head, d 512, weights of std 0.08, fp32, eager) decodes 12 greedy tokens of tests/test_fast_generate.py's
4 left-padded rows with every pairing of attention (sdpa / triton) and linears (cublas / triton);
the share of tokens equal to sdpa + cublas's.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def master_adamw() -> None:
    from tasks.common.optim import MasterAdamW

    torch.manual_seed(0)
    shapes = [(37, 5), (4097,), (3, 3)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda").bfloat16()) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ps]
    opt, ro = MasterAdamW(ps, lr=1e-2, weight_decay=0.01, triton=True), torch.optim.AdamW(ref, lr=1e-2)
    for _ in range(3):
        for p, r in zip(ps, ref):
            g = torch.randn(p.shape, device="cuda").bfloat16()
            p.grad, r.grad = g.clone(), g.float()
        opt.step(), ro.step(), opt.zero_grad(), ro.zero_grad()
    for (p, w), r in zip(opt.masters(), ref):
        print("max diff: master", (w - r).abs().max().item(), "bf16 weight", (p.float() - r.bfloat16().float()).abs().max().item())
    for (p, w), r in zip(opt.masters(), ref):
        print("bf16 weights unlike: their master's rounding", (p != w.bfloat16()).sum().item(), "torch's", (p != r.bfloat16()).sum().item(),
              "of", p.numel())


def linear_accuracy() -> None:
    import tasks.ppo.decode_linear as dl

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (k, n) in {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
                         "lm_head": (4096, 128256), "0.4b_down": (2816, 1024)}.items():
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ref = x.float() @ w.float().t()
        out = {"cublas": F.linear(x, w).float(), "split": dl.decode_linear_partials(x, w).sum(0).float(),
               "split_pdl": dl.decode_linear_partials_pdl(x, w).sum(0).float()}
        print(name, k, n, "choice", dl.choose(n, k, sms), "ref max", round(ref.abs().max().item(), 3),
              {kk: round((v - ref).abs().max().item(), 5) for kk, v in out.items()},
              "argmax eq", {kk: (v.argmax(-1) == ref.argmax(-1)).float().mean().item() for kk, v in out.items()}, flush=True)


def head_layout() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.ppo.fast_generate import FastGenerator
    from tests.test_fast_generate import fast, left_padded

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger than init so that ties are rare, as tests/test_fast_generate.py's tiny models
        for p in model.parameters():
            p.normal_(0, 0.08 if p.ndim > 1 else 0.1)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
    model = model.eval()
    ids, mask = left_padded()
    t, res = time.time(), {}
    for att, lin in (("sdpa", "cublas"), ("triton", "cublas"), ("sdpa", "triton"), ("triton", "triton")):
        fg = FastGenerator(model, max_batch=4, max_len=32, attention=att, linear=lin)
        res[(att, lin)] = fast(fg, ids, mask, eos=-1, greedy=True).sequences
        print(att, lin, fg.info(), round(time.time() - t), flush=True)
    base = res[("sdpa", "cublas")]
    for k, v in res.items():
        print(k, "tokens equal to sdpa + cublas's:", (v == base).float().mean().item())
    print("sdpa + cublas's new tokens:", base[:, -12:].tolist())


if __name__ == "__main__":
    checks = {"master-adamw": master_adamw, "linear-accuracy": linear_accuracy, "head-layout": head_layout}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(checks)}}}")
    checks[sys.argv[1]]()
