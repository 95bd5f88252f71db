"""Where FastGenerator's decode step goes, part by part, and the variants that could cut it (issue 18).

    python3 bench/decode_parts.py --shape 0.4b --batch 64 --prompt-len 128 --new-tokens 128 --out decode_parts.json
    python3 bench/decode_parts.py --shape tiny --batch 4 --prompt-len 8 --new-tokens 8   # CPU: a smoke run

One bf16 random-weight Llama of ``--shape``, one process, side by side:

- **GEMMs**: each of a layer's four matmuls (packed q/k/v, o, packed gate/up, down) and the LM
  head at M = batch, as cuBLAS runs them (``F.linear``), as Inductor's max-autotune picks
  (its Triton templates against cuBLAS) and as tasks/ppo/decode_linear.py's kernel runs them over
  its launch settings, each timed inside a CUDA graph of back-to-back calls,
  one per layer on its own weight (the decode graph's situation): us per call and the weight
  bytes read per second.
- **Attention**: the split-K Triton kernel (tasks/ppo/decode_attention.py) over launch settings
  (columns per tile, warps, pipeline stages, column splits) and SDPA,
  at mid-rollout (the prompt and half the response visible): us per call against the visible
  K/V bytes.
- **Whole steps** (``--steps``): FastGenerator's graph-replayed decode step for the decode
  attention, compile and launch variants (``best``: the attention sweep's fastest), against the
  step's memory floor, and the kernels of one step of each (profiler) at mid-rollout, as the
  graph replays them and eagerly.

Numbers go to ``--out`` (JSON) and the log.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import build_policy, copy_gbps, machine, profile_top, shape_vocab, sync, workload_args, write_json  # noqa: E402
from tasks.ppo.fast_generate import GREEDY, FastGenerator  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAD = 0


def per_call_us(fn, calls: int = 24, reps: int = 20) -> float:
    """us per ``fn()``: on CUDA ``calls`` back-to-back calls captured in one graph, replayed ``reps``
    times (no launch gaps from the host, as in the decode graph); on CPU plain calls."""
    fn()
    sync()
    if DEV != "cuda":
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    sync()
    return start.elapsed_time(end) / (reps * calls) * 1e3


def triton_gemms(r: dict, x, ws, turn) -> None:
    """tasks/ppo/decode_linear.py's split-K kernel on the same calls: its own choice of (block_n,
    splits) with and without the sum over the splits (a separate kernel here; in the compiled
    layer Inductor folds it into the next one), then a sweep of block_n x splits x BLOCK_K x
    stages, the partials alone, each with its largest error against F.linear."""
    import tasks.ppo.decode_linear as dl

    want = F.linear(x, ws[0]).float()
    r["triton_choice"] = list(dl.choose(ws[0].shape[0], ws[0].shape[1], torch.cuda.get_device_properties(0).multi_processor_count))
    r["triton_auto_us"] = per_call_us(lambda: dl.decode_linear_partials(x, next(turn)), calls=len(ws))
    r["triton_auto_sum_us"] = per_call_us(lambda: dl.decode_linear_partials(x, next(turn)).sum(0).to(x.dtype), calls=len(ws))
    sweep = {}
    for block_n, splits, block_k, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (64, 128), (3, 4)):
        if -(-x.shape[1] // splits) < block_k:
            continue
        key = f"n{block_n}_s{splits}_k{block_k}_st{stages}"
        try:
            with launch(dict(CONFIG=(block_n, splits), BLOCK_K=block_k, NUM_STAGES=stages), "decode_linear"):
                err = (dl.decode_linear_partials(x, ws[0]).sum(0) - want).abs().max().item()
                sweep[key] = {"us": per_call_us(lambda: dl.decode_linear_partials(x, next(turn)), calls=len(ws)), "max_abs_err": err,
                              "settings": [block_n, splits, block_k, stages]}
        except Exception as e:  # a setting that does not compile (shared memory, registers): recorded
            sweep[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    best = min((k_ for k_ in sweep if "us" in sweep[k_]), key=lambda k_: sweep[k_]["us"])
    r["triton_sweep"], r["triton_best"], r["triton_best_us"] = sweep, best, sweep[best]["us"]
    TUNED_LINEAR[(ws[0].shape[0], ws[0].shape[1])] = tuple(sweep[best]["settings"])


def gemms(cfg, B: int, autotune: bool) -> dict:
    """Each matmul of a layer at M = B, one call per layer on that layer's own weight (as the decode
    step reads them; one weight read in a row stays in the L2 and times faster: the numbers of
    2026-12-05 were taken that way)."""
    d, hd, layers = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * hd
    shapes = {"qkv": (d, d + 2 * kv), "o": (d, d), "gate_up": (d, 2 * cfg.intermediate_size),
              "down": (cfg.intermediate_size, d), "lm_head": (d, cfg.vocab_size)}
    out = {}
    for name, (k, n) in shapes.items():
        x = torch.randn(B, k, device=DEV, dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(1 if name == "lm_head" else layers)]
        w, turn = ws[0], itertools.cycle(ws)
        r = out[name] = {"k": k, "n": n, "weight_mb": w.numel() * 2 / 1e6, "weights": len(ws)}
        r["cublas_us"] = per_call_us(lambda: F.linear(x, next(turn)), calls=len(ws))
        if autotune and DEV == "cuda":
            f = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            r["max_autotune_us"] = per_call_us(lambda: f(x, next(turn)), calls=len(ws))
        if DEV == "cuda":
            triton_gemms(r, x, ws, turn)
        for k_ in [k_ for k_ in r if k_.endswith("_us")]:
            r[k_.replace("_us", "_weight_gbps")] = w.numel() * 2 / r[k_] / 1e3
        print(f"gemm {name:8s} {k}x{n}: " + ", ".join(f"{k_} {v:.1f}" for k_, v in r.items() if k_.endswith(("_us", "_gbps")))
              + (f", best {r['triton_best']}, choice {r['triton_choice']}" if "triton_best" in r else ""), flush=True)
    return out


def variant_name(settings: dict) -> str:
    return "block{BLOCK_N}_warps{NUM_WARPS}_stages{NUM_STAGES}_persm{PROGRAMS_PER_SM}".format(**settings)


@contextlib.contextmanager
def launch(settings: dict, kernel: str = "decode_attention"):
    """A Triton kernel's launch settings (tasks/ppo/``kernel``.py's module constants, read at call
    time) set for the block, restored after it."""
    import importlib

    mod = importlib.import_module(f"tasks.ppo.{kernel}")
    saved = {k: getattr(mod, k) for k in settings}
    for k, v in settings.items():
        setattr(mod, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(mod, k, v)


def attention_sweep(cfg, B: int, L: int, visible: int) -> dict:
    """The kernel over launch settings, one call per layer on that layer's own cache (as the decode
    step reads them: 24 caches of 67 MB at 0.4b, more than the L2 holds; one cache read 24 times
    in a row would be timed partly from the L2)."""
    import tasks.ppo.decode_attention as da

    n_kv, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g, layers = cfg.num_attention_heads // n_kv, cfg.num_hidden_layers
    q = torch.randn(B, n_kv, g, hd, device=DEV, dtype=torch.bfloat16)
    caches = [[torch.randn(B, n_kv, L, hd, device=DEV, dtype=torch.bfloat16) for _ in range(2)] for _ in range(layers)]
    kc, vc = caches[0]
    bias = torch.full((B, 1, 1, L), torch.finfo(torch.bfloat16).min, device=DEV, dtype=torch.bfloat16)
    bias[..., :visible] = 0
    bytes_visible = 2 * B * n_kv * visible * hd * 2
    out = {"visible_columns": visible, "columns": L, "visible_kv_mb": bytes_visible / 1e6, "caches": layers}
    turn = iter(itertools.cycle(caches))
    every = lambda f: lambda: f(*next(turn))  # noqa: E731  (each call on the next layer's cache)
    want = F.scaled_dot_product_attention(q, kc, vc, attn_mask=bias, scale=hd ** -0.5)
    out["sdpa_us"] = per_call_us(every(lambda k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=hd ** -0.5)), calls=layers)
    default = dict(BLOCK_N=da.tile_columns(hd, 2), NUM_WARPS=da.NUM_WARPS, NUM_STAGES=da.NUM_STAGES, PROGRAMS_PER_SM=da.PROGRAMS_PER_SM)
    grid = [dict(default, BLOCK_N=blk, NUM_WARPS=w, NUM_STAGES=st, PROGRAMS_PER_SM=per_sm)
            for blk, w, st, per_sm in itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 2, 3), (4, 8, 16))]  # per_sm > 4: column splits
    rows = []
    for settings in grid:
        key = variant_name(settings)
        try:
            with launch(settings):
                got = da.decode_attention(q, kc, vc, bias, hd ** -0.5)
                err = (got.float() - want.float()).abs().max().item()
                us = per_call_us(every(lambda k, v: da.decode_attention(q, k, v, bias, hd ** -0.5)), calls=layers)
            rows.append({"variant": key, "us": us, "gbps_visible": bytes_visible / us / 1e3, "max_abs_err_vs_sdpa": err})
        except Exception as e:  # a launch setting that does not compile (shared memory, registers): recorded
            rows.append({"variant": key, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    out["triton"] = ok + [r for r in rows if "us" not in r]
    out["triton_default_us"] = next((r["us"] for r in ok if r["variant"] == variant_name(default)), None)
    best = next(s_ for s_ in grid if ok and variant_name(s_) == ok[0]["variant"])
    BEST_ATTENTION.update(best)
    out["best_settings"] = best
    print(f"attention B={B} {visible}/{L} columns visible ({bytes_visible / 1e6:.1f} MB of K/V): sdpa {out['sdpa_us']:.1f} us, "
          f"triton default {out['triton_default_us']} us; best:", flush=True)
    for r in ok[:6]:
        print(f"    {r['variant']:40s} {r['us']:7.1f} us {r['gbps_visible']:7.0f} GB/s err {r['max_abs_err_vs_sdpa']:.2e}", flush=True)
    return out


OPTIONS = {"warps": "NUM_WARPS", "stages": "NUM_STAGES", "block": "BLOCK_N", "persm": "PROGRAMS_PER_SM", "apre": "PREFETCH_TILES"}
BEST_ATTENTION: dict = {}  # set by attention_sweep (the 'best' step option); empty: the defaults
FIRST_GREEDY: dict = {}  # the first step variant's greedy response tokens, for the others to be compared with
TUNED_LINEAR: dict = {}  # (n, k) -> the gemm sweep's fastest (block_n, splits, block_k, stages) (the 'tuned' step option)


def step_variant(model, name: str, prompts, attn, a, gbps: float) -> dict:
    """One FastGenerator variant ('triton+whole+warps2', ...): setup and rollouts (bench/ppo_iteration.py's
    ``time_fast``), the graph-replayed step against the floor, the kernels of one eager step."""
    from bench.ppo_iteration import decode_step_numbers, rollout_kw, time_fast

    attention, *opts = name.split("+")
    settings = dict(BEST_ATTENTION) if "best" in opts else {}  # the attention sweep's fastest launch settings
    settings.update({OPTIONS[o.rstrip("0123456789")]: int(o.lstrip("abcdefghijklmnopqrstuvwxyz")) for o in opts
                     if o.rstrip("0123456789") in OPTIONS})  # e.g. warps8, stages3, block32, persm8
    torch._dynamo.reset()  # the launch settings are module constants: no compiled code of another variant
    B, N = prompts.shape[0], a.new_tokens
    kw = rollout_kw(N)
    a.reps, a.copy_gbps, a.profile = 3, gbps, False
    pdl = torch._inductor.config.patch({"triton.enable_pdl": "pdl" in opts})  # Inductor's kernels launched with PDL
    linear = "triton" if "tlinear" in opts or "tuned" in opts else "cublas"  # tasks/ppo/decode_linear.py's split-K GEMMs
    tuned = launch(dict(TUNED=dict(TUNED_LINEAR) if "tuned" in opts else {}), "decode_linear")  # each shape at its sweep's best
    # nopdl: the split-K linears launched plainly (FastGenerator launches them as programmatic
    # dependents, prefetching their weight slices into the L2, where it can)
    flags = launch(dict(LINEAR_PDL="nopdl" not in opts, ATTENTION_ROPE="norope" not in opts, ATTENTION_PDL="noapdl" not in opts,
                        COMPILED_ENDS="eagerends" not in opts), "fast_generate")  # norope: RoPE and the K/V cache writes in kernels of
    # their own, not in the Triton attention's; noapdl: that attention kernel launched plainly beside the PDL linears
    with launch(settings), pdl, tuned, flags:
        fg, r = time_fast(model, prompts, attn, kw, a, attention=attention,
                          compile_scope="forward" if "whole" in opts else "layer",
                          compile_mode="max-autotune-no-cudagraphs" if "autotune" in opts and DEV == "cuda" else None,
                          linear=linear)
        try:
            # greedy tokens against the first variant's (the same kernels in another launch order
            # must give the same tokens; a read before its producer finished would not)
            tokens = fg.generate(prompts, attn, **dict(kw, greedy=True)).sequences[:, prompts.shape[1]:]
            first = FIRST_GREEDY.setdefault("tokens", tokens)
            r["greedy_tokens_as_first_variant"] = (tokens == first).float().mean().item()
            r["greedy_first_token_as_first_variant"] = (tokens[:, 0] == first[:, 0]).float().mean().item()
            if DEV == "cuda":
                r["decode_step"] = decode_step_numbers(fg, prompts, attn, kw, a)
                key = next(iter(fg._graphs))
                fg._reset(B, attn, PAD)
                for _ in range(N // 2):  # mid-rollout: half the response columns visible
                    fg._graphs[key].replay()
                # the kernels as the graph runs them (their sum against the replay's wall: the gaps)
                r["graph_step_kernels_mid_rollout"] = profile_top(fg._graphs[key].replay, 4, a.profile_rows)
                r["eager_step_kernels_mid_rollout"] = profile_top(lambda: fg._decode(B, GREEDY), 4, a.profile_rows)
            return r
        finally:
            del fg
            if DEV == "cuda":
                torch.cuda.empty_cache()


def main() -> None:
    # Inductor's on-disk caches served a step variant the compiled layer of the previous one, with
    # that one's attention launch settings (seen 2026-12-06: set up in 0.4 s, the same kernel
    # times): every variant here compiles afresh
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    ap = workload_args(__doc__.splitlines()[0])
    ap.add_argument("--parts", default="gemm,attention,steps", help="which of gemm, attention, steps to run")
    ap.add_argument("--no-autotune", action="store_true", help="skip Inductor's max-autotune GEMMs")
    ap.add_argument("--steps", default="sdpa,triton,triton+autotune,triton+whole,triton+whole+autotune",
                    help="whole-step variants: an attention ('sdpa', 'triton') then +options: autotune (compile_mode "
                    "max-autotune-no-cudagraphs), whole (compile_scope 'forward'), pdl (Inductor's kernels with programmatic dependent launch), nopdl (the split-K linears launched plainly, not as programmatic dependents), norope (RoPE and the cache writes in kernels of their own, not in the Triton attention's), noapdl (that kernel launched plainly, not as a programmatic dependent beside the PDL linears), eagerends (the step's parts outside the layers eager, as before 2026-12-07), tlinear (the split-K Triton linears), tuned (them at the gemm part's fastest settings per shape), warpsN, stagesN, blockN, persmN, apreN (the PDL RoPE attention's first N tiles prefetched into the L2 before it waits) "
                    "(attention launch settings)")
    ap.add_argument("--profile-rows", type=int, default=24)
    a = ap.parse_args()
    B, P, N = a.batch, a.prompt_len, a.new_tokens
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_policy(a.shape, DEV, torch.bfloat16, vocab=shape_vocab(a.shape)).eval()
    cfg = model.config
    gbps = copy_gbps() if DEV == "cuda" else float("nan")
    parts = a.parts.split(",")
    res = {"machine": machine(), "command": " ".join(sys.argv), "shape": a.shape, "vocab": cfg.vocab_size, "batch": B,
           "prompt_len": P, "new_tokens": N, "copy_gbps_measured": gbps}
    save = lambda: a.out and write_json(a.out, res)  # noqa: E731  (after every part: a later one may not finish)
    if "gemm" in parts:
        res["gemm"] = gemms(cfg, B, not a.no_autotune)
        save()
    if "attention" in parts and DEV == "cuda":
        res["attention"] = attention_sweep(cfg, B, -(-(P + N) // 8) * 8, P + N // 2)
        save()
    if "steps" in parts:
        g = torch.Generator(device=DEV).manual_seed(0)
        prompts = torch.randint(4, cfg.vocab_size, (B, P), device=DEV, generator=g)
        attn = torch.ones_like(prompts)
        res["steps"] = {}
        for name in a.steps.split(","):
            try:
                r = res["steps"][name] = step_variant(model, name, prompts, attn, a, gbps)
            except Exception as e:  # a variant that fails to compile or capture: recorded, the others still run
                res["steps"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                print(f"step {name}: {res['steps'][name]['error']}", flush=True)
                save()
                continue
            d = r.get("decode_step", {})
            print(f"step {name}: {r['new_tokens_per_s']:.0f} new tok/s, setup {r['setup_compile_capture_s']:.1f} s, "
                  f"greedy tokens as the first variant's {r['greedy_tokens_as_first_variant']:.3f}"
                  + (f", decode step {d['graph_replay_ms']:.3f} ms (floor {d['floor_ms_at_measured_copy_bw']:.3f}: "
                     f"{100 * d['floor_ms_at_measured_copy_bw'] / d['graph_replay_ms']:.0f}%)" if d else ""), flush=True)
            for part in ("graph_step_kernels_mid_rollout", "eager_step_kernels_mid_rollout"):
                print(f"  {part}:", flush=True)
                for row in r.get(part, []):
                    print("   ", row, flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
