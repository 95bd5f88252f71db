"""tasks/ppo/varlen.py: attention over packed sequences by their boundaries.

Against each sequence attended alone (SDPA on its own rows, is_causal), forward and gradients,
over GQA groups, head dims, sliding windows and softcapping, on this machine's device: on a GPU
in bf16 that is the flash varlen kernel (the path the learners take there), on the CPU in fp32
the masked dense path. tests/test_packing.py checks whole models packed against padded."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from tasks.ppo.varlen import _flash_dtype, attend_packed, packed_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


class Layer(torch.nn.Module):
    is_causal = True


def alone(q, k, v, cu, scale, window=None, softcap=None, causal=True):
    """Each sequence of the flat (T, H, D) q / (T, Hkv, D) k, v by itself, fp32, -> (T, H, D)."""
    g = q.shape[1] // k.shape[1]
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        s = qs @ ks.transpose(1, 2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        i = torch.arange(b - a, device=q.device)
        keep = i[:, None] >= i[None, :] if causal else torch.ones(b - a, b - a, dtype=torch.bool, device=q.device)
        if window:
            keep &= i[:, None] - i[None, :] < window
        out.append((s.masked_fill(~keep, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("H, Hkv, D, window, softcap, autocast", [
    (4, 4, 64, None, None, False), (8, 2, 128, None, None, False), (6, 3, 80, 5, None, False), (4, 2, 32, None, 30.0, False),
    (8, 2, 64, None, None, True)])  # fp32 inputs under autocast: what fp32 master weights give the learners
def test_packed_attention_equals_each_sequence_alone(H, Hkv, D, window, softcap, autocast):
    torch.manual_seed(0)
    R, C = 3, 40
    lengths = [17, 9, 14, 1, 24, 15, 3, 33, 4]  # each bin's sequences (the last one of a bin its tail): 40 + 40 + 40
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    assert int(cu[-1]) == R * C
    dtype = torch.float32 if autocast else DTYPE
    q = torch.randn(R, H, C, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(R, Hkv, C, D, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    scale = D ** -0.5
    with attend_packed(T.LlamaConfig()):  # registers the function and reads the GPU's generation, as a packed forward does
        pass
    with torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        out, none = packed_attention(Layer(), q, k, v, None, scaling=scale, cu_seq_lens_q=cu, max_length_q=max(lengths),
                                     sliding_window=window, softcap=softcap)
        flash = _flash_dtype(q, softcap)
    assert none is None and out.shape == (R, C, H, D)
    assert flash == (torch.bfloat16 if DEVICE == "cuda" and softcap is None else None)
    flat = lambda t: t.transpose(1, 2).reshape(R * C, t.shape[1], D)  # noqa: E731
    want = alone(flat(q), flat(k), flat(v), cu, scale, window, softcap)
    tol = dict(rtol=2e-2, atol=5e-2) if DTYPE == torch.bfloat16 or autocast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.reshape(R * C, H, D).float(), want, **tol)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(out.reshape(R * C, H, D).float(), (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_outside_a_packed_forward_it_refuses_and_the_model_gets_its_attention_back():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="runs only on packed rows"):
        packed_attention(Layer(), q, q, q, None)
    with pytest.raises(ValueError, match="attention sinks.*ppo.pack_tokens=0"):
        packed_attention(Layer(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 4]), max_length_q=4, s_aux=torch.zeros(2))
    config = T.LlamaConfig()
    config._attn_implementation = "sdpa"
    with attend_packed(config):
        assert config._attn_implementation == "rlhf_packed"
    assert config._attn_implementation == "sdpa"


# -- tasks/ppo/varlen_kernel.py (varlen.KERNEL 'triton'): natively on CUDA, else in Triton's interpreter ---------------
# (lengths, H, H_kv, D, causal): a sequence of 1 token, shorter than a tile, of exactly one 64-row
# tile, of several tiles with a ragged last; GQA groups of 1, 2 and 4; head dims 32, 64, 128 and 80
# (the last padded to a power of two)
KERNEL_CASES = [([1, 37, 64, 130], 4, 4, 64, True), ([200, 3, 65], 8, 2, 128, True), ([70, 1, 9], 4, 1, 80, True),
                ([33, 64, 5], 2, 2, 32, False), ([129], 4, 2, 64, False)]


def check_triton_kernel_equals_each_sequence_alone(device: str) -> str:
    """The kernel's output and q / k / v gradients against fp32 attention of each sequence alone:
    fp32 inputs to 1e-5 (IEEE products), bf16 inputs within bf16's rounding."""
    from tasks.ppo.varlen_kernel import varlen_attention

    n = 0
    for lengths, H, Hkv, D, causal in KERNEL_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(n)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
            T = int(cu[-1])
            q, k, v = (torch.randn(T, h, D, generator=g).to(device, dtype).requires_grad_() for h in (H, Hkv, Hkv))
            grad = torch.randn(T, H, D, generator=g).to(device, dtype)
            out, lse = varlen_attention(q, k, v, cu, max(lengths), D ** -0.5, causal)
            got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            want = alone(qf, kf, vf, cu, D ** -0.5, causal=causal)
            want = [want, *torch.autograd.grad(want, (qf, kf, vf), grad.float())]
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                assert a.dtype == dtype and a.shape == b.shape, (name, a.dtype, a.shape)
                torch.testing.assert_close(a.float(), b, **tol, msg=lambda m: f"{lengths, H, Hkv, D, causal, dtype} {name}: {m}")
            assert lse.shape == (H, T) and torch.isfinite(lse).all()
            n += 1
    return f"{n} cases equal"


def check_packed_models_through_the_triton_kernel(device: str) -> str:
    """Whole models' packed log-probs, entropies and parameter gradients with ``KERNEL = 'triton'``
    equal their padded forwards (Llama: RoPE, GQA; Qwen2: q/k/v biases; GPT-2: absolute positions),
    and the kernel is what ran: a window, softcapping or dropout fall back to the masked path."""
    import tasks.ppo.varlen_kernel as kernel
    from tasks.ppo import varlen
    from tasks.ppo.generation import forward_actions
    from tests.test_packing import ragged, tiny

    calls, op = [], kernel.varlen_attention
    varlen.KERNEL, kernel.varlen_attention = "triton", lambda *a: calls.append(1) or op(*a)  # counts the layers that took it
    try:
        q = torch.zeros(1, 2, 4, 8, device=device)
        assert varlen._triton_dtype(q, None, None, 0.0) == torch.float32
        assert [varlen._triton_dtype(q, *x) for x in ((30.0, None, 0.0), (None, 3, 0.0), (None, None, 0.1))] == [None] * 3
        for arch in ("llama", "qwen2", "gpt2"):
            model = tiny(arch).to(device)
            ro = ragged(B=9, P=12, N=8, V=64, seed=3)
            seqs, mask, act = ro.sequences.to(device), ro.attention_mask.to(device), ro.action_mask.bool().to(device)
            out = {}
            for pack_tokens in (0, 32):
                model.zero_grad()
                logp, ent = forward_actions(model, seqs, mask, 8, 0.7, pack_tokens)
                (logp * act).sum().backward()
                out[pack_tokens] = logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]
            (lp0, e0, g0), (lp, e, g) = out[0], out[32]
            torch.testing.assert_close(lp[act], lp0[act], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(e[act], e0[act], rtol=1e-5, atol=1e-5)
            for a, b in zip(g, g0):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert len(calls) == 3 * 2, calls  # each model's 2 layers, in its packed forward
    finally:  # natively on CUDA the check runs in the test process: leave nothing switched
        varlen.KERNEL, kernel.varlen_attention = "flash", op
    return "3 models equal"


def test_triton_kernel_equals_each_sequence_alone():
    from tests.test_decode_attention import _run

    assert _run(check_triton_kernel_equals_each_sequence_alone) == f"{2 * len(KERNEL_CASES)} cases equal"


def test_packed_models_through_the_triton_kernel_equal_padded():
    from tests.test_decode_attention import _run

    assert _run(check_packed_models_through_the_triton_kernel) == "3 models equal"


VARLEN_TYPES = {"LSE": "*fp32", "CU": "*i32", "G": "i32", "D": "i32"}  # the kernels' arguments that are not bf16 tensors or i32


def varlen_constexprs(D: int) -> tuple[dict, dict]:
    """The constants of tasks/ppo/varlen_kernel.py's forward (its tiles as ``settings`` gives them)
    and backward (all but its ``BLOCK``) at head dim ``D``, causal, as a bf16 launch has them."""
    from tasks.ppo import varlen_kernel as vk

    block_m, block_n = vk.settings(D)[:2]
    common = {"CAUSAL": True, "BLOCK_D": D, "WIDEN": False, "scale_log2": D ** -0.5 * vk.LOG2E}
    return {**common, "BLOCK_M": block_m, "BLOCK_N": block_n}, {**common, "scale": D ** -0.5}


def varlen_resources(fn, constexprs: dict, warps: int, stages: int, aligned: bool) -> dict:
    """``fn`` of tasks/ppo/varlen_kernel.py compiled for an H100 (tests/sm90.py) on bf16 tensors:
    its registers and spills. ``aligned``: as Triton's launcher specialises the usual call (the
    tensors' addresses, their strides and D multiples of 16; not the log-sum-exp's stride, a token
    count); else with none of that known (the code any call may fall back to)."""
    from tests.sm90 import compile_sm90, launch_divisible, resources, signature

    sig = signature(fn, VARLEN_TYPES)
    divisible = launch_divisible(fn, sig, exclude=("G", "sl_h")) if aligned else ()
    return resources(compile_sm90(fn, sig, constexprs, warps, stages, divisible))


@pytest.mark.parametrize("D", [64, 128])
def test_triton_kernels_spill_no_registers_on_an_h100(D):
    """The kernels' launch settings (``varlen_kernel.settings``) at the learners' head dims, bf16,
    compiled for sm90 here, aligned as a call usually is and not: no program spills registers to
    local memory (the backward at 64-row tiles spilled at head dim 128 at 8 warps, and at 4 warps
    at both head dims; bench/RESULTS.md, fourteenth session; at 8 warps and head dim 64 with the
    GPU image's Triton 3.6, 80 B unaligned, which this test caught on the H100 on 2026-12-08)."""
    from tasks.ppo import varlen_kernel as vk

    _, _, fwd_warps, block, bwd_warps, stages = vk.settings(D)
    # no float arrives at run time: torch.compile types a Python float argument fp64, which fails
    # the forward's compile (its fp32 softmax state turns fp64 in the loop)
    for fn, names in ((vk._forward_kernel, ["scale_log2"]), (vk._backward_kernel, ["scale", "scale_log2"])):
        assert {fn.arg_names.index(n) for n in names} <= set(fn.constexprs), fn.arg_names
    fwd_consts, bwd_consts = varlen_constexprs(D)
    for aligned in (True, False):
        fwd = varlen_resources(vk._forward_kernel, fwd_consts, fwd_warps, stages, aligned)
        bwd = varlen_resources(vk._backward_kernel, {**bwd_consts, "BLOCK": block}, bwd_warps, stages, aligned)
        assert fwd["spill_bytes"] == 0 and bwd["spill_bytes"] == 0, (vk.settings(D), aligned, fwd, bwd)
        assert 0 < fwd["regs"] <= 255 and 0 < bwd["regs"] <= 255
