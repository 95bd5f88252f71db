"""tasks/common/optim.py: AdamW over fp32 masters of bf16 parameters (``ppo.learner_weights`` 'bf16').

Three ways, as the losses are: against torch's AdamW / Adam on fp32 copies (the torch step, op for
op: exactly), the Triton step against the torch step (natively on CUDA, else in Triton's
interpreter in a fresh process, ``tests.test_decode_attention._run``), and the state through
``state_dict`` / ``load_state_dict`` and torch.distributed.checkpoint's full state dicts, whose
resumed steps equal the uninterrupted ones bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tasks.common.optim import STATE_KEYS, MasterAdamW, params_to_bf16
from tests.test_decode_attention import _run

SHAPES = [(7, 5), (4099,), (3, 64, 33)]  # one off the Triton block, one across two blocks


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SHAPES]


def _grads(step: int, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 10 ** (step % 3 - 1)).to(device, torch.bfloat16) for s in SHAPES]


def _run_steps(opt, params, steps: range) -> None:
    for i in steps:
        for p, g in zip(params, _grads(i, params[0].device)):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("torch_cls,wd", [(torch.optim.AdamW, 0.1), (torch.optim.Adam, 0.0)])
def test_torch_step_equals_torch_adam_on_fp32_copies_exactly(torch_cls, wd):
    params = _params()
    copies = [torch.nn.Parameter(p.detach().float()) for p in params]
    ours = MasterAdamW(params, lr=3e-3, weight_decay=wd, triton=False)
    theirs = torch_cls(copies, lr=3e-3, weight_decay=wd, foreach=False)
    for i in range(5):
        for p, c, g in zip(params, copies, _grads(i)):
            p.grad, c.grad = g.clone(), g.float()
        ours.step()
        theirs.step()
    for (p, master), c in zip(ours.masters(), copies):
        assert master.dtype == torch.float32 and torch.equal(master, c.detach())
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), c.detach().to(torch.bfloat16))  # the master rounded
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for _, m in ours.masters())  # the masters hold more than bf16


def check_triton_step_equals_torch_step(device: str) -> str:
    """Five steps of the Triton kernel against the torch step: masters and moments to fp32
    rounding, every bf16 weight its master rounded to nearest even."""
    a, b = _params(), _params()
    a, b = [torch.nn.Parameter(p.detach().to(device)) for p in a], [torch.nn.Parameter(p.detach().to(device)) for p in b]
    tri, ref = MasterAdamW(a, lr=3e-3, weight_decay=0.1, triton=True), MasterAdamW(b, lr=3e-3, weight_decay=0.1, triton=False)
    _run_steps(tri, a, range(5))
    _run_steps(ref, b, range(5))
    worst = 0.0
    for p, q in zip(a, b):
        for k in STATE_KEYS:
            x, y = tri.state[p][k], ref.state[q][k]
            assert x.dtype == torch.float32
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
            worst = max(worst, float((x - y).abs().max()))
        master = tri.state[p]["master"]
        if device == "cuda":
            assert torch.equal(p.detach(), master.to(torch.bfloat16))
        else:  # Triton's interpreter rounds toward zero whatever fp_downcast_rounding says: one of the two neighbours
            toward_zero = (master.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
            assert bool(((p.detach() == master.to(torch.bfloat16)) | (p.detach() == toward_zero)).all())
        assert float(tri.state[p]["step"]) == 5
    return f"{len(a)} parameters equal (max diff {'small' if worst < 1e-5 else worst})"


def test_triton_step_equals_torch_step():
    assert _run(check_triton_step_equals_torch_step) == f"{len(SHAPES)} parameters equal (max diff small)"


MT_SHAPES = [(7, 5), (4099,), (3, 64, 33), (2, 256), (1,)]  # to a 256-element block: under it, off it, off it, on it, one element
MT_SKIPPED = {1: 1, 4: 4}  # step: the parameter without a gradient then (its step count falls behind: a second group)


def check_multi_tensor_step_equals_per_parameter_kernel(device: str) -> str:
    """Six steps of the multi-tensor launches (256-element blocks; a parameter without a gradient
    at two of them; a state_dict save and load after three) against the per-parameter kernel:
    steps, masters, moments and bf16 weights equal bit for bit, in two launches a group (whole
    blocks, partial ones)."""
    import tasks.common.optim as optim

    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, torch.bfloat16)) for s in MT_SHAPES]

    def run(opt, ps, steps):
        for i in steps:
            g = torch.Generator().manual_seed(100 + i)
            for j, p in enumerate(ps):
                grad = (torch.randn(p.shape, generator=g) * 10 ** (i % 3 - 1)).to(device, torch.bfloat16)
                p.grad = None if MT_SKIPPED.get(i) == j else grad
            launches.append(0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def assert_equal(opt_a, a, opt_b, b):
        for p, q in zip(a, b):
            assert torch.equal(p.detach(), q.detach())
            assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in ("step", *STATE_KEYS))

    launches, built = [], optim._kernels
    per_parameter, multi_tensor, tl_dtype = built()

    class Counted:  # the multi-tensor kernel, its launches counted
        def __getitem__(self, grid):
            launches[-1] += 1
            return multi_tensor[grid]

    block, optim.BLOCK, optim._kernels = optim.BLOCK, 256, lambda: (per_parameter, Counted(), tl_dtype)
    try:
        ref_params, first = params(), params()
        ref = MasterAdamW(ref_params, lr=3e-3, weight_decay=0.1, triton=True, multi_tensor=False)
        opt = MasterAdamW(first, lr=3e-3, weight_decay=0.1, triton=True, multi_tensor=True)
        run(ref, ref_params, range(3))
        launches.clear()
        run(opt, first, range(3))
        assert_equal(ref, ref_params, opt, first)
        second = [torch.nn.Parameter(p.detach().clone()) for p in first]  # the bf16 weights, as a checkpoint has them
        resumed = MasterAdamW(second, lr=3e-3, weight_decay=0.1, triton=True, multi_tensor=True)
        resumed.load_state_dict(opt.state_dict())
        run(ref, ref_params, range(3, 6))
        del launches[3:]
        run(resumed, second, range(3, 6))
        assert_equal(ref, ref_params, resumed, second)
        # one step count (whole blocks, then partial ones), then two from step 2 on
        assert launches == [2, 2, 4, 4, 4, 4], launches
    finally:
        optim.BLOCK, optim._kernels = block, built
    return f"{len(MT_SHAPES)} parameters equal over 6 steps"


def test_multi_tensor_step_equals_per_parameter_kernel():
    assert _run(check_multi_tensor_step_equals_per_parameter_kernel) == f"{len(MT_SHAPES)} parameters equal over 6 steps"


@pytest.mark.parametrize("multi_tensor", [False, True])
def test_a_gradient_that_is_not_contiguous_takes_the_torch_step(multi_tensor):
    """The Triton kernels index flat: given a transposed gradient they stepped each element with
    another's gradient (the per-parameter kernel did so until 2026-12-07's fourteenth session).
    Such a parameter takes the torch ops, bit for bit the torch step's, and no kernel runs (on the
    CPU, outside Triton's interpreter, a launch would fail)."""
    a, b = (torch.nn.Parameter(torch.ones(8, 4, dtype=torch.bfloat16)) for _ in range(2))
    fused, plain = MasterAdamW([a], lr=0.1, triton=True, multi_tensor=multi_tensor), MasterAdamW([b], lr=0.1, triton=False)
    for opt, p in ((fused, a), (plain, b)):
        p.grad = torch.arange(32.0).view(4, 8).to(torch.bfloat16).t()  # (8, 4), strides (1, 8)
        opt.step()
    assert torch.equal(a.detach(), b.detach())
    assert all(torch.equal(fused.state[a][k], plain.state[b][k]) for k in ("step", *STATE_KEYS))
    assert fused.state[a]["exp_avg"][0].tolist() == pytest.approx([0.0, 0.8, 1.6, 2.4])  # (1 - 0.9) * row 0 of the transposed gradient


def test_chunk_tables_hold_whole_blocks_and_partial_ones_and_are_built_once(monkeypatch):
    import tasks.common.optim as optim

    monkeypatch.setattr(optim, "BLOCK", 4)
    opt = MasterAdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    whole, tails = opt._chunks((9, 4, 1, 0), torch.device("cpu"))  # an empty parameter has neither
    assert whole.dtype == tails.dtype == torch.int64
    assert whole.tolist() == [[0, 0, 1], [0, 4, 0]]  # rows: parameter, start
    assert tails.tolist() == [[0, 2], [8, 0], [9, 1]]  # rows: parameter, start, its size
    assert opt._chunks((9, 4, 1, 0), torch.device("cpu"))[0] is whole


def adamw_signatures() -> tuple[dict, dict]:
    """The argument types (tests/sm90.py) of tasks/common/optim_kernels.py's multi-tensor and
    per-parameter kernels, bf16 weights and gradients."""
    import tasks.common.optim as optim
    from tests.sm90 import signature

    per_parameter, multi_tensor, _ = optim._kernels()
    floats = {f: "fp32" for f in ("lr", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "decay", "bc1", "bc2_sqrt")}
    return (signature(multi_tensor, {"ptrs": "*i64", "chunks": "*i64", **floats}),
            signature(per_parameter, {"p_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", **floats}))


def test_multi_tensor_whole_blocks_compile_to_vector_accesses_for_an_h100():
    """The multi-tensor kernel compiled for sm90 (tests/sm90.py), bf16 weights and gradients: its
    whole blocks at aligned addresses read and write every weight, gradient and state in 16-byte
    vectors, as the per-parameter kernel does on sizes Triton specialises as multiples of 16; the
    partial blocks are scalar. (The first multi-tensor step, masked throughout, was scalar
    everywhere and 3.2x slower than the per-parameter launches on an H100: bench/RESULTS.md.)"""
    import triton.language as tl

    import tasks.common.optim as optim
    from tests.sm90 import compile_sm90, global_accesses, launch_divisible

    per_parameter, multi_tensor, _ = optim._kernels()
    sig, sig_pp = adamw_signatures()
    const = {"P": tl.bfloat16, "G": tl.bfloat16, "BLOCK": optim.BLOCK}
    whole = global_accesses(compile_sm90(multi_tensor, sig, {**const, "TAIL": False, "ALIGNED": True}))
    tail = global_accesses(compile_sm90(multi_tensor, sig, {**const, "TAIL": True, "ALIGNED": True}))
    # the 5 pointers and the chunk table's 2 entries are 64-bit loads; everything else a vector
    assert set(whole) == {"ld.global.b64", "ld.global.v4.b32", "st.global.v4.b32"}, whole
    assert not any(".v" in op for op in tail), tail
    pp = compile_sm90(per_parameter, sig_pp, {"BLOCK": optim.BLOCK}, divisible=launch_divisible(per_parameter, sig_pp))
    vectors = lambda acc: {k: v for k, v in acc.items() if ".v4." in k}  # noqa: E731
    assert vectors(whole) == vectors(global_accesses(pp)), (whole, global_accesses(pp))


def test_state_dict_round_trip_keeps_fp32_masters_and_resumes_exactly():
    whole = _params()
    opt = MasterAdamW(whole, lr=3e-3, weight_decay=0.1, triton=False)
    _run_steps(opt, whole, range(6))

    first = _params()
    opt1 = MasterAdamW(first, lr=3e-3, weight_decay=0.1, triton=False)
    _run_steps(opt1, first, range(3))
    saved = opt1.state_dict()
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]  # the bf16 weights, as a checkpoint has them
    opt2 = MasterAdamW(second, lr=3e-3, weight_decay=0.1, triton=False)
    opt2.load_state_dict(saved)
    for p in second:  # torch's load_state_dict would have cast these to bf16
        assert all(opt2.state[p][k].dtype == torch.float32 for k in STATE_KEYS)
    assert all(opt2.state[p]["master"] is not opt1.state[q]["master"] for p, q in zip(second, first))  # copies, not shared
    _run_steps(opt2, second, range(3, 6))
    for p, q in zip(whole, second):
        assert torch.equal(p.detach(), q.detach()) and torch.equal(opt.state[p]["master"], opt2.state[q]["master"])


def test_full_state_dicts_of_torch_distributed_checkpoint_carry_the_masters():
    """What the PPO checkpoints use (tasks/ppo/group.py ``full_state``): the masters go out keyed
    by parameter name, come back fp32 into a fresh optimizer (whose state the loader first builds
    with a zero-learning-rate step), and the resumed steps equal the uninterrupted ones."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        params_to_bf16(m)
        return m

    def steps(m, opt, n, start=0):
        for i in range(start, start + n):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            m(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    whole = model()
    opt = MasterAdamW(whole.parameters(), lr=1e-2, triton=False)
    steps(whole, opt, 6)
    a = model()
    opt_a = MasterAdamW(a.parameters(), lr=1e-2, triton=False)
    steps(a, opt_a, 3)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(a, opt_a, options=opts)
    assert state["state"]["0.weight"]["master"].dtype == torch.float32
    b = model()
    b.load_state_dict(a.state_dict())
    opt_b = MasterAdamW(b.parameters(), lr=1e-2, triton=False)
    set_optimizer_state_dict(b, opt_b, state, options=StateDictOptions(full_state_dict=True))
    assert float(opt_b.state[b[0].weight]["step"]) == 3
    steps(b, opt_b, 3, start=3)
    for p, q in zip(whole.parameters(), b.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    assert all(torch.equal(m, n) for (_, m), (_, n) in zip(opt.masters(), opt_b.masters()))


def test_params_to_bf16_casts_every_parameter_and_leaves_buffers():
    m = torch.nn.Linear(3, 3)
    m.register_buffer("inv_freq", torch.ones(2))
    m.bias.requires_grad_(False)
    params_to_bf16(m)
    assert m.weight.dtype == torch.bfloat16 and m.weight.requires_grad and isinstance(m.weight, torch.nn.Parameter)
    assert m.bias.dtype == torch.bfloat16 and not m.bias.requires_grad and m.inv_freq.dtype == torch.float32


def _ddp_rank(rank: int, world: int, port: int, hook: bool, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tasks.ppo.group import fp32_all_reduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        m = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
        ddp = DistributedDataParallel(m)
        if hook:
            ddp.register_comm_hook(None, fp32_all_reduce)
        # gradients 1, 2^-8, 2^-8 of every weight: summed in bf16 the small ones are lost to the rounding
        ddp(torch.full((1, 4), [1.0, 2 ** -8, 2 ** -8][rank], dtype=torch.bfloat16)).sum().backward()
        torch.save(m.weight.grad, f"{out}/{rank}.pt")
        dist.barrier()  # no rank tears gloo down while a peer still talks to it (a rank aborted so, ~1 run in 12)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hook", [True, False])
def test_ddp_hook_averages_bf16_gradients_in_fp32(tmp_path, hook):
    """tasks/ppo/group.py ``fp32_all_reduce`` on three gloo ranks: every rank gets the fp32 mean
    rounded once to bf16; DDP's own bf16 reduction (``hook`` False) misses it in some elements."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_rank, args=(3, port, hook, str(tmp_path)), nprocs=3)
    want = torch.tensor((1 + 2 ** -7) / 3).to(torch.bfloat16)
    grads = [torch.load(tmp_path / f"{r}.pt") for r in range(3)]
    assert all(torch.equal(g, grads[0]) for g in grads)  # one average on every rank
    assert bool((grads[0] == want).all()) == hook
