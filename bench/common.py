"""Shared pieces of the benchmarks: random-weight Llama shapes, FLOP counts, timers, peaks.

Weights are random (throughput does not depend on them); the shapes are Llama-style so that the
numbers carry over to real checkpoints of the same size.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from contextlib import contextmanager

import torch

from tasks.common.model import no_cudnn_attention

# name -> LlamaConfig kwargs. "0.4b" is the 374M shape.
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    "0.4b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=16),
    # Qwen2-1.5B's body as a Llama (bench/gpu_shapes.py's 1.5b, with this file's vocabulary)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    # Llama-3-8B's body (bench/gpu_shapes.py's 8b); its 128k vocabulary is the default of ``shape_vocab``
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
}
VOCAB = 32000
SHAPE_VOCAB = {"8b": 128256}  # a shape's own vocabulary where it is not VOCAB


def shape_vocab(shape: str) -> int:
    return SHAPE_VOCAB.get(shape, VOCAB)
H200_BF16_DENSE_TFLOPS = 989.0  # datasheet, dense (no sparsity)


def workload_args(description: str):
    """An ArgumentParser with the workload both sides of a comparison must share: the model
    shape, the batch and the lengths (bench/ppo_iteration.py and bench/trl_ppo.py)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shape", default="0.4b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="results JSON")
    return ap


def llama_config(shape: str, max_len: int = 512, vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, tie_word_embeddings=False, attn_implementation="sdpa", **SHAPES[shape])


def build_policy(shape: str, device: str, dtype=torch.float32, seed: int = 0, vocab: int = VOCAB):
    from transformers import LlamaForCausalLM

    no_cudnn_attention(device)  # as the stages run
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(llama_config(shape, vocab=vocab)).to(dtype)


def build_scalar_model(shape: str, device: str, dtype=torch.float32, seed: int = 1):
    """Value / reward model: the same backbone with a 1-output head (HF's sequence classifier)."""
    from transformers import LlamaForSequenceClassification

    no_cudnn_attention(device)  # as the stages run
    torch.manual_seed(seed)
    cfg = llama_config(shape)
    cfg.num_labels = 1
    with torch.device(device):
        return LlamaForSequenceClassification(cfg).to(dtype)


def build_value_model(shape: str, device: str, dtype=torch.float32, seed: int = 1, vocab: int = VOCAB):
    """Critic / reward model as the PPO stage builds them: tasks.rm.model.RewardModel over the body."""
    from transformers import LlamaModel

    from tasks.rm.model import RewardModel

    no_cudnn_attention(device)  # as the stages run
    torch.manual_seed(seed)
    with torch.device(device):
        return RewardModel(LlamaModel(llama_config(shape, vocab=vocab))).to(dtype)


def lora_value_model(shape: str, device: str, rank: int, seed: int = 1, vocab: int = VOCAB):
    """The critic of ``ppo.critic_lora_rank`` (tasks/ppo/roles.py CriticWorker): a frozen bf16 body
    under a LoRA adapter on every linear layer, fp32 adapter, trainable fp32 value head."""
    from peft import LoraConfig, get_peft_model

    rm = build_value_model(shape, device, seed=seed, vocab=vocab).requires_grad_(False)
    rm.body.to(torch.bfloat16)
    rm.body = get_peft_model(rm.body, LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear", task_type="FEATURE_EXTRACTION"),
                             autocast_adapter_dtype=True)
    rm.head.requires_grad_(True)
    return rm


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def train_flops(cfg, tokens: int, seq_len: int, head_tokens: int, head_out: int, frozen: bool = False) -> float:
    """Forward + backward FLOPs (PaLM appendix B): 6 N T for the matmuls of the blocks,
    12 * layers * d * L per token for attention (no causal discount), and 6 * d * head_out per
    token that goes through the output head (only response positions do). ``frozen``: a frozen
    base under LoRA adapters computes no weight gradients, so its matmuls count 4 N T (forward and
    the input gradients; the adapters' own FLOPs, < 1% at rank 32, are not counted)."""
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    block = L * (2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size)
    mm = 4 if frozen else 6
    return mm * block * tokens + 12 * L * d * seq_len * tokens + mm * d * head_out * head_tokens


def ppo_epoch_flops(cfg, tokens: int, rows: int, actions: int, lora_actor: bool = False, lora_critic: bool = False) -> float:
    """One PPO epoch's useful forward + backward FLOPs (``train_flops``) over a rollout's ``tokens``
    real tokens in ``rows`` rows with ``actions`` real response tokens (a row's mean length as the
    attention span): the policy, its LM head at the actions and one more position a row, and the
    critic, a 1-output head at every token. ``lora_*``: that model's base is frozen."""
    span = tokens / rows
    return (train_flops(cfg, tokens, span, actions + rows, cfg.vocab_size, lora_actor)
            + train_flops(cfg, tokens, span, tokens, 1, lora_critic))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def timed(out: dict, key: str):
    sync()
    t = time.perf_counter()
    yield
    sync()
    out[key] = time.perf_counter() - t


def median_ms(fn, reps: int, warmup: int = 0) -> float:
    """The median milliseconds of ``reps`` calls of ``fn``, each synchronised on both sides, after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def is_kernel(event) -> bool:
    """Whether a row of torch.profiler's ``key_averages()`` is the device's own kernel time: not a
    CPU row (an aten op or Inductor's launcher repeats its kernels' time as its own device time),
    not a ``record_function`` span (the optimizer's "Optimizer.step#..." also has a row on the
    device's timeline, as long as its kernels and the gaps between them)."""
    from torch.autograd import DeviceType

    return event.device_type != DeviceType.CPU and not event.is_user_annotation


def kernel_ms(fn, reps: int) -> float:
    """The device's kernel time of one call of ``fn`` (CUDA), the mean of ``reps`` under
    torch.profiler: what the call costs the GPU, whatever its host path costs (``median_ms`` times
    both). NaN off CUDA."""
    if not torch.cuda.is_available():
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    return sum(e.self_device_time_total for e in prof.key_averages() if is_kernel(e)) / 1e3 / reps


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def machine() -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """Measured bf16 matmul rate on random data (the practical ceiling next to the datasheet's)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def copy_gbps(gib: float = 2.0, reps: int = 10) -> float:
    """Measured device-to-device copy bandwidth, bytes read + written per second / 1e9."""
    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync()
    return 2 * x.numel() * x.element_size() * reps / (time.perf_counter() - t) / 1e9


def profile_top(fn, reps: int, rows: int) -> list[str]:
    """The ``rows`` GPU kernels with the most self time over ``reps`` calls of ``fn``:
    'total ms | calls | name' (total over all calls), plus a line with the sum of all kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / 1e3 / reps
    out = [f"{e.self_device_time_total / 1e3 / reps:8.3f} ms | {e.count // reps:5d} | {e.key[:110]}" for e in events[:rows]]
    return out + [f"{total:8.3f} ms | {sum(e.count for e in events) // reps:5d} | all kernels, per call"]


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
