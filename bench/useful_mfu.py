"""The learn phase on ragged rollouts: how much of the GPU's work is on real tokens (issue 18).

    python3 bench/useful_mfu.py --shape 0.4b --out bench/results/useful_mfu_0.4b.json     # on the H200
    python3 bench/useful_mfu.py --shape 1.5b --lora-actor 32 --out bench/results/useful_mfu_1.5b.json
    python3 bench/useful_mfu.py --shape 0.4b --variants packed1024 --learners apart        # the stage's layout: two processes
    python3 bench/useful_mfu.py --shape 1.5b --minibatch 64 --weights bf16 --variants packed4096   # bf16 weights, fp32 masters
    python3 bench/useful_mfu.py --shape tiny --batch 16 --minibatch 4 --reps 1            # CPU: a smoke run

A rollout batch as users' data makes it: prompts of ``--prompt-len`` / 4 .. ``--prompt-len``
tokens, left-padded, and responses that stop at EOS after ``--new-tokens`` / 8 .. ``--new-tokens``
tokens (uniform, seeded). One PPO epoch over it in minibatches of ``--minibatch`` rows with the
stage's own functions: ``action_logprobs`` + the clipped policy loss on the policy,
``tasks.ppo.roles._Values`` (the critic's forward) + the clipped value loss, bf16 autocast over
fp32 master weights (or a LoRA actor on a bf16 base; ``--weights bf16``: bf16 weights and fp32
masters in the optimizer, tasks/common/optim.py's ``MasterAdamW``, the stage's ``ppo.learner_weights``
'bf16'), fused AdamW, compiled blocks on CUDA.
Every forward skips the columns no row of its minibatch attends (tasks/ppo/padding.py).

The policy and the critic learn one after the other in this process, or (``--learners apart``)
each in a process of its own on the same GPU, every epoch started together, as the stage's actor
and critic roles learn: one learner's kernels run while the other's host issues its next ones.

Variants, side by side in one run: minibatches in rollout order (``ppo.bucket_by_length``
off) and ordered by ``length_order`` (on), unpacked, and with the rows' real tokens packed into
bins of C columns (``ppo.pack_tokens``, tasks/ppo/packing.py): ``--variants``. Reported: seconds per epoch, the columns computed
against the real tokens, **useful-token MFU** (the FLOPs of the real tokens only, over the time,
against the 989 TFLOP/s datasheet peak) and the MFU of the tokens computed (padding included).
``--profile`` then splits one epoch of the fastest variant into forward / backward / optimizer step
(synchronised between them; ``*_host``: until the host had issued the phase, so a phase whose host
time is its whole time waits on the host or on a sync inside it) and runs it and the ``--profile-variants`` under torch.profiler: the
device's kernel time against the wall time, by kind (GEMM, attention, optimizer, fused
elementwise, copies), and the ops with the most device time: where an epoch goes.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (H200_BF16_DENSE_TFLOPS, build_policy, build_value_model, is_kernel, llama_config, lora_value_model,  # noqa: E402
                          machine, matmul_tflops, n_params, peak_gib, ppo_epoch_flops, reset_peak, shape_vocab, sync, timed, train_flops, workload_args,
                          write_json)
from tasks.common.optim import MasterAdamW  # noqa: E402
from tasks.ppo.generation import action_logprobs  # noqa: E402
from tasks.ppo.losses import ppo_clip_loss, value_loss  # noqa: E402
from tasks.ppo import packing, varlen  # noqa: E402
from tasks.ppo.packing import pack  # noqa: E402
from tasks.ppo.padding import attended_span, length_order  # noqa: E402
from tasks.ppo.roles import _Values  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def ragged_batch(B: int, P: int, N: int, vocab: int, seed: int = 0) -> dict:
    """(B, P + N) sequences / masks of a ragged rollout, plus old log-probs, values, advantages, returns."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(max(1, P // 4), P + 1, (B,), generator=g)
    rlen = torch.randint(max(1, N // 8), N + 1, (B,), generator=g)
    cols = torch.arange(P + N)[None]
    attn = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()
    amask = attn[:, P:].float()
    seqs = torch.randint(3, vocab, (B, P + N), generator=g) * attn
    rnd = lambda: torch.randn(B, N, generator=g) * amask  # noqa: E731
    exp = dict(seqs=seqs, attn=attn, amask=amask, old_logp=rnd() * 0.1 - 2.0, old_values=rnd(), adv=rnd(), returns=rnd())
    return {**{k: v.to(DEV) for k, v in exp.items()}, "seqs_cpu": seqs, "attn_cpu": attn}


def epoch(policy, critic, opt, exp: dict, order: torch.Tensor, mb: int, N: int, phases: dict | None = None, pack_tokens: int = 0) -> None:
    """One PPO epoch of ``policy`` and ``critic`` (either None: the other learner alone, as in a
    process of its own); with ``phases`` (a dict) each minibatch's forward, backward and optimizer
    step are timed apart (synchronising between them) and added into it."""

    @contextlib.contextmanager
    def lap(key: str):
        if phases is None:
            yield
            return
        sync()
        t = time.perf_counter()
        yield
        issued = time.perf_counter()  # the host is done; the device may still be working
        sync()
        done = time.perf_counter()
        phases[key] = phases.get(key, 0.0) + done - t
        phases[key + "_host"] = phases.get(key + "_host", 0.0) + issued - t

    for rows in order.split(mb):  # the policy's batch given on the CPU, as the stage's learner has it from Ray
        idx = rows.to(DEV, non_blocking=True)  # one copy a minibatch, not one a tensor (each a host sync)
        e = {k: v[idx] for k, v in exp.items() if not k.endswith("_cpu")}
        loss = 0.0
        with lap("forward_s"), torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
            if policy is not None:
                logp = action_logprobs(policy, exp["seqs_cpu"][rows], exp["attn_cpu"][rows], N, pack_tokens=pack_tokens, device=DEV,
                                      compiled=COMPILED_HEAD[0])
                loss = loss + ppo_clip_loss(logp, e["old_logp"], e["adv"], e["amask"]).loss
            if critic is not None:
                critic.pack_tokens = pack_tokens  # laid out on the CPU copy, as the stage's critic does (CriticWorker._inputs)
                values = critic(*critic.inputs(exp["seqs_cpu"][rows], exp["attn_cpu"][rows], N, DEV))
                loss = loss + value_loss(values, e["old_values"], e["returns"], e["amask"]).loss
        with lap("backward_s"):
            loss.backward()
        with lap("optimizer_s"):
            opt.step()
            opt.zero_grad(set_to_none=True)


def top_ops(fn, n: int = 15) -> dict:
    """``fn()`` once under torch.profiler: its wall time, the device kernels' time (total, its share
    of the wall, by kind; on CUDA) and the ``n`` ops with the most self time on the device (CUDA
    kernels on a GPU, CPU ops on CPU), with their share of the total."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    from torch.autograd import DeviceType

    attr = "self_device_time_total" if DEV == "cuda" else "self_cpu_time_total"
    # CPU rows and kernels; not a record_function span's device row (``is_kernel``: counted as a
    # kernel from 772d601 until 2026-12-08's fifteenth session, 24-33 ms of "other" at 0.4B)
    rows = [(e.key, getattr(e, attr), e.count, is_kernel(e)) for e in prof.key_averages()
            if is_kernel(e) or e.device_type == DeviceType.CPU]
    total = sum(t for _, t, _, _ in rows) or 1.0
    top = [{"op": k[:120], "ms": round(t / 1e3, 3), "calls": c, "share": round(t / total, 4), "kernel": kernel}
           for k, t, c, kernel in sorted(rows, key=lambda r: -r[1])[:n]]
    # the device's own events only: a CPU row (an aten:: op, Inductor's launcher of a triton_ kernel,
    # which bears the kernel's name) repeats the time of the kernels it launched. Until 2026-12-07's
    # fourteenth session a name filter let the launchers through and counted Inductor's kernels twice.
    kinds = {"gemm": ("gemm", "nvjet", "cutlass_80_tensorop", "sm90_xmma", "cublas"), "attention": ("fmha", "attention", "flash"),
             "optimizer": ("multi_tensor_apply",), "triton (fused elementwise)": ("triton_",), "copy / cast": ("copy", "memcpy", "memset")}
    by_kind = {k: 0.0 for k in [*kinds, "other"]}
    kernels = [(k, t) for k, t, _, kernel in rows if kernel and t > 0]
    for k, t in kernels:
        kind = next((kk for kk, keys in kinds.items() if any(x in k.lower() for x in keys)), "other")
        by_kind[kind] += t / 1e3
    busy = sum(by_kind.values())
    return {"wall_ms": round(wall * 1e3, 1), "kernel_ms": round(busy, 1), "kernel_share_of_wall": round(busy / (wall * 1e3), 3),
            "kernel_ms_by_kind": {k: round(v, 1) for k, v in by_kind.items()}, "top_ops": top}


def host_syncs(fn) -> list[dict]:
    """Where ``fn()`` makes the host wait for the GPU (CUDA): torch's sync debug mode warns at every
    synchronising op; each distinct call site (the innermost frames outside torch) with its count."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings.py" not in f.filename]
        site = " <- ".join(f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        sites[site] = sites.get(site, 0) + 1

    sync()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [{"site": k, "count": v} for k, v in sorted(sites.items(), key=lambda kv: -kv[1])]


def compiles(a) -> bool:
    """Whether ``--compile`` compiles the learners here: 'blocks' (the stage's) on CUDA only, the others everywhere."""
    return a.compile != "none" and (DEV == "cuda" or a.compile != "blocks")


def compile_as(model, how: str) -> None:
    """``--compile``: 'blocks' (the stage's ``compile_blocks``: each transformer block its own graph),
    'blocks-graphs' (the same with mode 'reduce-overhead': each block's forward and backward
    replayed as CUDA graphs, per input shape), 'body' (the decoder body, embeddings, masks,
    rotary and all blocks, as one graph; the LM head / value head eager), 'none'."""
    from tasks.common.model import transformer_blocks
    from tasks.ppo.group import compile_blocks

    if how == "blocks":
        compile_blocks(model)
    elif how == "blocks-graphs":
        compile_blocks(model, mode="reduce-overhead")
    elif how == "body":
        blocks = transformer_blocks(model)
        body = next(m for m in model.modules() if any(x is blocks[0] for x in getattr(m, "layers", ())))
        body.compile()
    elif how != "none":
        raise SystemExit(f"--compile {how!r}: one of blocks, blocks-graphs, body, none")


def work(cfg, exp: dict, order: torch.Tensor, mb: int, N: int, pack_tokens: int = 0, lora_actor: bool = False,
         lora_critic: bool = False, varlen: bool = True) -> dict:
    """Tokens and FLOPs of one epoch: real ones, and those the cut (or packed) minibatches compute
    (packed: a token attends over its own sequence, varlen, or over all C columns of its bin under
    the block-diagonal mask, whose kernels skip no block); a LoRA model's frozen base counts no
    weight gradients (``train_flops``)."""
    real_tokens = int(exp["attn"].sum())
    real_actions = int(exp["amask"].sum())
    useful = ppo_epoch_flops(cfg, real_tokens, len(exp["attn"]), real_actions, lora_actor, lora_critic)
    computed_tokens, computed = 0, 0.0
    for rows in order.split(mb):
        if pack_tokens:
            p = pack(exp["seqs_cpu"][rows], exp["attn_cpu"][rows], pack_tokens)
            R, C = p.input_ids.shape
            t, k = R * C, int(exp["amask"][rows].sum())
            span = t / (len(p.cu_seqlens) - 1) if varlen else C  # the mean sequence, or the bin
            computed_tokens += t
            computed += train_flops(cfg, t, span, k, cfg.vocab_size, lora_actor) + train_flops(cfg, t, span, t, 1, lora_critic)
            continue
        s = attended_span(exp["attn_cpu"][rows], N)
        t = len(rows) * (s.stop - s.start)
        computed_tokens += t
        computed += (train_flops(cfg, t, s.stop - s.start, len(rows) * (s.actions + 1), cfg.vocab_size, lora_actor)
                     + train_flops(cfg, t, s.stop - s.start, t, 1, lora_critic))
    return {"real_tokens": real_tokens, "computed_tokens": computed_tokens, "all_tokens": int(exp["attn"].numel()),
            "useful_flops": useful, "computed_flops": computed}


def learners(a, role: str) -> tuple:
    """(policy, critic, optimizer) of ``role`` 'policy', 'critic' or 'both' (the other None),
    compiled as ``--compile`` says, one fused AdamW over what they train (``--weights bf16``: bf16
    models, the AdamW over fp32 masters, ``MasterAdamW``)."""
    policy = critic = None
    bf16 = a.weights == "bf16"
    if role in ("policy", "both"):
        policy = build_policy(a.shape, DEV, torch.bfloat16 if a.lora_actor or bf16 else torch.float32, vocab=a.vocab)
        if a.lora_actor:
            from peft import LoraConfig, get_peft_model

            policy = get_peft_model(policy, LoraConfig(r=a.lora_actor, lora_alpha=32, target_modules="all-linear"), autocast_adapter_dtype=True)
    if role in ("critic", "both"):
        critic = _Values(lora_value_model(a.shape, DEV, a.lora_critic, seed=1, vocab=a.vocab) if a.lora_critic
                         else build_value_model(a.shape, DEV, torch.bfloat16 if bf16 else torch.float32, seed=1, vocab=a.vocab))
    models = [m for m in (policy, critic) if m is not None]
    if compiles(a):
        for m in models:
            compile_as(m.rm if m is critic else m, a.compile)
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    opt = (MasterAdamW(params, lr=1e-7, weight_decay=0.01, triton=DEV == "cuda" and a.master_step != "torch",
                       multi_tensor=a.master_step == "triton-mt") if bf16
           else torch.optim.AdamW(params, lr=1e-7, fused=DEV == "cuda"))
    return policy, critic, opt


def parse_variants(a, exp: dict) -> tuple[dict, dict]:
    """``--variants`` -> name -> (minibatch order, pack_tokens)."""
    orders = {"rollout_order": torch.arange(a.batch), "bucket_by_length": length_order(exp["attn_cpu"], a.new_tokens, a.minibatch)}
    variants = {}
    for v in a.variants.split(","):
        base = bare(v)
        if base in orders:
            variants[v] = (orders[base], 0)
        else:  # packedC, packedC_bucket, packedC-mask
            c, _, by = base.removeprefix("packed").removesuffix("-mask").partition("_")
            variants[v] = (orders["bucket_by_length" if by else "rollout_order"], int(c))
    return variants


SWITCHES = ("-tvarlen", "-eagerhead", "-mt")  # a variant name's suffixes that set a switch, not the workload (in this order)


def bare(name: str) -> str:
    """A variant's name without its switches' suffixes."""
    for suffix in reversed(SWITCHES):
        name = name.removesuffix(suffix)
    return name


def varlen_of(name: str) -> bool:
    """A variant's packed attention: by the sequences' lengths (tasks/ppo/varlen.py), or ``-mask``:
    transformers' block-diagonal mask (tasks/ppo/packing.py ``VARLEN`` off)."""
    return not bare(name).endswith("-mask")


COMPILED_HEAD = [False]  # the policy's log-prob head compiled (generation.action_head), as the stage's compiled actor has it


def use_variant(a, name: str, opt=None) -> None:
    """The process-wide switches of variant ``name`` for its epochs: packed attention (``varlen_of``),
    its GPU kernel (tasks/ppo/varlen.py ``KERNEL``: 'triton' where the name has ``-tvarlen``, else
    aten's flash), the log-prob head, compiled where the blocks are unless the name has ``-eagerhead``,
    and MasterAdamW's multi-tensor step where the name ends in ``-mt`` (or ``--master-step triton-mt``)."""
    packing.VARLEN = varlen_of(name)
    varlen.KERNEL = "triton" if "-tvarlen" in name else "flash"
    COMPILED_HEAD[0] = compiles(a) and "-eagerhead" not in name
    if isinstance(opt, MasterAdamW):
        opt.multi_tensor = a.master_step == "triton-mt" or name.endswith("-mt")


def time_variants(a, policy, critic, opt, exp: dict, variants: dict, barrier=None) -> dict:
    """Each variant: a warm-up epoch (compilation of its widths, optimizer state), then ``--reps``
    timed ones (``--interleave``: all warm-ups first, then the variants' epochs in turn, so a drift
    of the machine's speed falls on each alike) -> name -> {first_s, s_all, peak_gib}. ``barrier``:
    wait for the other learner's process before each epoch, so both start together."""
    out = {name: {"s_all": []} for name in variants}

    def one(name: str) -> float:
        order, pk = variants[name]
        use_variant(a, name, opt)
        t: dict = {}
        barrier and barrier.wait()
        with timed(t, "s"):
            epoch(policy, critic, opt, exp, order, a.minibatch, a.new_tokens, pack_tokens=pk)
        return t["s"]

    if a.interleave:
        for name in variants:
            out[name]["first_s"] = one(name)
        reset_peak()
        for _ in range(a.reps):
            for name in variants:
                out[name]["s_all"].append(one(name))
        return {name: {**v, "peak_gib": peak_gib()} for name, v in out.items()}  # the run's peak, all variants'
    for name in variants:
        out[name]["first_s"] = one(name)
        reset_peak()
        out[name]["s_all"] = [one(name) for _ in range(a.reps)]
        out[name]["peak_gib"] = peak_gib()
    return out


def _learner_process(role: str, a, barrier, queue) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    policy, critic, opt = learners(a, role)
    exp = ragged_batch(a.batch, a.prompt_len, a.new_tokens, a.vocab)  # the same seeded batch as the parent's
    queue.put((role, time_variants(a, policy, critic, opt, exp, parse_variants(a, exp), barrier),
               n_params(policy if critic is None else critic)))


def learners_apart(a) -> tuple[dict, int]:
    """(``time_variants``, the policy's parameters) with the policy and the critic each in a process of its own (spawned, one
    GPU shared), every epoch started together: an epoch's time is the slower learner's; peak
    memory the sum of both."""
    import queue as queue_module

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_learner_process, args=(r, a, barrier, queue)) for r in ("policy", "critic")]
    for p in procs:
        p.start()
    got, params = {}, {}
    while len(got) < 2:
        try:
            role, timing, params[role] = queue.get(timeout=30)
            got[role] = timing
        except queue_module.Empty:  # a learner that died would leave the other waiting at the barrier
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"--learners apart: a learner process failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join()
    pol, cri = got["policy"], got["critic"]
    return {name: {"first_s": max(pol[name]["first_s"], cri[name]["first_s"]),
                   "s_all": [max(x, y) for x, y in zip(pol[name]["s_all"], cri[name]["s_all"])],
                   "s_policy": pol[name]["s_all"], "s_critic": cri[name]["s_all"],
                   "peak_gib": pol[name]["peak_gib"] + cri[name]["peak_gib"]} for name in pol}, params["policy"]


def main() -> None:
    ap = workload_args(__doc__.splitlines()[0])
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=12, help="timed epochs after the first; their median is reported (a process keeps getting faster for up to ~5 epochs after the compile, bench/RESULTS.md 2026-12-07: fewer reps report the warm-up)")
    ap.add_argument("--interleave", action="store_true", help="the variants' timed epochs in turn (after every warm-up), "
                    "not one variant's all together: for variants of near speeds on a machine whose speed drifts")
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--weights", default="fp32", choices=["fp32", "bf16"], help="fp32: fp32 weights under bf16 autocast (the stage's "
                    "full-parameter learners); bf16: bf16 weights, fp32 masters in the optimizer (MasterAdamW)")
    ap.add_argument("--master-step", default="triton-mt", choices=["triton-mt", "triton", "torch"], help="--weights bf16 on CUDA: MasterAdamW's "
                    "step as its two multi-tensor launches (the default since 2026-12-08), as one Triton pass a parameter (multi_tensor=False), or torch ops (the gradients cast up, AdamW's single-tensor ops on the masters, "
                    "the masters copied back; until 2026-12-07's RESULTS, torch's fused AdamW on the masters)")
    ap.add_argument("--lora-actor", type=int, default=0, help="rank of a LoRA actor on a bf16 base (the stage's actor); 0: a full fp32-master policy")
    ap.add_argument("--lora-critic", type=int, default=0, help="rank of a LoRA critic on a frozen bf16 body (ppo.critic_lora_rank); 0: full fp32-master")
    ap.add_argument("--variants", default="rollout_order,bucket_by_length,packed256,packed512,packed1024,packed512_bucket",
                    help="rollout_order / bucket_by_length: unpacked, minibatches in rollout order / by length_order; "
                    "packedC: rows packed into bins of C columns (ppo.pack_tokens C), rollout order, varlen attention; packedC_bucket: by "
                    "length_order; packedC-mask: the bins' attention under transformers' block-diagonal mask (tasks/ppo/packing.py VARLEN off); "
                    "any of them -tvarlen: the varlen attention by tasks/ppo/varlen_kernel.py's Triton kernel, not aten's flash; "
                    "then -eagerhead: the policy's log-prob head eager (the stage compiles it with the blocks); "
                    "then -mt: MasterAdamW's multi-tensor step (--weights bf16)")
    ap.add_argument("--profile-variants", default="rollout_order,packed1024", help="with --profile: these variants too")
    ap.add_argument("--profile-top", type=int, default=15, help="with --profile: how many ops (by device self time) each profile lists")
    ap.add_argument("--compile", default="blocks", help="how the models are compiled (CUDA; elsewhere only when not 'blocks'): "
                    "blocks (the stage's), blocks-graphs, body, none (see compile_as)")
    ap.add_argument("--learners", default="together", choices=["together", "apart"],
                    help="together: policy and critic in this process, one after the other; apart: each in a process of its "
                    "own, started together each epoch (the stage's layout: actor and critic roles), an epoch's time the slower's")
    ap.add_argument("--sync-debug", action="store_true", help="then one epoch of each variant with torch's CUDA sync debug mode: "
                    "every place the host waits for the GPU, by call site")
    ap.add_argument("--profile", action="store_true", help="then one epoch of the fastest variant with its phases timed apart, and "
                    "it and --profile-variants under torch.profiler (kernel time by kind against the wall): where the time of an epoch goes")
    a = ap.parse_args()
    a.vocab = a.vocab or shape_vocab(a.shape)
    B, P, N, mb = a.batch, a.prompt_len, a.new_tokens, a.minibatch
    torch.backends.cuda.matmul.allow_tf32 = True
    res = {"machine": machine(), "command": " ".join(sys.argv), "shape": a.shape, "batch": B, "prompt_len": P,
           "new_tokens": N, "minibatch": mb, "compile": a.compile, "weights": a.weights, "master_step": a.master_step, "learners": a.learners, "vocab": a.vocab, "lora_actor": a.lora_actor, "lora_critic": a.lora_critic,
           "matmul_bf16_tflops_measured": matmul_tflops() if DEV == "cuda" else float("nan"),
           "peak_tflops_datasheet": H200_BF16_DENSE_TFLOPS, "variants": {}}
    if a.learners == "apart" and (a.profile or a.sync_debug):
        raise SystemExit("--profile / --sync-debug: with --learners together only")
    exp = ragged_batch(B, P, N, a.vocab)
    cfg = llama_config(a.shape, vocab=a.vocab)
    variants = parse_variants(a, exp)
    if a.learners == "apart":
        timing, res["params"] = learners_apart(a)
    else:
        policy, critic, opt = learners(a, "both")
        res["params"] = n_params(policy)
        timing = time_variants(a, policy, critic, opt, exp, variants)
    for name, (order, pk) in variants.items():
        ts, first_s = timing[name]["s_all"], timing[name]["first_s"]
        s = statistics.median(ts)
        w = work(cfg, exp, order, mb, N, pk, bool(a.lora_actor), bool(a.lora_critic), varlen_of(name))
        peak = H200_BF16_DENSE_TFLOPS * 1e12
        res["variants"][name] = {**w, **timing[name], "s": s,
                                 "useful_mfu": w["useful_flops"] / s / peak, "computed_mfu": w["computed_flops"] / s / peak,
                                 "real_tokens_per_s": w["real_tokens"] / s}
        v = res["variants"][name]
        print(f"{name}: {s * 1e3:.0f} ms/epoch (fastest {min(ts) * 1e3:.0f}; first {first_s:.1f} s), computed {w['computed_tokens']} of "
              f"{w['all_tokens']} token slots for {w['real_tokens']} real tokens; useful MFU {100 * v['useful_mfu']:.1f}%, "
              f"computed MFU {100 * v['computed_mfu']:.1f}%, {v['real_tokens_per_s']:.0f} real tokens/s", flush=True)
    if a.sync_debug and DEV == "cuda":
        res["host_syncs"] = {}
        for name, (order, pk) in variants.items():
            use_variant(a, name, opt)
            try:
                sites = res["host_syncs"][name] = host_syncs(lambda: epoch(policy, critic, opt, exp, order, mb, N, pack_tokens=pk))
            except Exception as e:  # a diagnosis: record why it could not run, keep the numbers above
                res["host_syncs"][name] = f"{type(e).__name__}: {e}"
                print(f"{name}: host syncs not found: {e}", flush=True)
                continue
            print(f"{name}: {sum(x['count'] for x in sites)} host syncs in one epoch", flush=True)
            for x in sites[:12]:
                print(f"  x{x['count']:<4} {x['site'][:300]}", flush=True)
    if a.profile:  # the fastest variant, already warm
        best = min(res["variants"], key=lambda k: res["variants"][k]["s"])
        order, pk = variants[best]
        use_variant(a, best, opt)
        phases: dict = {}
        epoch(policy, critic, opt, exp, order, mb, N, phases, pk)
        split = {k: round(v, 4) for k, v in phases.items()}
        res["profile"] = {"variant": best, "phases_s": split}
        print(f"phases of one {best} epoch (synchronised between them): {split}", flush=True)
        for name in dict.fromkeys([best, *a.profile_variants.split(",")]):
            if name in variants:
                order, pk = variants[name]
                use_variant(a, name, opt)
                prof = res["profile"][name] = top_ops(lambda: epoch(policy, critic, opt, exp, order, mb, N, pack_tokens=pk), a.profile_top)
                print(f"{name} under the profiler: {prof['wall_ms']} ms wall, {prof['kernel_ms']} ms of kernels "
                      f"({100 * prof['kernel_share_of_wall']:.0f}%): {prof['kernel_ms_by_kind']}", flush=True)
                for o in prof["top_ops"][:8]:
                    print(f"  {o['ms']:9.3f} ms {100 * o['share']:5.1f}% x{o['calls']:<5} {o['op']}", flush=True)
    first = next(iter(res["variants"]))
    r = res["variants"][first]
    for k, v in res["variants"].items():
        print(f"{k}: {r['s'] / v['s']:.2f}x {first}'s speed, {v['computed_tokens'] / r['computed_tokens']:.2f} of its tokens computed")
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
