"""Gradients through attention on left-padded PPO batches are finite (issue 18's NaN).

On the H200 (torch 2.11) both PPO learners stopped at their first step with a finite loss and a
NaN gradient norm: cuDNN's SDPA backward gives NaN query gradients for rows whose every key is
masked, which every left-pad row is (autograd's anomaly mode named
ScaledDotProductCudnnAttentionBackward0). ``tasks.common.model.no_cudnn_attention`` keeps SDPA
off that backend in every process that loads a model on CUDA. Here a model loaded the way the
stages load it takes the actor's log-prob backward under the stages' autocast on rows with left
padding, at a length of 64 mod 128 (the backward kernel's tail tile, pytorch#196678). On CPU
(CI) this is the same path in fp32; on the GPU machine (bench/gpu_run.sh tests) it is the case
that was NaN.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.common.loop import autocast
from tasks.common.model import ModelConfig, load_causal_lm, no_cudnn_attention
from tasks.ppo.generation import action_logprobs
from tasks.ppo.group import DistributedWorker

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD, V = 0, 128


def left_padded(B: int, L: int, N: int):
    """(ids, attention mask) of B rows of L tokens, the last N the actions, prompts of mixed length."""
    g = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(4, L - N + 1, (B,), generator=g)
    mask = (torch.arange(L)[None] >= (L - N - prompt_lens)[:, None]).long()
    ids = torch.randint(1, V, (B, L), generator=g).masked_fill(mask == 0, PAD)
    return ids.to(DEVICE), mask.to(DEVICE)


def save_tiny_llama(folder, max_len: int = 256) -> str:
    """A 2-layer random Llama with head_dim 64 (as real models have), saved as a local model."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=max_len, pad_token_id=PAD)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def test_actor_backward_is_finite_on_left_padded_rows(tmp_path):
    folder = save_tiny_llama(tmp_path / "model")
    if DEVICE == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)  # as a fresh process has it
    model = load_causal_lm(ModelConfig(pretrain=folder), DEVICE).eval()
    if DEVICE == "cuda":
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    ids, mask = left_padded(B=8, L=192, N=64)
    assert (mask == 0).any(), "the batch must have left-pad rows"
    with autocast(DEVICE):
        logp = action_logprobs(model, ids, mask, num_actions=64)
    assert torch.isfinite(logp).all()
    logp.mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == sum(1 for p in model.parameters() if p.requires_grad)
    bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    assert not bad, f"non-finite gradients: {bad}"
    assert torch.stack([g.float().norm() for g in grads.values()]).sum() > 0


def test_cuda_role_processes_switch_cudnn_attention_off_and_cpu_ones_keep_it():
    before, threads = torch.backends.cuda.cudnn_sdp_enabled(), torch.get_num_threads()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        no_cudnn_attention("cpu")
        DistributedWorker("actor", 0, 1, "ddp", 0, 1.0, "cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()  # a CPU process keeps torch's defaults
        DistributedWorker("critic", 0, 1, "ddp", 0, 1.0, "cuda")  # what a CUDA role's actor runs first
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:  # a worker also sets this process's thread count
        torch.backends.cuda.enable_cudnn_sdp(before)
        torch.set_num_threads(threads)
