"""Fast rollouts: a static KV cache, and the whole decode step as one CUDA graph.

``tasks/ppo/generation.py::generate`` runs Hugging Face's forward once per token; at PPO sizes
(0.4B, batch 64) a step is ~25 ms of Python and kernel launches for well under 1 ms of GPU work.
Here a decode step is three parts, all captured together in one ``torch.cuda.CUDAGraph`` per
(batch size, sampling setting) and replayed once per token with no host sync in between:

1. the forward of one token per row: our own per-layer function (``_layer``) over packed
   weights — q/k/v as one matmul, gate/up as one — with K/V written into a preallocated cache
   and attention over all cache columns under an additive mask (SDPA; ``attention='triton'``: a
   split-K Triton kernel that never reads the masked columns and also does RoPE and the cache
   write, ``tasks/ppo/decode_attention.py``); on CUDA ``torch.compile``d, which fuses the norms,
   RoPE, the cache write and SwiGLU around the matmuls;
2. sampling as ``generation.sample_next`` does it (temperature, top-k, top-p, the exponential race
   that ``torch.multinomial`` uses) on a generator registered with the graph, so a seeded rollout
   draws the same numbers as the plain loop;
3. bookkeeping on device: pad after the stop token (any of the stop ids), the per-row finished
   mask, response and action-mask columns, next position and column.

Compiled, the parts outside the layers are compiled too (the embedding and rotary tables, the
final norm and head, the sampler's probabilities, its pick and the bookkeeping; only the random
draw stays eager, for the plain loop's numbers): a few kernels a step instead of ~36 eager ops.

The host asks "how many rows are still going?" only every ``check_every`` steps (one sync); the
tokens do not depend on it, only how many wasted steps follow the last EOS.

Compaction (``compact``): rows stop at different lengths, and a batch whose rows are mostly done
still decodes them all. At a check where at most half the current rows are going, the going rows
are moved to the front of the state and the cache (one gather of their K/V) and the step continues
at a smaller batch (halvings of the rollout's batch, down to an eighth), each size with its own graph,
all captured before the rollout starts. The sampler still sees every row of the batch in its own
place (the logits of the live rows scattered into a full-batch buffer), so it draws the same random
numbers as the plain loop and the tokens stay equal; the results are put back in row order.

Cache layout: column ``j < P`` holds prompt token ``j`` (left padding included, masked off);
response token ``s`` goes to column ``P + s``. Positions come from the attention mask as in the
plain loop. Each query always sees its own key, so a left-pad row never attends to nothing.

Weights: the decode reads a weight set in the cache dtype, built from the model's own modules:
q/k/v and gate/up concatenated, PEFT LoRA adapters merged (``W + scale * B @ A``), fp32 master
weights cast. It is rebuilt in place at the start of every ``generate`` (one pass over the
weights: ~1 ms at 0.4B on an H200), so an optimizer step — in place or not — is always seen, and
only LoRA deltas move when the base is frozen. Norms, embeddings, the head and other weights
already in the cache dtype are read where they are, with no copy. If a parameter tensor is
replaced, the weight set and the graphs are rebuilt.

Supported: Llama-family decoders (Llama, Mistral, Qwen2, Qwen3: RMSNorm, RoPE from the model's
``rotary_emb``, gated MLP; q/k/v and MLP biases), optionally under plain LoRA adapters. Not:
sharded parameters (FSDP; Gemini's go through a plain copy, see ``fast_generate_applies``), sliding windows, DoRA, LoRA on the embeddings.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from tasks.common.model import allow_recompiles
from tasks.ppo.config import DECODE_KERNELS, FAST_GENERATE_STRATEGIES
from tasks.ppo.generation import (Rollout, _unwrap, check_temperature, exp_draws, position_ids_from_mask, race, sample_next, sample_probs,
                                  stop_ids)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(config) -> str | None:
    """Why FastGenerator cannot decode a model of this Hugging Face ``config``, or None."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model_type {kind!r} is not one of the Llama-family decoders it implements {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding-window attention (config.sliding_window={config.sliding_window}) is not supported"
    return None


def fast_generate_applies(mode: str, strategy: str, device: str, config) -> bool:
    """Whether PPO rollouts use FastGenerator (``ppo.fast_generate`` = ``mode``): 'auto' on CUDA for a
    supported model under a strategy of ``FAST_GENERATE_STRATEGIES``; 'on' wherever it can, else a ValueError."""
    if mode == "off":
        return False
    reason = unsupported_reason(config)
    if reason is None and strategy not in FAST_GENERATE_STRATEGIES:
        reason = f"ppo.strategy {strategy!r} shards the parameters (it needs them whole on every actor rank)"
    if reason is not None and mode == "on":
        raise ValueError(f"ppo.fast_generate 'on' cannot apply: {reason}; set ppo.fast_generate 'auto' or 'off'")
    return reason is None and (mode == "on" or device == "cuda")


def check_fast_generate(mode: str, strategy: str, model_cfg) -> None:
    """Before any actor starts: 'on' for a model FastGenerator cannot decode is an error."""
    if mode != "on":
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.path(), revision=model_cfg.revision,
                                        trust_remote_code=model_cfg.trust_remote_code)
    fast_generate_applies(mode, strategy, "cpu", config)


# FastGenerator's kernel options: option -> (the library's kernel, the Triton module of tasks/ppo/),
# from the stage's ppo.decode_* options. Each takes 'auto' (the Triton kernel on a CUDA device where
# triton imports, else the library's), the library's name, or 'triton'.
KERNELS = {option.removeprefix("decode_"): (library, option) for option, library in DECODE_KERNELS.items()}


def _triton_kernel(option: str, module: str, device: torch.device, instead: str) -> str:
    """FastGenerator's ``option`` = 'triton': imports tasks/ppo/``module``.py (which registers its
    kernel as a ``torch.ops.rlhf`` op), or a ValueError naming what is missing, the triton package
    or a CUDA device (off CUDA the kernels run only in Triton's interpreter, TRITON_INTERPRET=1:
    the CPU tests), and the way out (``instead``)."""
    import importlib

    try:
        kernel = importlib.import_module(f"tasks.ppo.{module}")
    except ImportError as e:
        raise ValueError(f"FastGenerator: {option} 'triton' needs the triton package ({e}); "
                         f"install it or use {option} {instead!r}") from e
    if device.type != "cuda" and not kernel.INTERPRETED:
        raise ValueError(f"FastGenerator: {option} 'triton' needs a CUDA device (this one is {device}) or Triton's "
                         f"interpreter (TRITON_INTERPRET=1); use {option} {instead!r}")
    return "triton"


LINEAR_AUTO_MAX_HIDDEN = 1024  # linear 'auto' takes the split-K kernel up to this hidden size: it won at d 1024 (0.4B)
# and lost at d 1536 and 4096 (1.5B, 8B) on an H100 (tasks/ppo/decode_linear.py, bench/RESULTS.md); in half precision only (measured in bf16)


def pick_kernel(option: str, choice: str, device: torch.device, hidden_size: int | None = None,
                dtype: torch.dtype | None = None) -> str:
    """FastGenerator's ``option`` ('attention' or 'linear', ``KERNELS``) checked and resolved: 'auto'
    (the default) is the Triton kernel on a CUDA device where the triton package imports, else the
    library's (measured on the H200 and H100, bench/RESULTS.md); for the linears only where they
    were measured faster: models of at most ``LINEAR_AUTO_MAX_HIDDEN`` hidden units
    (``hidden_size``) decoding in half precision (``dtype``; None: either unknown, taken as fitting)."""
    library, module = KERNELS[option]
    if choice not in ("auto", library, "triton"):
        raise ValueError(f"FastGenerator: {option} {choice!r} is not one of {('auto', library, 'triton')}")
    unmeasured = option == "linear" and ((hidden_size is not None and hidden_size > LINEAR_AUTO_MAX_HIDDEN)
                                         or (dtype is not None and dtype not in (torch.bfloat16, torch.float16)))
    if choice == library or (choice == "auto" and (device.type != "cuda" or unmeasured)):
        return library
    try:
        return _triton_kernel(option, module, device, library)
    except ValueError:  # on CUDA only the package can be missing: 'auto' takes the library's kernel then
        if choice == "auto":
            return library
        raise


LINEAR_PDL = True  # the split-K linears as programmatic dependents where they can be (bench/decode_parts.py's 'nopdl' turns it off)
# Bench switches (bench/decode_parts.py's step options), the measured choice by default (0.4b, H100, bench/RESULTS.md):
ATTENTION_ROPE = True  # attention='triton': RoPE and the K/V cache writes of a decode step in the attention kernel, two
# kernels a layer fewer (split-K linears 1.398 -> 1.363 ms, sixth session; cuBLAS's 1.463 -> 1.407, seventh; 'norope');
# not with Qwen3's q/k norms
COMPILED_ENDS = True  # the step's parts outside the layers compiled too (1.378 -> 1.317 ms, cuBLAS 1.523 -> 1.463; 'eagerends')
ATTENTION_PDL = True  # with the PDL linears: that kernel launched as a programmatic dependent too (1.317 -> 1.289-1.292; 'noapdl')


def _pdl_capable(device: torch.device) -> bool:
    from tasks.ppo.decode_linear import pdl_capable  # triton: only where linear='triton' (imported by pick_kernel)

    return pdl_capable(device)


# ----------------------------------------------------------------------------- the model, by hand

class Dims(NamedTuple):
    n_heads: int
    n_kv: int
    head_dim: int
    scale: float
    eps: float
    attention: str = "sdpa"  # the decode attention: 'sdpa' or 'triton' (a constant of the compiled layer)
    linear: str = "cublas"  # the decode step's linears: 'cublas' (F.linear) or 'triton' (tasks/ppo/decode_linear.py)
    pdl: bool = False  # the split-K linears launched as programmatic dependents (``decode_linear_partials_pdl``; compiled, sm90+)
    rope_in_attention: bool = False  # decode: RoPE and the K/V cache writes inside the Triton attention (``decode_attention_rope``)
    attention_pdl: bool = False  # that kernel launched as a programmatic dependent (``decode_attention_rope_pdl``), with ``pdl``


class Sampling(NamedTuple):
    """``generate``'s sampling settings (``sample_next``'s) and the generator it draws from."""
    temperature: float
    top_k: int
    top_p: float
    greedy: bool
    rng: torch.Generator | None


GREEDY = Sampling(1.0, 0, 1.0, True, None)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm's arithmetic: in fp32, cast back, then the weight."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _decode_attention(q: Tensor, kc: Tensor, vc: Tensor, bias: Tensor, d: Dims) -> Tensor:
    """One query per row against the whole cache: q (b, n_heads, 1, hd), kc/vc (b, n_kv, L, hd),
    additive bias (b, 1, 1, L) -> (b, n_kv, g, hd), g = n_heads / n_kv: grouped-query attention
    without repeating K/V, a group's heads being its queries. ``d.attention`` 'triton': the
    split-K kernel of tasks/ppo/decode_attention.py (registered as ``torch.ops.rlhf``), which reads
    only the visible columns; 'sdpa': the library kernel (cuDNN on an H200 beat fused Inductor
    reductions and the memory-efficient kernel, but tiles for long queries: bench/RESULTS.md)."""
    b, g = q.shape[0], d.n_heads // d.n_kv
    q = q.reshape(b, d.n_kv, g, d.head_dim)
    if d.attention == "triton":
        return torch.ops.rlhf.decode_attention(q, kc, vc, bias, d.scale)
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=bias, scale=d.scale)


def _linear(x: Tensor, w: Tensor, bias: Tensor | None, d: Dims, decode: bool) -> Tensor:
    """F.linear, or at a decode step of at most 64 rows (``decode_linear.MAX_ROWS``) with
    ``d.linear`` 'triton' the split-K kernel of tasks/ppo/decode_linear.py: its fp32 partials
    summed, the bias added, cast (Inductor folds this into the kernel that consumes the product)."""
    if not _split_k(x, d, decode):
        return F.linear(x, w, bias)
    y = _partials(x, w, d).sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _linear_parts(x: Tensor, w: Tensor, bias: Tensor | None, d: Dims, decode: bool) -> Tensor:
    """``_linear`` as (S, *x.shape[:-1], n) parts whose sum over the first dimension, cast to
    x's dtype, is its product: the split-K kernel's fp32 partials as they are (so their sum can
    fuse into a kernel of the next compiled layer), else the product as one part."""
    if not _split_k(x, d, decode) or bias is not None:
        return _linear(x, w, bias, d, decode)[None]
    return _partials(x, w, d)


def _split_k(x: Tensor, d: Dims, decode: bool) -> bool:
    """Whether a linear of x (b, T, k) runs the split-K kernel: ``d.linear`` 'triton' at a decode step of at most 64 rows."""
    return d.linear == "triton" and decode and x.shape[0] * x.shape[1] <= 64


def _partials(x: Tensor, w: Tensor, d: Dims) -> Tensor:
    op = torch.ops.rlhf.decode_linear_partials_pdl if d.pdl else torch.ops.rlhf.decode_linear_partials
    return op(x.reshape(-1, x.shape[-1]), w).reshape(-1, *x.shape[:-1], w.shape[0])


def _layer(x: Tensor, delta: Tensor | None, kc: Tensor, vc: Tensor, cols: Tensor, mask: Tensor, cos: Tensor, sin: Tensor,
           w: tuple, d: Dims, act: Callable) -> tuple[Tensor, Tensor]:
    """One decoder layer over T new tokens per row: its input ``x + delta.sum(0)`` (b, T, dm) ->
    its output as (x', delta'); writes their K/V.

    The residual add that ends a layer is left to the next: in the compiled layer it then fuses
    with the next layer's first RMSNorm, and with the split-K linears the sum of the down
    projection's partials with it (``_linear_parts``): one kernel a layer fewer, as one graph over
    the whole decoder fuses it; the arithmetic is the same. ``delta`` None: the first layer.

    kc, vc: (b, n_kv, L, head_dim) cache, written at ``cols`` (T,). cos, sin: (b, 1, T, head_dim).
    w: (ln1, wqkv, bqkv, q_norm, k_norm, wo, bo, ln2, wgu, bgu, wd, bd) with q/k/v and gate/up
    packed. mask, float (decode, T == 1): additive (b, 1, 1, L) over every cache column; bool
    (prefill, ``cols`` = 0..T-1): (b, 1, T, T) over the prompt's columns only. The mask's dtype,
    not T, tells them apart: a one-token prompt's prefill must not see the rest of the cache.
    """
    ln1, wqkv, bqkv, qn, kn, wo, bo = w[:7]
    if delta is not None:
        x = x + delta.sum(0).to(x.dtype)
    b, T, _ = x.shape
    nq, nkv, hd = d.n_heads * d.head_dim, d.n_kv * d.head_dim, d.head_dim
    decode = mask.dtype != torch.bool
    h = _rms(x, ln1, d.eps)
    if decode and d.rope_in_attention:  # T == 1: RoPE and the cache writes in the attention kernel
        qkv = _linear_parts(h, wqkv, bqkv, d, decode)[:, :, 0]
        op = torch.ops.rlhf.decode_attention_rope_pdl if d.attention_pdl else torch.ops.rlhf.decode_attention_rope
        o = op(qkv, cos[:, 0, 0], sin[:, 0, 0], kc, vc, cols, mask, d.scale, d.n_heads)
        return _mlp(x + _linear(o.reshape(b, 1, nq), wo, bo, d, decode), w, d, act, decode)
    q, k, v = _linear(h, wqkv, bqkv, d, decode).split([nq, nkv, nkv], dim=-1)
    q, k, v = q.view(b, T, d.n_heads, hd), k.view(b, T, d.n_kv, hd), v.view(b, T, d.n_kv, hd)
    if qn is not None:  # Qwen3: RMSNorm over head_dim before RoPE
        q, k = _rms(q, qn, d.eps), _rms(k, kn, d.eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    kc.index_copy_(2, cols, k)
    vc.index_copy_(2, cols, v)
    if decode:
        o = _decode_attention(q, kc, vc, mask, d).reshape(b, 1, nq)
    else:
        o = F.scaled_dot_product_attention(q, kc[:, :, :T], vc[:, :, :T], attn_mask=mask, scale=d.scale,
                                           enable_gqa=d.n_kv != d.n_heads)
        o = o.transpose(1, 2).reshape(b, T, nq)
    return _mlp(x + _linear(o, wo, bo, d, decode), w, d, act, decode)


def _mlp(x: Tensor, w: tuple, d: Dims, act: Callable, decode: bool) -> tuple[Tensor, Tensor]:
    """The layer's second half: (x, the MLP's product as ``_linear_parts``) of x after attention."""
    ln2, wgu, bgu, wd, bd = w[7:]
    gate, up = _linear(_rms(x, ln2, d.eps), wgu, bgu, d, decode).chunk(2, dim=-1)
    return x, _linear_parts(act(gate) * up, wd, bd, d, decode)


def _decoder(ids: Tensor, pos: Tensor, cols: Tensor, mask: Tensor, embed: Tensor, norm: Tensor, head: Tensor, head_bias: Tensor | None,
             cos_table: Tensor, sin_table: Tensor, k_caches: list, v_caches: list, layers: list, d: Dims, act: Callable,
             dtype: torch.dtype, fns: tuple[Callable, Callable, Callable] | None = None) -> Tensor:
    """The decoder over T new tokens per row, the final norm and the head: ids, pos (b, T) ->
    logits of the last position (b, V). ``fns``: (``_inputs``, ``_layer``, ``_head``), each as it
    is (the default) or its compiled graph."""
    inputs_fn, layer_fn, head_fn = fns or (_inputs, _layer, _head)
    x, cos, sin = inputs_fn(ids, pos, embed, cos_table, sin_table, dtype)
    delta = None
    for kc, vc, w in zip(k_caches, v_caches, layers):
        x, delta = layer_fn(x, delta, kc, vc, cols, mask, cos, sin, w, d, act)
    return head_fn(x, delta, norm, head, head_bias, d.eps)


def _inputs(ids: Tensor, pos: Tensor, embed: Tensor, cos_table: Tensor, sin_table: Tensor, dtype: torch.dtype) -> tuple:
    """The decoder's inputs: the tokens' embeddings (b, T, dm) and the rows' rotary tables at ``pos`` (b, 1, T, hd)."""
    return F.embedding(ids, embed).to(dtype), cos_table[pos][:, None], sin_table[pos][:, None]


def _head(x: Tensor, delta: Tensor, norm: Tensor, head: Tensor, head_bias: Tensor | None, eps: float) -> Tensor:
    """The last position's residual sum (``_layer``'s (x, delta)), the final RMSNorm and the head -> logits (b, V)."""
    x = x[:, -1] + delta[:, :, -1].sum(0).to(x.dtype)
    return F.linear(_rms(x, norm, eps), head, head_bias)


def _record(token: Tensor, fin: Tensor, resp: Tensor, act: Tensor, tok: Tensor, step: Tensor, stop: Tensor, pad: Tensor) -> None:
    """The sampled ``token`` (b,) as response column ``step``: pad after a stop token, the action
    mask, the finished flags (any of the ``stop`` ids); it is the next step's input ``tok``."""
    token = torch.where(fin, pad, token)
    resp.index_copy_(1, step, token[:, None])
    act.index_copy_(1, step, (~fin).long()[:, None])
    fin |= (token[:, None] == stop).any(-1)
    tok.copy_(token)
    step += 1


def _finish_step(w: Tensor, q: Tensor | None, rows: Tensor | None, fin: Tensor, resp: Tensor, act: Tensor, tok: Tensor,
                 step: Tensor, stop: Tensor, pad: Tensor, pos: Tensor, col: Tensor) -> None:
    """The end of a decode step: the token of each row (``race``: ``sample_next``'s pick, ``q``
    None when greedy), taken at ``rows`` (the slots' batch rows; None: all), recorded
    (``_record``), the next position and column. One function, so that compiled it is a few kernels."""
    token = race(w, q)
    _record(token if rows is None else token.index_select(0, rows), fin, resp, act, tok, step, stop, pad)
    pos += 1
    col += 1


# ----------------------------------------------------------------------------- weights

def _linear_weight(m, name: str) -> Tensor:
    """The weight ``m`` applies: an nn.Linear's own, or a PEFT LoRA layer's base weight plus its
    active adapters' deltas (``get_delta_weight``: scale * B @ A)."""
    if type(m) is torch.nn.Linear:
        return m.weight
    base = getattr(m, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(m, "get_delta_weight"):
        raise ValueError(f"FastGenerator: {name} is a {type(m).__name__}, not an nn.Linear or a PEFT LoRA Linear")
    w = base.weight
    if not getattr(m, "merged", False) and not getattr(m, "disable_adapters", False):
        for a in m.active_adapters:
            if a not in m.lora_A:
                continue
            if getattr(m, "use_dora", {}).get(a) or getattr(m, "lora_bias", {}).get(a):
                raise ValueError(f"FastGenerator: {name} uses DoRA or a LoRA bias (adapter {a!r}); use ppo.fast_generate 'off'")
            w = w + m.get_delta_weight(a)
    return w


def _linear_bias(m) -> Tensor | None:
    return m.bias if type(m) is torch.nn.Linear else getattr(getattr(m, "base_layer", None), "bias", None)


def _packed_bias(mods) -> Tensor | None:
    """The biases of ``mods`` concatenated (zeros for one without), or None when none has one."""
    biases = [_linear_bias(m) for m in mods]
    if all(b is None for b in biases):
        return None
    ref = next(b for b in biases if b is not None)
    return torch.cat([b if b is not None else ref.new_zeros(_out_features(m)) for b, m in zip(biases, mods)])


def _out_features(m) -> int:
    return (m if type(m) is torch.nn.Linear else m.base_layer).out_features


def _decoder_parts(model):
    """(lm, embed, layers, final norm, lm_head, rotary) of a Llama-style causal LM, or a ValueError."""
    lm = _unwrap(model)
    inner = getattr(lm, "model", None)
    parts = [getattr(inner, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb")]
    head = getattr(lm, "lm_head", None)
    layer0 = parts[1][0] if parts[1] is not None and len(parts[1]) else None
    attn, mlp = getattr(layer0, "self_attn", None), getattr(layer0, "mlp", None)
    if any(p is None for p in parts) or head is None or attn is None or mlp is None or not all(
        hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or not all(
        hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")
    ):
        raise ValueError(
            f"FastGenerator: {type(lm).__name__} is not a Llama-style decoder (model.embed_tokens, "
            "model.layers[i].self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, model.norm, model.rotary_emb, "
            "lm_head); use tasks.ppo.generation.generate for this model"
        )
    if getattr(lm.config, "sliding_window", None) and getattr(lm.config, "use_sliding_window", True):
        raise ValueError(f"FastGenerator: sliding-window attention (config.sliding_window={lm.config.sliding_window}) is not supported")
    if type(parts[0]) is not torch.nn.Embedding:
        raise ValueError(f"FastGenerator: the embedding is a {type(parts[0]).__name__} (LoRA on embeddings is not supported)")
    embed, layers, norm, rotary = parts
    return lm, embed, layers, norm, head, rotary


class FastGenerator:
    """Rollouts for one model with a static cache of ``max_batch`` rows x ``max_len`` columns.

    ``use_cuda_graph``: capture the decode step (CUDA only; on CPU the same code runs eagerly).
    ``dtype``: cache and compute dtype (default: the dtype of the model's first parameter).
    ``check_every``: decode steps between host checks of how many rows are still going.
    ``compact``: decode only the rows still going at a smaller batch once half or more have
    stopped (see the module's docstring).
    ``compile``: ``torch.compile`` the per-layer decode function (default: on CUDA). A decode
    step is ~15 small kernels a layer; their fixed cost, not reading the weights, is the GPU time,
    so fusing the norms, RoPE, the cache write and SwiGLU is what makes the graph fast.
    ``attention``: the decode step's attention, 'sdpa' or 'triton' (the split-K kernel of
    tasks/ppo/decode_attention.py; see ``pick_kernel``). The prompt's prefill is SDPA
    either way. ``compile_scope``: what one compiled graph covers, 'layer' (compiled once, run for
    every layer) or 'forward' (all layers, the final norm and the head: fusions across the
    layers' boundaries, a longer compile); ``compile_mode``: ``torch.compile``'s mode (e.g.
    'max-autotune-no-cudagraphs': Inductor's GEMM templates tried against cuBLAS). ``linear``: the
    decode step's linears, 'cublas' (F.linear) or 'triton' (the split-K kernel of
    tasks/ppo/decode_linear.py, batches of at most 64 rows; see ``pick_kernel``).
    """

    def __init__(self, model, max_batch: int, max_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, use_cuda_graph: bool = True, check_every: int = 16,
                 compile: bool | None = None, attention: str = "sdpa", compile_scope: str = "layer",
                 compile_mode: str | None = None, compact: bool = True, linear: str = "cublas"):
        self.model = model
        self.lm, self.embed, self.layers, self.norm, self.head, rotary = _decoder_parts(model)
        p0 = next(self.lm.parameters())
        self.device = torch.device(device) if device is not None else p0.device
        if self.device != p0.device:
            raise ValueError(f"FastGenerator: device ({self.device}) differs from the model's ({p0.device}); move the model first")
        self.dtype = dtype or p0.dtype
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        self.max_batch, self.check_every = int(max_batch), max(1, int(check_every))
        self.max_len = -(-int(max_len) // 8) * 8  # mask rows 16-byte aligned for the fused attention kernels
        cfg, attn0 = self.lm.config, self.layers[0].self_attn
        head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.dims = Dims(cfg.num_attention_heads, n_kv, head_dim, float(getattr(attn0, "scaling", head_dim ** -0.5)),
                         float(self.norm.variance_epsilon), pick_kernel("attention", attention, self.device),
                         pick_kernel("linear", linear, self.device, cfg.hidden_size, self.dtype))
        if self.dims.attention == "triton" and ATTENTION_ROPE and not hasattr(attn0, "q_norm"):
            self.dims = self.dims._replace(rope_in_attention=True)
        self.act = self.layers[0].mlp.act_fn

        kw = dict(device=self.device, dtype=self.dtype)
        shape = (self.max_batch, n_kv, self.max_len, head_dim)
        self.k_cache = [torch.zeros(shape, **kw) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, **kw) for _ in self.layers]
        with torch.no_grad():  # the rotary table once, with the model's own rotary module
            cos, sin = rotary(torch.zeros((), **kw), torch.arange(self.max_len, device=self.device)[None])
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # (max_len, head_dim)

        # the decode step's state, on device (graphs read and write these by address)
        B, L, long = self.max_batch, self.max_len, dict(dtype=torch.long, device=self.device)
        self._tok, self._pos = torch.zeros(B, **long), torch.zeros(B, **long)
        self._col, self._step = torch.zeros(1, **long), torch.zeros(1, **long)
        # stop ids, -1 in unused slots (never a token); a longer list gets a new buffer and new graphs
        self._stop, self._pad = torch.full((8,), -1, **long), torch.zeros((), **long)
        self._bias = torch.zeros(B, 1, 1, L, **kw)  # 0 where a row may attend, dtype's min elsewhere
        self._finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        self._resp, self._act = torch.zeros(B, L, **long), torch.zeros(B, L, **long)
        self.compact = bool(compact)
        self._row = torch.arange(B, **long)  # the batch row decoded in each state slot (compaction reorders them)
        self._logits = torch.zeros(B, _out_features(self.head), **kw)  # the sampler's full batch after compaction
        self.compactions: list[tuple[int, int]] = []  # the last rollout's (step, rows decoded from then on)
        self._rng = torch.Generator(self.device) if self.use_cuda_graph else None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None

        self._build_weights()
        want_compile = self.device.type == "cuda" if compile is None else compile
        if compile_scope not in ("layer", "forward"):
            raise ValueError(f"FastGenerator: compile_scope {compile_scope!r} is not 'layer' or 'forward'")
        # dynamic=None: a second batch size recompiles once with a symbolic batch dimension
        kw = dict(fullgraph=True, mode=compile_mode)
        if want_compile and compile_mode is None and self.dims.linear == "triton" and LINEAR_PDL and _pdl_capable(self.device):
            # the split-K linears as programmatic dependents of Inductor's kernels, which then let
            # them launch once they have read their inputs: each linear's weights stream into the
            # L2 while the kernel before it finishes (0.4b decode step 1.43 -> 1.40 ms on an H100,
            # bench/RESULTS.md, 2026-12-06, fifth session)
            self.dims = self.dims._replace(pdl=True, attention_pdl=ATTENTION_PDL and self.dims.rope_in_attention)
            kw = dict(fullgraph=True, options={"triton.enable_pdl": True})
        if want_compile:
            allow_recompiles()  # the compacted batch sizes, dtypes, split counts: more than dynamo's 8 versions

        def compiled(f: Callable, scope: str | None = None) -> Callable:
            """``f`` compiled, if the generator compiles, ``scope`` (where given) is ``compile_scope`` and
            ``f`` is a layer / the decoder or ``COMPILED_ENDS`` is on; else ``f`` itself."""
            wanted = want_compile and scope in (None, compile_scope) and (COMPILED_ENDS or f in (_layer, _decoder))
            return torch.compile(f, **kw) if wanted else f

        # a decode step's parts: the decoder's (each layer, and its inputs and head apart, or as one
        # graph), then sampling, with its random draw left eager between them (the plain loop's
        # numbers), and the step's bookkeeping: compiled, the step outside the layers is a few
        # kernels, not the ~36 of eager ops
        self._decode_fns = tuple(compiled(f, "layer") for f in (_inputs, _layer, _head))
        self._decode_forward = compiled(_decoder, "forward")
        self._decode_probs, self._decode_finish = compiled(sample_probs), compiled(_finish_step)

    # ------------------------------------------------------------------ weights

    def _build_weights(self) -> None:
        """The decode weight set: for every entry a recipe (reads the modules' current tensors)
        and a buffer; an entry whose recipe returns a parameter as it is needs no buffer."""
        names = {id(m): n for n, m in self.lm.named_modules()}

        def weight(*mods):  # one module's weight, or several packed along the output dimension
            ws = [_linear_weight(m, names.get(id(m), type(m).__name__)) for m in mods]
            return ws[0] if len(ws) == 1 else torch.cat(ws)

        recipes: list[Callable[[], Tensor | None]] = [
            lambda: self.embed.weight, lambda: self.norm.weight, lambda: weight(self.head), lambda: _linear_bias(self.head)]
        for layer in self.layers:  # in the order of _layer's ``w``
            a, m = layer.self_attn, layer.mlp
            qkv, gu = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
            qkn = [(lambda a=a: a.q_norm.weight), (lambda a=a: a.k_norm.weight)] if hasattr(a, "q_norm") else [lambda: None] * 2
            recipes += [lambda layer=layer: layer.input_layernorm.weight, lambda qkv=qkv: weight(*qkv),
                        lambda qkv=qkv: _packed_bias(qkv), *qkn,
                        lambda a=a: weight(a.o_proj), lambda a=a: _linear_bias(a.o_proj),
                        lambda layer=layer: layer.post_attention_layernorm.weight,
                        lambda gu=gu: weight(*gu), lambda gu=gu: _packed_bias(gu),
                        lambda m=m: weight(m.down_proj), lambda m=m: _linear_bias(m.down_proj)]
        self._recipes = recipes
        with torch.no_grad():
            made = [r() for r in recipes]
            params = {id(p) for p in self.lm.parameters()}
            # a parameter already in the cache dtype is read where it is; anything else is a buffer
            self._direct = [t is None or (id(t) in params and t.dtype == self.dtype) for t in made]
            self._weights = [None if t is None else t.detach() if direct else t.detach().to(self.dtype).clone()
                             for t, direct in zip(made, self._direct)]
        self._param_ptrs = self._pointers()
        w, n = self._weights, 12
        self._w_embed, self._w_norm, self._w_head, self._b_head = w[:4]
        self._w_layers = [tuple(w[4 + i * n: 4 + (i + 1) * n]) for i in range(len(self.layers))]

    def _drop_graphs(self) -> None:
        """Forget the captured graphs and their memory pool: a pool whose last graph is gone
        cannot take a new capture (an internal assert of the caching allocator on the H200)."""
        self._graphs.clear()
        self._pool = None

    def _pointers(self) -> list[int]:
        return [p.data_ptr() for p in self.lm.parameters()]

    def refresh_weights(self) -> None:
        """Make the next decode use the model's current parameters (``generate`` calls it first):
        re-fills the packed / merged / cast buffers in place; if any parameter tensor was replaced,
        rebuilds the weight set and drops the graphs (they read the old addresses)."""
        if self._pointers() != self._param_ptrs:
            self._drop_graphs()
            self._build_weights()
            return
        with torch.no_grad():
            for r, buf, direct in zip(self._recipes, self._weights, self._direct):
                if not direct:
                    buf.copy_(r())

    def weight_copy_bytes(self) -> int:
        """GPU memory the decode weight set adds on top of the model (packed / merged / cast copies)."""
        return sum(t.numel() * t.element_size() for t, d in zip(self._weights, self._direct) if not d)

    # ------------------------------------------------------------------ steps

    def _forward(self, ids: Tensor, pos: Tensor, cols: Tensor, mask: Tensor, decode: bool) -> Tensor:
        """ids, pos (b, T) -> logits of the last position (b, V); K/V written at ``cols``; ``decode``:
        a decode step's compiled parts (the prefill runs eagerly, once a rollout)."""
        b = ids.shape[0]
        return (self._decode_forward if decode else _decoder)(
            ids, pos, cols, mask, self._w_embed, self._w_norm, self._w_head, self._b_head, self.cos, self.sin,
            [c[:b] for c in self.k_cache], [c[:b] for c in self.v_cache], self._w_layers, self.dims, self.act, self.dtype,
            self._decode_fns if decode else None)

    def _prefill(self, input_ids: Tensor, attn: Tensor) -> Tensor:
        """The prompts (b, P) into cache columns 0..P-1 (eager: once a rollout) -> next-token logits (b, V)."""
        P = input_ids.shape[1]
        cols = torch.arange(P, device=self.device)
        causal = cols[None, :] <= cols[:, None]
        mask = (causal[None] & attn.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool, device=self.device)
        return self._forward(input_ids, position_ids_from_mask(attn), cols, mask[:, None], decode=False)

    def _state(self, b: int) -> tuple:
        """``_record``'s buffers of the first ``b`` state slots."""
        return self._finished[:b], self._resp[:b], self._act[:b], self._tok[:b], self._step, self._stop, self._pad

    def _decode(self, b: int, s: Sampling, n: int | None = None) -> None:
        """One decode step from the state buffers (what the graph holds) of a ``b``-row rollout,
        its first ``n`` state slots decoded (default all; fewer after a compaction), sampled as ``s`` says."""
        n = b if n is None else n
        bias = self._bias[:n]
        bias.index_fill_(-1, self._col, 0.0)  # the new token's own column becomes visible
        logits = self._forward(self._tok[:n, None], self._pos[:n, None], self._col, bias, decode=True)
        rows = None
        if n < b:  # the sampler sees every row in its own place: the plain loop's random numbers
            rows = self._row[:n]
            logits = self._logits[:b].index_copy_(0, rows, logits)
        # sample_next's steps, its random draw between the compiled parts (the generator's numbers, as the plain loop's)
        # top-p eagerly: Inductor splits its cumsum over a vocabulary (32k) of a few rows (SplitScan)
        # and that kernel's CUDA codegen fails (torch 2.11, "list indices must be integers or slices,
        # not NoneType"; bench/RESULTS.md, 2026-12-07, eleventh session)
        probs = self._decode_probs if s.top_p >= 1.0 else sample_probs
        w = logits if s.greedy else probs(logits, s.temperature, s.top_k, s.top_p)
        q = None if s.greedy else exp_draws(w, s.rng)
        self._decode_finish(w, q, rows, *self._state(n), self._pos[:n, None], self._col)

    def _sizes(self, b: int) -> list[int]:
        """The batch sizes a ``b``-row rollout decodes at: b, then its halvings down to an eighth (with ``compact``)."""
        sizes = [b]
        while self.compact and sizes[-1] // 2 >= max(1, b // 8):
            sizes.append(sizes[-1] // 2)
        return sizes

    def _compact(self, n: int, to: int, cols: int) -> None:
        """Move the going rows among the first ``n`` slots to the front and keep ``to`` slots decoding:
        every per-row state buffer is reordered, the K/V of the first ``to`` gathered (the ``cols``
        cache columns written so far)."""
        order = torch.argsort(self._finished[:n].to(torch.int8), stable=True)  # going first, in slot order
        for buf in (self._tok, self._pos, self._finished, self._resp, self._act, self._bias, self._row):
            buf[:n] = buf[:n].index_select(0, order)
        keep = order[:to]
        for c in self.k_cache + self.v_cache:
            c[:to, :, :cols] = c[:n, :, :cols].index_select(0, keep)

    def _set_stops(self, ids: list[int]) -> None:
        if len(ids) > self._stop.numel():  # the graphs read the old buffer's address
            self._stop = torch.full((len(ids),), -1, dtype=torch.long, device=self.device)
            self._drop_graphs()
        self._stop.fill_(-1)
        self._stop[: len(ids)] = torch.tensor(ids, dtype=torch.long)

    def _reset(self, b: int, attn: Tensor | None = None, pad: int = 0) -> None:
        """State for a new rollout of ``b`` rows (prompt attention mask ``attn``, (b, P))."""
        P = 0 if attn is None else attn.shape[1]
        self._bias[:b].fill_(torch.finfo(self.dtype).min)
        if attn is not None:
            self._bias[:b, 0, 0, :P].masked_fill_(attn.bool(), 0.0)
        # positions too: a graph's warm-up (no prompt) after a rollout that reached the last cache
        # column would read RoPE rows past max_len (a device-side assert on the H200)
        self._pos[:b] = attn.sum(-1) if attn is not None else 0
        self._col.fill_(P)
        self._step.zero_()
        self._finished[:b].zero_()
        self._resp[:b].fill_(pad)
        self._act[:b].zero_()
        self._row[:b] = torch.arange(b, device=self.device)

    def _graph(self, b: int, n: int, s: Sampling) -> torch.cuda.CUDAGraph:
        """The decode step of a ``b``-row rollout over its first ``n`` slots sampled as ``s`` says,
        captured (before a rollout: the warm-up steps overwrite the state)."""
        key = (b, *s[:4], n)
        if key not in self._graphs:
            self._reset(b)  # warm-up steps write columns 0, 1, 2: in range whatever came before
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # outside capture: compilation, cuBLAS handles, workspaces
                for _ in range(2):
                    self._decode(b, s, n)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            g.register_generator_state(self._rng)
            with torch.cuda.graph(g, pool=self._pool):
                self._decode(b, s, n)
            self._pool = g.pool()
            self._graphs[key] = g
        return self._graphs[key]

    # ------------------------------------------------------------------ rollout

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int, eos_token_id: int | Sequence[int],
        pad_token_id: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
        generator: torch.Generator | None = None, greedy: bool = False,
        all_finished: Callable[[bool], bool] | None = None,
    ) -> Rollout:
        """Same contract and result as ``tasks.ppo.generation.generate`` (LEFT-padded (B, P) prompts).

        ``all_finished`` is asked every ``check_every`` steps instead of every step. With the
        same ``generator`` state the sampled tokens equal the plain loop's; the generator ends
        advanced by the steps actually run (up to ``check_every - 1`` more than the plain loop).
        """
        b, P = input_ids.shape
        N = max_new_tokens
        if b > self.max_batch or P + N > self.max_len:
            raise ValueError(
                f"FastGenerator: batch {b} x (prompt {P} + max_new_tokens {N}) does not fit the cache "
                f"(max_batch={self.max_batch}, max_len={self.max_len}); build it with larger sizes"
            )
        attn = attention_mask.long()
        self.refresh_weights()
        self._set_stops(stop_ids(eos_token_id))
        self._pad.fill_(pad_token_id)
        graphs, source, sizes = None, generator, self._sizes(b)
        s = Sampling(float(temperature), int(top_k), float(top_p), bool(greedy), self._rng if self.use_cuda_graph else generator)
        if not s.greedy:
            check_temperature(s.temperature)  # before any graph is captured
        if self.use_cuda_graph:
            graphs = {n: self._graph(b, n, s) for n in sizes}
            if source is None:
                source = torch.cuda.default_generators[self.device.index if self.device.index is not None else torch.cuda.current_device()]
            s.rng.set_state(source.get_state())  # after capture: its warm-up steps drew numbers too

        self._reset(b, attn, pad_token_id)
        logits = self._prefill(input_ids, attn)
        _record(sample_next(logits, s.temperature, s.top_k, s.top_p, s.rng, s.greedy), *self._state(b))
        n, self.compactions = b, []
        for step in range(1, N):
            if step % self.check_every == 0:
                going = int((~self._finished[:n]).sum())
                if (all_finished(going == 0) if all_finished is not None else going == 0):
                    break
                to = min(s for s in sizes if s >= going)
                if to < n:
                    self._compact(n, to, P + step - 1)  # the columns written so far: the prompt, then one a decode step
                    n = to
                    self.compactions.append((step, n))
            if graphs is not None:
                graphs[n].replay()
            else:
                self._decode(b, s, n)
        if graphs is not None:
            source.set_state(s.rng.get_state())

        rows = self._row[:b]  # slot i holds batch row rows[i]: results back in row order
        in_row_order = lambda t: torch.empty_like(t).index_copy_(0, rows, t)  # noqa: E731
        responses, act = in_row_order(self._resp[:b, :N]), in_row_order(self._act[:b, :N])
        return Rollout(
            sequences=torch.cat([input_ids, responses], dim=1),
            attention_mask=torch.cat([attn, act], dim=1),
            action_mask=act.float(),
            ended_with_eos=in_row_order(self._finished[:b]),
        )

    def info(self) -> dict:
        """What the decode runs with: {'cuda_graphs', 'graph_batch_sizes', 'weight_copy_gib', 'compiled', 'attention',
        'attention_rope', 'attention_pdl', 'linear', 'linear_pdl', 'compact'}."""
        return {"cuda_graphs": self.use_cuda_graph, "graph_batch_sizes": sorted({k[0] for k in self._graphs}), "compact": self.compact,
                "weight_copy_gib": self.weight_copy_bytes() / 2**30,
                "compiled": self._decode_fns[1] is not _layer or self._decode_forward is not _decoder,
                "attention": self.dims.attention, "attention_rope": self.dims.rope_in_attention,
                "attention_pdl": self.dims.attention_pdl, "linear": self.dims.linear,
                "linear_pdl": self.dims.pdl}
