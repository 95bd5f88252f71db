"""Accuracy checks behind figures of bench/RESULTS.md (issue 18, ninth session), printed, nothing timed.

    python3 bench/kernel_checks.py master-adamw     # CUDA: MasterAdamW's Triton step against torch's AdamW
    python3 bench/kernel_checks.py linear-accuracy  # CUDA: the split-K linear at the 8B layer's shapes, M = 64
    TRITON_INTERPRET=1 python3 bench/kernel_checks.py head-layout   # CPU: FastGenerator at the 8B head layout
    python3 bench/kernel_checks.py registers        # no GPU needed: the Triton kernels compiled for an H100
    python3 bench/kernel_checks.py decode-logits 8b  # CUDA: each path's greedy tokens against the fp32 model

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

registers: the Triton kernels compiled for an H100 (sm90) by Triton's own ptxas (tests/sm90.py),
what the compiler makes of them without running them: tasks/ppo/varlen_kernel.py's forward and
backward at head dims 64 and 128, at its chosen settings and others, each specialised as a usual
call is (aligned addresses and strides) and not: registers and spilled bytes a thread;
tasks/common/optim_kernels.py's multi-tensor kernel (whole and partial blocks, aligned or not)
and per-parameter kernel: the forms of their global loads and stores in the PTX; the decode
kernels (split-K attention, with RoPE, and the split-K linear at the 0.4B shapes): registers and
spills.

decode-logits SHAPE: ``decode_logits``'s docstring (settles whether the split-K path's greedy
tokens part from cuBLAS's on near-ties, RESULTS' ninth session). On CPU (in Triton's interpreter)
a smoke run at 4 rows, 16 + 8 tokens.
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


def decode_logits(shape: str) -> None:
    """Whether FastGenerator's greedy tokens follow the fp32 model, with each kind of linear.

    A random-weight Llama of ``shape`` (bench/common.py, seed 0) in bf16 decodes 64 rows of 128
    random prompt tokens for 128 new tokens (Triton attention, greedy, no EOS) with cuBLAS's and
    with the split-K linears; the same weights in fp32 then score each path's own sequence,
    teacher-forced (plain HF forward, eager attention). Per path: how often its token is the fp32
    argmax given the same prefix, and where it is not, the fp32 logit it gave up (max minus the
    chosen token's) beside the logits' spread. Tokens that part between the paths because of
    near-ties give up little: a token each path chose that the fp32 model ranks far lower would
    be an error of that path."""
    from bench.common import build_policy, shape_vocab
    from tasks.ppo.fast_generate import FastGenerator

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = shape_vocab(shape)
    ref = build_policy(shape, dev, torch.float32, vocab=vocab).eval()
    ref.config._attn_implementation = "eager"
    model = build_policy(shape, dev, torch.bfloat16, vocab=vocab).eval()
    rows, prompt, new = (64, 128, 128) if dev == "cuda" else (4, 16, 8)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, prompt), generator=g).to(dev)
    mask = torch.ones_like(ids)
    seqs = {}
    for lin in ("cublas", "triton"):
        fg = FastGenerator(model, max_batch=rows, max_len=prompt + new, attention="triton", linear=lin)
        seqs[lin] = fg.generate(ids, mask, max_new_tokens=new, eos_token_id=-1, pad_token_id=0, greedy=True).sequences
        del fg
    print("tokens equal between the paths:", (seqs["cublas"][:, prompt:] == seqs["triton"][:, prompt:]).float().mean().item())
    del model
    for lin, s in seqs.items():
        agree, regret, spread = [], [], []
        with torch.no_grad():
            for i in range(0, rows, 8):
                logits = ref(s[i:i + 8, :-1]).logits[:, prompt - 1:].float()  # predicting the new tokens
                chosen = s[i:i + 8, prompt:]
                top = logits.max(-1).values
                agree.append(logits.argmax(-1) == chosen)
                regret.append(top - logits.gather(-1, chosen[..., None])[..., 0])
                spread.append(logits.std(-1))
        agree, regret, spread = torch.cat(agree), torch.cat(regret), torch.cat(spread)
        miss = regret[~agree]
        print(f"{shape} {lin}: fp32 argmax in {agree.float().mean().item():.4f} of {agree.numel()} tokens; where not, "
              f"the fp32 logit given up: median {miss.median().item() if miss.numel() else 0:.4f}, "
              f"max {miss.max().item() if miss.numel() else 0:.4f} (the logits' std: median {spread.median().item():.3f})", flush=True)


def registers() -> None:
    import triton.language as tl

    import tasks.common.optim as optim
    import tasks.ppo.decode_attention as da
    import tasks.ppo.decode_linear as dl
    import tasks.ppo.varlen_kernel as vk
    from tests.sm90 import compile_sm90, global_accesses, launch_divisible, resources, signature
    from tests.test_optim import adamw_signatures
    from tests.test_varlen import varlen_constexprs, varlen_resources

    for D in (64, 128):
        block_m, block_n, fwd_warps, block, bwd_warps, stages = vk.settings(D)
        fwd_consts, bwd_consts = varlen_constexprs(D)
        for aligned in (True, False):
            fwd = varlen_resources(vk._forward_kernel, fwd_consts, fwd_warps, stages, aligned)
            print(f"varlen forward, head dim {D}, {'aligned' if aligned else 'unaligned'}, {block_m}x{block_n} tiles, {fwd_warps} warps: {fwd}")
            for rows, warps in sorted({(block, bwd_warps), (64, 4), (64, 8), (32, 4), (32, 8)}):
                bwd = varlen_resources(vk._backward_kernel, {**bwd_consts, "BLOCK": rows}, warps, stages, aligned)
                chosen = " (chosen)" if (rows, warps) == (block, bwd_warps) else ""
                print(f"varlen backward, head dim {D}, {'aligned' if aligned else 'unaligned'}, {rows}-row tiles, {warps} warps{chosen}: {bwd}")
    per_parameter, multi_tensor, _ = optim._kernels()
    sig, sig_pp = adamw_signatures()
    for tail in (False, True):
        for aligned in (True, False):
            k = compile_sm90(multi_tensor, sig, {"P": tl.bfloat16, "G": tl.bfloat16, "TAIL": tail, "ALIGNED": aligned, "BLOCK": optim.BLOCK})
            print(f"MasterAdamW multi-tensor, {'partial' if tail else 'whole'} blocks, ALIGNED {aligned}: {global_accesses(k)}")
    k = compile_sm90(per_parameter, sig_pp, {"BLOCK": optim.BLOCK}, divisible=launch_divisible(per_parameter, sig_pp))
    print(f"MasterAdamW per-parameter, aligned addresses, a size of whole 16s: {global_accesses(k)}")
    hd = 64  # the 0.4B shape's
    att = {"scale": hd ** -0.5, "masked": -3.0e38, "HD": hd, "G_PAD": da.MIN_ROWS, "HD_PAD": hd, "BLOCK": da.tile_columns(hd, 2),
           "ONE_SPLIT": True, "DOT_IN_F32": False}
    f32 = {**{n: "*fp32" for n in ("Mx", "Sm", "Acc", "QKV", "Cos", "Sin")}, "G": "i32", "L": "i32"}  # G, L: sizes
    sig = signature(da._partial_kernel, {"Bias": "*bf16", "Out": "*bf16", **f32})
    k = compile_sm90(da._partial_kernel, sig, att, da.NUM_WARPS, da.NUM_STAGES, launch_divisible(da._partial_kernel, sig))
    print(f"decode attention (split-K), head dim {hd}: {resources(k)}")
    sig = signature(da._partial_rope_kernel, {"Bias": "*bf16", "Out": "*bf16", "Col": "*i64", **f32})
    for parts in (1, 4):
        k = compile_sm90(da._partial_rope_kernel, sig, {**att, "PARTS": parts, "PDL": True, "PREFETCH": da.PREFETCH_TILES},
                         da.NUM_WARPS, da.NUM_STAGES, launch_divisible(da._partial_rope_kernel, sig))
        print(f"decode attention with RoPE, {parts} part(s), PDL: {resources(k)}")
    sig = signature(dl._partials_kernel, {"P": "*fp32", "M": "i32", "N": "i32", "K": "i32"})
    for n, kk in ((3072, 1024), (1024, 1024), (5632, 1024), (1024, 2816)):
        block_n, _, block_k, stages = dl.settings(n, kk, da.SMS_IF_NOT_CUDA)
        for pdl in (False, True):
            k = compile_sm90(dl._partials_kernel, sig, {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": block_k, "DOT_IN_F32": False, "PDL": pdl},
                             dl.NUM_WARPS, stages, launch_divisible(dl._partials_kernel, sig))
            print(f"decode linear (split-K), {n} x {kk} weight, 64 rows, PDL {pdl}: {resources(k)}")


if __name__ == "__main__":
    checks = {"master-adamw": master_adamw, "linear-accuracy": linear_accuracy, "head-layout": head_layout,
              "decode-logits": decode_logits, "registers": registers}
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in checks:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(checks)}}} [shape, decode-logits only]")
    checks[sys.argv[1]](*sys.argv[2:])
