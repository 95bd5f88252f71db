"""Fast rollouts: a static KV cache and one CUDA graph per batch size for the one-token decode step.

``tasks/ppo/generation.py::generate`` runs Hugging Face's forward once per token; at PPO sizes
(0.4B, batch 64) each step is ~25 ms of Python and kernel launches for ~0.3 ms of GPU work.
Here the decode step is our own loop over the model's submodules (embedding, norms, the q/k/v/o
projections, the MLP, the head: so PEFT LoRA layers and biases are included) with attention over
a preallocated cache, captured once in a ``torch.cuda.CUDAGraph`` and replayed for every token.
Sampling runs eagerly on the graph's logits with ``generation.sample_next``, so temperature /
top-k / top-p / EOS / per-row finished mask mean exactly what they mean in the plain loop.

Layout: cache column ``j < P`` holds prompt token ``j`` (left padding included, masked off);
response token ``s`` goes to column ``P + s``. Positions come from the attention mask as in the
plain loop. Each query may always see its own key, so a left-pad row never attends to nothing
(an all-masked softmax is NaN, and NaN values leak through a 0 weight into real rows).

Weights: a graph reads parameters by address. An optimizer step updates them in place, so the
next replay sees new weights with no copy. When the cache dtype differs from the parameters'
(fp32 master weights, bf16 rollout), a cast copy of the parameters is kept and refreshed in place
at the start of each ``generate`` (one pass over the weights, ~1 ms at 0.4B on an H200). If a
parameter tensor is replaced (``load_state_dict(assign=True)``, re-wrapping), the graphs are
re-captured automatically.

Supported: Llama-family decoders (Llama, Mistral, Qwen2, Qwen3: ``model.layers[i].self_attn``
with q/k/v/o_proj, ``rotary_emb``, RMSNorms). Not: sharded parameters (FSDP / ZeRO-3), sliding
windows, models whose attention is not plain causal softmax attention.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tasks.ppo.generation import Rollout, _unwrap, position_ids_from_mask, sample_next


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm's arithmetic: in fp32, cast back, then the weight."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _attn_in(x, ln, eps, wq, bq, wk, bk, wv, bv, qn, kn, cos, sin, nh: int, nkv: int, hd: int):
    """Norm, q/k/v projections, (Qwen3 q/k norms), RoPE: (b, T, d) -> q (b, nh, T, hd), k, v (b, nkv, T, hd)."""
    b, T, _ = x.shape
    h = _rms(x, ln, eps)
    q = F.linear(h, wq, bq).view(b, T, nh, hd)
    k = F.linear(h, wk, bk).view(b, T, nkv, hd)
    v = F.linear(h, wv, bv).view(b, T, nkv, hd).transpose(1, 2)
    if qn is not None:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _attn_out_mlp(x, o, wo, bo, ln, eps, wg, wu, wd):
    """Output projection + residual, norm, SwiGLU MLP + residual: (b, T, d) -> (b, T, d)."""
    x = x + F.linear(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1), wo, bo)
    h = _rms(x, ln, eps)
    return x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


def _plain_layers(lm, layers) -> bool:
    """Whether every projection is a bare nn.Linear (no LoRA wrapper) with SiLU MLP and RMSNorms,
    so the decode step can run as two pure functions (what torch.compile fuses best)."""
    if getattr(lm.config, "hidden_act", None) != "silu":
        return False
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        projs = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projs += [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(p) is not torch.nn.Linear for p in projs) or any(p.bias is not None for p in projs[3:]):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [getattr(a, n) for n in ("q_norm", "k_norm") if hasattr(a, n)]
        if not all(hasattr(n, "variance_epsilon") and isinstance(getattr(n, "weight", None), torch.Tensor) for n in norms):
            return False
    return True


def _decoder_parts(model):
    """(embed, layers, final norm, lm_head, rotary) of a Llama-style causal LM, or a ValueError."""
    lm = _unwrap(model)
    inner = getattr(lm, "model", None)
    parts = [getattr(inner, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb")]
    head = getattr(lm, "lm_head", None)
    attn = getattr(parts[1][0], "self_attn", None) if parts[1] is not None and len(parts[1]) else None
    if any(p is None for p in parts) or head is None or attn is None or not all(
        hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    ):
        raise ValueError(
            f"FastGenerator: {type(lm).__name__} is not a Llama-style decoder (model.embed_tokens, "
            "model.layers[i].self_attn.{q,k,v,o}_proj, model.norm, model.rotary_emb, lm_head); "
            "use tasks.ppo.generation.generate for this model"
        )
    if getattr(lm.config, "sliding_window", None) and getattr(lm.config, "use_sliding_window", True):
        raise ValueError(f"FastGenerator: sliding-window attention (config.sliding_window={lm.config.sliding_window}) is not supported")
    embed, layers, norm, rotary = parts
    return lm, embed, layers, norm, head, rotary


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
    supported model with unsharded parameters (strategy 'ddp'); 'on' wherever it can, else a ValueError."""
    if mode == "off":
        return False
    reason = unsupported_reason(config)
    if reason is None and strategy != "ddp":
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


class FastGenerator:
    """Rollouts for one model with a static cache of ``max_batch`` rows x ``max_len`` columns.

    ``use_cuda_graph``: capture the decode step (CUDA only; on CPU the same code runs eagerly).
    ``dtype``: cache and compute dtype (default: the parameters' dtype).
    ``check_every``: decode steps between host checks of "all rows finished" (a device sync);
    the tokens are the same for any value, only the number of wasted steps after the last EOS.
    ``compile``: torch.compile the two per-layer pieces of the decode step (default: on CUDA).
    A 0.4B decode step is ~35 small kernels a layer; the GPU time goes to their fixed cost, not
    to the weights, so fusing the norms, RoPE and SwiGLU is what makes the graph fast. Models
    with LoRA-wrapped or otherwise non-plain layers run the (uncompiled) module-call path.
    """

    def __init__(self, model, max_batch: int, max_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, use_cuda_graph: bool = True, check_every: int = 16,
                 compile: bool | None = None):
        self.model = model
        self.lm, self.embed, self.layers, self.norm, self.head, rotary = _decoder_parts(model)
        p0 = next(self.lm.parameters())
        self.device = torch.device(device) if device is not None else p0.device
        self.dtype = dtype or p0.dtype
        if self.device != p0.device:
            raise ValueError(f"FastGenerator: device ({self.device}) differs from the model's ({p0.device}); move the model first")
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        self.max_batch, self.max_len, self.check_every = int(max_batch), int(max_len), max(1, int(check_every))
        cfg = self.lm.config
        attn0 = self.layers[0].self_attn
        self.head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.scaling = getattr(attn0, "scaling", self.head_dim ** -0.5)

        kw = dict(device=self.device, dtype=self.dtype)
        shape = (self.max_batch, self.n_kv, self.max_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, **kw) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, **kw) for _ in self.layers]
        with torch.no_grad():  # the rotary table once, with the model's own rotary module
            pos = torch.arange(self.max_len, device=self.device)[None]
            cos, sin = rotary(torch.zeros((), **kw), pos)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # (max_len, head_dim)

        # static inputs of the captured step (sliced to the batch size of each graph)
        self._tok = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        self._col = torch.zeros(1, dtype=torch.long, device=self.device)
        self._valid = torch.zeros(self.max_batch, self.max_len, dtype=torch.bool, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None
        self._shadow: dict[str, Tensor] | None = None
        self._param_ptrs = self._pointers()
        if any(p.dtype != self.dtype for p in self.lm.parameters() if p.is_floating_point()):
            self._shadow = {n: p.detach().to(self.dtype) if p.is_floating_point() else p.detach()
                            for n, p in self.lm.named_parameters()}
        self.functional = _plain_layers(self.lm, self.layers)
        self._bind_weights()
        want_compile = self.device.type == "cuda" if compile is None else compile
        self._attn_in_step = torch.compile(_attn_in, dynamic=False) if want_compile and self.functional else _attn_in
        self._attn_out_step = torch.compile(_attn_out_mlp, dynamic=False) if want_compile and self.functional else _attn_out_mlp

    # ------------------------------------------------------------------ weights

    def _bind_weights(self) -> None:
        """Per-layer weight tuples for the functional path: the parameters themselves, or the shadow."""
        if not self.functional:
            return
        names = {id(p): n for n, p in self.lm.named_parameters()}
        src = self._shadow if self._shadow is not None else dict(self.lm.named_parameters())

        def w(t):
            return None if t is None else src[names[id(t)]].detach()

        self._w_embed, self._w_norm, self._w_head = w(self.embed.weight), w(self.norm.weight), w(self.head.weight)
        self._b_head = w(getattr(self.head, "bias", None))
        self._eps = self.norm.variance_epsilon
        self._w_layers = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qn, kn = (w(a.q_norm.weight), w(a.k_norm.weight)) if hasattr(a, "q_norm") else (None, None)
            self._w_layers.append((
                (w(layer.input_layernorm.weight), layer.input_layernorm.variance_epsilon,
                 w(a.q_proj.weight), w(a.q_proj.bias), w(a.k_proj.weight), w(a.k_proj.bias),
                 w(a.v_proj.weight), w(a.v_proj.bias), qn, kn),
                (w(a.o_proj.weight), w(a.o_proj.bias), w(layer.post_attention_layernorm.weight),
                 layer.post_attention_layernorm.variance_epsilon, w(m.gate_proj.weight), w(m.up_proj.weight),
                 w(m.down_proj.weight)),
            ))

    def _pointers(self) -> list[int]:
        return [p.data_ptr() for p in self.lm.parameters()]

    def refresh_weights(self) -> None:
        """Make the next decode use the model's current parameters.

        In-place updates need nothing (graphs read the same memory); this re-casts the shadow
        copy when there is one and drops the graphs if any parameter tensor was replaced.
        ``generate`` calls it first.
        """
        ptrs = self._pointers()
        if ptrs != self._param_ptrs:
            self._graphs.clear()
            self._param_ptrs = ptrs
            if self._shadow is not None:
                self._shadow = {n: p.detach().to(self.dtype) if p.is_floating_point() else p.detach()
                                for n, p in self.lm.named_parameters()}
            self._bind_weights()
            return
        if self._shadow is not None:
            with torch.no_grad():
                names = [n for n, p in self.lm.named_parameters() if p.is_floating_point()]
                params = dict(self.lm.named_parameters())
                torch._foreach_copy_([self._shadow[n] for n in names], [params[n].detach() for n in names])

    def _with_weights(self, fn, *args):
        if self._shadow is None or self.functional:
            return fn(*args)
        from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses

        with _reparametrize_module(self.lm, self._shadow, tie_weights=True):
            return fn(*args)

    # ------------------------------------------------------------------ the model, by hand

    def _forward(self, ids: Tensor, pos: Tensor, cols: Tensor, mask: Tensor) -> Tensor:
        """Hidden states -> logits of the last position: ids, pos (b, T); K/V written to ``cols``.

        mask: (b, 1, T, max_len) bool, True where query t may attend to cache column j.
        """
        b, T = ids.shape
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (b, 1, T, D)
        gqa = self.n_kv != self.n_heads
        if self.functional:
            attn_in, attn_out = (self._attn_in_step, self._attn_out_step) if T == 1 else (_attn_in, _attn_out_mlp)
            x = F.embedding(ids, self._w_embed)
            for i, (w_in, w_out) in enumerate(self._w_layers):
                q, k, v = attn_in(x, *w_in, cos, sin, self.n_heads, self.n_kv, self.head_dim)
                kc, vc = self.k_cache[i][:b], self.v_cache[i][:b]
                kc.index_copy_(2, cols, k)
                vc.index_copy_(2, cols, v)
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
                x = attn_out(x, o, *w_out)
            return F.linear(_rms(x[:, -1], self._w_norm, self._eps), self._w_head, self._b_head)
        x = self.embed(ids).to(self.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, T, self.n_heads, self.head_dim)
            k = attn.k_proj(h).view(b, T, self.n_kv, self.head_dim)
            v = attn.v_proj(h).view(b, T, self.n_kv, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self.k_cache[i][:b], self.v_cache[i][:b]
            kc.index_copy_(2, cols, k.to(self.dtype))
            vc.index_copy_(2, cols, v.to(self.dtype))
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(self.norm(x[:, -1]))

    def _prefill(self, input_ids: Tensor, attn: Tensor) -> Tensor:
        b, P = input_ids.shape
        cols = torch.arange(P, device=self.device)
        causal = cols[None, :] <= cols[:, None]  # (P, P)
        mask = torch.zeros(b, 1, P, self.max_len, dtype=torch.bool, device=self.device)
        mask[:, 0, :, :P] = (causal[None] & attn.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool, device=self.device)
        return self._with_weights(self._forward, input_ids, position_ids_from_mask(attn), cols, mask)

    def _step(self, b: int) -> Tensor:
        """One decode step from the static buffers: token ``_tok`` at position ``_pos``, column ``_col``."""
        valid = self._valid[:b]
        valid.index_fill_(1, self._col, True)
        return self._with_weights(self._forward, self._tok[:b, None], self._pos[:b, None], self._col, valid[:, None, None, :])

    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        if b not in self._graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture (cuBLAS handles, workspaces)
                for _ in range(2):
                    self._step(b)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                out = self._step(b)
            self._pool = g.pool()
            self._graphs[b] = (g, out)
        return self._graphs[b]

    # ------------------------------------------------------------------ rollout

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int, eos_token_id: int,
        pad_token_id: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
        generator: torch.Generator | None = None, greedy: bool = False,
        all_finished: Callable[[bool], bool] | None = None,
    ) -> Rollout:
        """Same contract and result as ``tasks.ppo.generation.generate`` (LEFT-padded (B, P) prompts).

        ``all_finished`` is asked every ``check_every`` steps instead of every step.
        """
        b, P = input_ids.shape
        N = max_new_tokens
        if b > self.max_batch or P + N > self.max_len:
            raise ValueError(
                f"FastGenerator: batch {b} x (prompt {P} + max_new_tokens {N}) does not fit the cache "
                f"(max_batch={self.max_batch}, max_len={self.max_len}); build it with larger sizes"
            )
        device = input_ids.device
        attn = attention_mask.long()
        responses = torch.full((b, N), pad_token_id, dtype=torch.long, device=device)
        resp_attn = torch.zeros((b, N), dtype=torch.long, device=device)
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        pad = torch.full((b,), pad_token_id, dtype=torch.long, device=device)

        was_training = self.model.training
        self.model.eval()
        try:
            self.refresh_weights()
            logits = self._prefill(input_ids, attn)
            self._valid[:b].zero_()
            self._valid[:b, :P] = attn.bool()
            self._pos[:b] = attn.sum(-1)
            self._col.fill_(P)
            step_fn = self._graph(b) if self.use_cuda_graph else None
            for step in range(N):
                token = sample_next(logits, temperature, top_k, top_p, generator, greedy)
                token = torch.where(finished, pad, token)
                responses[:, step] = token
                resp_attn[:, step] = (~finished).long()
                finished |= token == eos_token_id
                if step == N - 1:
                    break
                if (step + 1) % self.check_every == 0:
                    done = bool(finished.all())
                    if all_finished is not None:
                        done = bool(all_finished(done))
                    if done:
                        break
                self._tok[:b].copy_(token)
                if step > 0:
                    self._pos[:b] += 1
                    self._col += 1
                if step_fn is not None:
                    step_fn[0].replay()
                    logits = step_fn[1]
                else:
                    logits = self._step(b)
        finally:
            self.model.train(was_training)

        return Rollout(
            sequences=torch.cat([input_ids, responses], dim=1),
            attention_mask=torch.cat([attn, resp_attn], dim=1),
            action_mask=resp_attn.float(),
            ended_with_eos=(responses == eos_token_id).any(-1),
        )
