"""A random-weight model of a real size, saved as a local model, plus data and a config for the flow.

    python bench/gpu_shapes.py --shape 8b --out /tmp/shape-8b     # then: rlhf run --config /tmp/shape-8b/rlhf.yaml
    python bench/gpu_shapes.py --shape 1.5b --out /tmp/shape-1.5b
    python bench/gpu_shapes.py --shape 0.3b --out /tmp/shape-0.3b --prompt-tokens 64 --new-tokens 64
    python bench/gpu_shapes.py --shape tiny --out /tmp/shape-tiny # a CPU check of the script itself

Shapes: ``8b`` is Llama-3-8B's (d 4096, 32 layers, 32 heads, GQA 8 KV heads, MLP 14336, vocab
128256), ``1.5b`` Qwen2-1.5B's as a Llama (d 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960,
vocab 151936), ``0.3b`` bench/ppo_stage_gpu.py's random Llama (d 1024, 24 layers, MLP 2816, the
built-in 512-token vocabulary; full-parameter RM and critic, as the stage bench runs it). The tokenizer is the built-in one (ids < 512): the model's vocabulary rows beyond
it are never produced by the data but cost what they cost in the LM head and the logits. The data
are the built-in task's records with a long preamble, so prompts are ~``--prompt-tokens`` tokens;
PPO generates ``--new-tokens``. The config writes what a 1-GPU run of this size needs (LoRA RM, a
LoRA critic serving the reward model, gradient checkpointing) and leaves every GPU request unset,
so the flow's own placement is what runs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0),
    # bench/ppo_stage_gpu.py's 0.3b: bench/common.py's 0.4b body with the built-in 512-token vocabulary
    "0.3b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=512),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
}


def save_model(shape: str, out: Path, max_len: int) -> int:
    """Random bf16 weights (std 0.02), built on the GPU when there is one; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.common.builtin import builtin_dir
    from tasks.common.model import ModelConfig, load_tokenizer

    tok = load_tokenizer(ModelConfig())
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(2048, max_len), pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in builtin_dir().iterdir():  # the tokenizer files (and nothing of the built-in model's weights)
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return sum(p.numel() for p in model.parameters())


def write_data(out: Path, prompt_tokens: int, seed: int = 0) -> dict[str, str]:
    """The built-in task's records with a preamble of task sentences, ~``prompt_tokens`` in all."""
    from tasks.common.builtin import generate_task, make_prompt, make_response
    from tasks.common.model import ModelConfig, load_tokenizer

    tok, rng, task = load_tokenizer(ModelConfig()), random.Random(seed), generate_task(seed)
    per_sentence = len(tok(make_response(rng, "river", 1) + " ", add_special_tokens=False)["input_ids"])

    def preamble() -> str:
        text = [make_response(rng, make_prompt(rng)[0], rng.randint(0, 3)) for _ in range(-(-max(0, prompt_tokens - 10) // per_sentence))]
        return " ".join(text) + " " if text else ""

    paths = {}
    for name, records in (("sft", [{"prompt": preamble() + r["prompt"], "response": r["response"]} for r in task["sft"]]),
                          ("preference", [{**r, "prompt": preamble() + r["prompt"]} for r in task["preference"]]),
                          ("prompts", [{"prompt": preamble() + r["prompt"]} for r in task["prompts"]])):
        p = out / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths[name] = str(p)
    return paths


def write_config(out: Path, shape: str, data: dict[str, str], prompt_tokens: int, new_tokens: int, batch: int) -> Path:
    import yaml

    cfg = {
        "model": {"pretrain": str(out)},
        "store": {"uri": f"file://{out}/artifacts"},
        "data": {"sft_path": data["sft"], "preference_path": data["preference"], "prompts_path": data["prompts"],
                 "max_length": prompt_tokens + new_tokens, "max_prompt_length": prompt_tokens},
        "sft": {"lora_rank": 16, "lr": 2e-4, "batch_size": 8, "max_steps": 20, "eval_every": 20},
        "rm": {"lora_rank": 16, "lr": 2e-4, "batch_size": 4, "max_steps": 20, "eval_every": 20},
        "ppo": {"rollout_batch_size": batch, "train_batch_size": 16, "max_new_tokens": new_tokens, "num_iterations": 8,
                "eval_every": 8, "eval_prompts": 16, "checkpoint_every": 4, "critic_lora_rank": 16, "critic_lr": 1e-4,
                "actor_lr": 1e-5, "ppo_epochs": 1},
    }
    if shape in ("0.3b", "tiny"):  # small enough for the defaults' full-parameter RM and critic
        del cfg["rm"]["lora_rank"], cfg["ppo"]["critic_lora_rank"]
        cfg["rm"]["lr"] = 5e-5
        cfg["ppo"].update(critic_lr=1e-5, actor_lr=5e-5, num_iterations=16, eval_every=8, checkpoint_every=8)
    p = out / "rlhf.yaml"
    p.write_text(f"# bench/gpu_shapes.py --shape {shape}: a 1-GPU run of this size through the flow\n" + yaml.safe_dump(cfg, sort_keys=False))
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n = save_model(args.shape, out, args.prompt_tokens + args.new_tokens)
    data = write_data(out, args.prompt_tokens)
    cfg = write_config(out, args.shape, data, args.prompt_tokens, args.new_tokens, args.batch)
    print(f"{args.shape}: {n / 1e9:.2f}B parameters at {out}; run: rlhf run --config {cfg}")


if __name__ == "__main__":
    main()
