"""Where the PPO stage's NaN comes from (issue 18): on the H200 the 0.3b stage run
(bench/ppo_stage_gpu.py) had value_loss nan from its first iteration; its CPU runs are finite.

    python3 bench/nan_probe.py --out $OUT/nan_probe.json            # on the GPU machine (bench/gpu_run.sh nan)
    python3 bench/nan_probe.py --shape tiny --device cpu --out /tmp/n.json   # smoke run of the script

The stage's own forwards on a rollout-like batch (left-padded prompts of mixed length, every row
stopped at EOS after ``--stop`` of ``--new-tokens`` tokens, so the attended-span cut removes
columns on both sides), under the stage's autocast (bf16 on CUDA): the full-parameter critic
(fp32 weights, ``tasks.ppo.roles._Values``) with its value-loss backward, and the LoRA actor
(bf16 base, fp32 adapter, ``action_logprobs``) with a log-prob backward. Each one eager and with
compiled blocks (``ppo.compile``), through the cut and over the whole batch; then compiled inside
DDP through the cut, as the learners run (a world of one). Reported per
variant: non-finite outputs at action positions, anywhere, and non-finite gradients.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import SHAPES, llama_config  # noqa: E402


def batch(B: int, P: int, N: int, stop: int, vocab: int, device: str):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, P // 3), P + 1, (B,), generator=g)
    prompt_attn = (torch.arange(P)[None] >= P - lengths[:, None]).long()
    resp_attn = (torch.arange(N)[None] < stop).long().expand(B, N)
    ids = torch.randint(4, vocab, (B, P + N), generator=g)
    attn = torch.cat([prompt_attn, resp_attn], 1)
    ids = ids.masked_fill(attn == 0, 0)
    return ids.to(device), attn.to(device), resp_attn.float().to(device)


def report(out: torch.Tensor, mask: torch.Tensor, params) -> dict:
    grads = [p.grad for p in params if p.grad is not None]
    return {"nonfinite_at_actions": int((~torch.isfinite(out.detach()) & mask.bool()).sum()),
            "nonfinite_anywhere": int((~torch.isfinite(out.detach())).sum()),
            "nonfinite_grad_tensors": sum(int(not torch.isfinite(g).all()) for g in grads), "grad_tensors": len(grads)}


def main() -> None:
    import argparse

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, LlamaModel

    from tasks.common.loop import autocast
    from tasks.ppo.generation import action_logprobs, logprobs_from_logits, position_ids_from_mask
    from tasks.ppo.group import compile_blocks
    from tasks.ppo.losses import masked_mean
    from tasks.ppo.roles import _Values
    from tasks.rm.model import RewardModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.4b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=11)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--stop", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev, N = a.device, a.new_tokens
    cfg = llama_config(a.shape, vocab=a.vocab)
    torch.manual_seed(0)
    critic = _Values(RewardModel(LlamaModel(cfg)).to(dev))  # full-parameter critic: fp32 weights
    base = LlamaForCausalLM(cfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    actor = get_peft_model(base, LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))
    for p in actor.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    actor.eval()
    ids, attn, mask = batch(a.batch, a.prompt_len, N, a.stop, a.vocab, dev)
    res: dict = {"device": dev, "torch": torch.__version__, "shape": a.shape, "batch": a.batch, "prompt_len": a.prompt_len,
                 "new_tokens": N, "stop": a.stop, "variants": {}}

    def critic_run(whole: bool, model):
        critic.zero_grad(set_to_none=True)
        with autocast(dev):
            v = critic.rm.values(ids, attn)[:, -N - 1:-1].float() if whole else model(ids, attn, N)
            masked_mean((v - 1.0) ** 2, mask).backward()
        return report(v, mask, critic.parameters())

    def actor_run(whole: bool, model):
        actor.zero_grad(set_to_none=True)
        with autocast(dev):
            if whole:
                logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn), use_cache=False).logits
                lp = logprobs_from_logits(logits[:, -N - 1:-1].float(), ids[:, -N:])
            else:
                lp = action_logprobs(model, ids, attn, N)
            masked_mean(lp, mask).backward()
        return report(lp, mask, actor.parameters())

    # the stage's learners are DDP-wrapped (a world of one per role): the last variants add that
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tasks.common.dist import free_port

    for how in ("eager", "compiled", "compiled ddp"):
        if how == "compiled":
            compile_blocks(critic.rm)
            compile_blocks(actor)
        models = {"critic": critic, "actor": actor}
        if how == "compiled ddp":
            dist.init_process_group("nccl" if dev == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            models = {r: DDP(m, device_ids=[0] if dev == "cuda" else None) for r, m in models.items()}
        for whole in (False,) if how == "compiled ddp" else (False, True):  # in DDP the learners' path only (the cut)
            for role, run in (("critic", critic_run), ("actor", actor_run)):
                name = f"{role} {how} {'whole batch' if whole else 'cut'}"
                try:
                    res["variants"][name] = run(whole, models[role])
                except Exception as e:  # one variant's failure must not hide the others
                    res["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{name:32s} {res['variants'][name]}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
