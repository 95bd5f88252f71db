"""ColossalAI's strategies step by step, one process, before the flow runs them (issue 19).

    python3 bench/colossalai_probe.py --out $OUT/probe.json [--device cuda] [--strategies colossalai_zero2 colossalai_gemini]

Each step is timed and its exception kept, so one device call tells which part fails: the import
closure (preflight's check), ``colossalai.launch_from_torch``, then per strategy ``wrap_learner``
(HybridAdam builds its CPU-Adam and fused-Adam CUDA kernels with ninja + nvcc at first use), three
optimizer steps through ``optimizer.backward`` on a small Llama with a LoRA adapter (bf16 base,
fp32 LoRA, as in PPO), whether the LoRA weights moved, ``full_state`` (what PPO checkpoints), and a
greedy rollout through the inference model. ``--strategies ddp --device cpu`` runs the same steps
on CPU for the script itself (ColossalAI's own strategies need CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback


def step(results: dict, name: str, fn):
    t = time.perf_counter()
    try:
        value = fn()
        plain = isinstance(value, (int, float, str, list)) or (isinstance(value, dict) and name == "import_closure")
        results[name] = {"ok": True, "s": round(time.perf_counter() - t, 2), **({"value": value} if plain else {})}
        return value
    except Exception as e:
        results[name] = {"ok": False, "s": round(time.perf_counter() - t, 2), "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-3000:]}
        print(f"probe: {name} FAILED: {type(e).__name__}: {e}", flush=True)
        return None


def _tensors(x):
    """Every tensor in a nested state dict, in a fixed order."""
    if hasattr(x, "is_floating_point"):
        yield x
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _tensors(x[k])
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def full_llama(device: str):
    """A full-parameter Llama of 51M parameters, as the critic is trained: past Gemini's smallest
    chunk (32 Mi elements), so its chunks are sharded, not kept whole as a LoRA adapter's are."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(device, torch.bfloat16 if device == "cuda" else torch.float32).eval()


def small_lora_llama(device: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    base = LlamaForCausalLM(cfg).to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model.eval()


def probe_strategy(strategy: str, device: str, build=small_lora_llama) -> dict:
    import torch

    from tasks.ppo.generation import generate
    from tasks.ppo.group import full_state, load_full_state, prime_cpu_adam, wrap_learner

    r: dict = {}
    model = step(r, "build", lambda: build(device))
    if model is None:
        return r
    lora0 = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    got = step(r, "wrap_learner", lambda: wrap_learner(model, 1e-3, strategy, device, 1.0))
    if got is None:
        return r
    wrapped, optim, infer = got
    ids = torch.randint(1, 512, (4, 32), generator=torch.Generator().manual_seed(1)).to(device)

    def one_step() -> float:
        loss = wrapped(input_ids=ids, labels=ids).loss
        if strategy.startswith("colossalai"):
            optim.backward(loss)
            prime_cpu_adam(optim)  # as the learners' step does
        else:
            loss.backward()
        optim.step()
        optim.zero_grad()
        return round(loss.item(), 4)

    step(r, "train_3_steps", lambda: [one_step() for _ in range(3)])
    state = step(r, "full_state", lambda: full_state(wrapped, optim, strategy))
    if state is not None:
        weights, optim_state = state
        r["full_state"]["value"] = {"weights": len(weights), "optim_keys": sorted((optim_state or {}).keys())[:4]}
        named = {n.removeprefix("module."): v for n, v in weights.items()}
        moved = [n for n, v in named.items() if n in lora0 and not torch.equal(v.float().cpu(), lora0[n])]
        r["lora_moved"] = {"ok": bool(moved), "value": f"{len(moved)}/{len(weights)} trainable tensors differ from the start"}

        def resume() -> str:
            """One step from the saved state, then the state loaded back and the same step again: equal (exact resume).
            The saved fp32 weights must hold values bf16 cannot (not the working copy, nor masters rounded on the way out)."""
            fp32 = [v for v in weights.values() if v.dtype == torch.float32]
            coarse = [v for v in fp32 if torch.equal(v, v.bfloat16().float())]
            if not fp32 or len(coarse) == len(fp32):
                raise AssertionError(f"all {len(fp32)} fp32 weights saved are bf16 values: the masters were rounded")
            one_step()
            after = full_state(wrapped, optim, strategy)
            load_full_state(wrapped, weights, optim, optim_state, strategy)
            one_step()
            again = full_state(wrapped, optim, strategy)
            differ = [n for n in after[0] if not torch.equal(after[0][n], again[0][n])]
            states = [t for t in _tensors(after[1]) if t.is_floating_point()]
            differ += [f"optimizer tensor {i}" for i, (x, y) in enumerate(zip(states, (t for t in _tensors(again[1]) if t.is_floating_point())))
                       if not torch.equal(x, y)]
            if differ:
                raise AssertionError(f"{len(differ)} tensors differ after load + the same step: {differ[:4]}")
            return f"{len(after[0])} weights and {len(states)} optimizer tensors equal after load + the same step"

        step(r, "resume_exact", resume)
    step(r, "greedy_rollout", lambda: generate(infer, ids[:, :8], torch.ones_like(ids[:, :8]), max_new_tokens=8,
                                               eos_token_id=-1, pad_token_id=0, greedy=True).sequences.shape[1])
    if device == "cuda":
        r["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--strategies", nargs="+", default=["colossalai_zero2", "colossalai_gemini"])
    ap.add_argument("--full", action="store_true", help="each strategy also on a full-parameter model (the critic's case)")
    a = ap.parse_args()
    import torch

    from tasks.common.dist import free_port
    from tasks.ppo.group import colossalai_imports, import_failure

    res: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": a.device}
    if any(s.startswith("colossalai") for s in a.strategies):
        step(res, "import_closure", lambda: import_failure(colossalai_imports()))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
        import colossalai

        step(res, "launch_from_torch", lambda: colossalai.launch_from_torch(seed=0) and None)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo" if a.device == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    for s in a.strategies:
        print(f"probe: {s}", flush=True)
        res[s] = probe_strategy(s, a.device)
        if a.full:
            print(f"probe: {s} full-parameter", flush=True)
            res[s + "_full"] = probe_strategy(s, a.device, full_llama)
        for key in [s] + [s + "_full"] * a.full:
            print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "traceback"} if isinstance(v, dict) else v
                              for k, v in res[key].items()}), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
