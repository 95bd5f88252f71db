"""The reward model: a transformer body + a scalar value head, and its artifact format.

``RewardModel.forward`` scores a sequence at its last attended token (the last 1 of its
attention mask: a response's EOS or turn-end token, a rollout's first stop token), found from the
mask, never by comparing ids to ``pad_token_id`` (which may equal ``eos_token_id``); ``values``
gives the head's output at every token, which the PPO critic (initialised from the reward model) uses. The
artifact is ``model.safetensors`` (the full state dict, LoRA merged) + ``config.json`` (the
body's config plus a ``reward_head`` entry) + ``tokenizer/``; ``load_reward_model`` rebuilds it
in one call without pickle.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import shutil
from pathlib import Path

import torch
from torch import nn

HEAD_FORMAT = 1


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B,) long: position of each row's last non-pad token.

    Works for right, left or mixed padding: the largest position t with mask[t] == 1 (for right
    padding that is mask.sum(-1) - 1). Rows must hold at least one token.
    """
    T = attention_mask.shape[-1]
    positions = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, -1).max(-1).values


class RewardModel(nn.Module):
    """``body`` (an AutoModel: the transformer without its LM head) + ``Linear(hidden, 1)``."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.config = body.config
        hidden = body.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(hidden + 1))
        nn.init.zeros_(self.head.bias)
        base = body.get_base_model() if hasattr(body, "get_base_model") else body
        # Position ids from the mask make scores independent of left padding (bloom has none: alibi).
        params = inspect.signature(base.forward).parameters
        self._positions = "position_ids" in params
        # no KV cache: nothing reads it, and its per-layer index defeats compiled blocks
        self._no_cache = {"use_cache": False} if "use_cache" in params else {}

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, head: nn.Module | None = None,
               **packed) -> torch.Tensor:
        """(B, T) ids and 0/1 mask -> (B, T) float: the head's output at every token (``head``:
        another head on the same body, e.g. the frozen reward head beside a LoRA critic's).
        Positions come from the mask; or, for packed rows, mask None and ``packed`` the forward's
        keyword arguments (``position_ids`` and more: tasks/ppo/packing.py ``forward_packed``)."""
        head = self.head if head is None else head
        kwargs = {**self._no_cache, **packed}
        if not packed and self._positions:
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return head(hidden.to(head.weight.dtype)).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """(B, T) ids and 0/1 mask -> (B,) score read at each row's last attended token."""
        if not bool((attention_mask.sum(-1) > 0).all()):
            raise ValueError("RewardModel: a row of attention_mask is all padding; every sequence needs a token to score")
        idx = last_token_index(attention_mask)
        return self.values(input_ids, attention_mask, head).gather(1, idx[:, None]).squeeze(1)


class _LoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


def build_reward_model(model_cfg, device: str = "cpu", lora=None) -> RewardModel:
    """A fresh reward model on ``model_cfg``'s pretrained body; ``lora`` (a LoraConfig) wraps the body."""
    from transformers import AutoModel

    from tasks.common.model import no_cudnn_attention, torch_dtype

    # 'auto' keeps fp32 master weights for full-parameter training (autocast gives bf16 compute on
    # CUDA): AdamW on bf16 parameters loses small updates. With LoRA the frozen body is bf16 on
    # CUDA; PEFT keeps the adapter weights (and so their optimizer state) in fp32.
    dtype = torch.float32 if model_cfg.dtype == "auto" and lora is None else torch_dtype(model_cfg, device)
    # The body comes from a causal LM's checkpoint, so its LM head is left over by design, and
    # transformers prints a load-report table saying so on every load. Its report is held back;
    # anything else it would have reported becomes our warning (errors still raise in transformers).
    no_cudnn_attention(device)
    report = logging.getLogger("transformers.modeling_utils")
    hold_back = _LoadReport()
    report.addFilter(hold_back)
    try:
        body, info = AutoModel.from_pretrained(model_cfg.path(), revision=model_cfg.revision, dtype=dtype,
                                               trust_remote_code=model_cfg.trust_remote_code, output_loading_info=True)
    finally:
        report.removeFilter(hold_back)
    unexpected = sorted(k for k in info["unexpected_keys"] if k.split(".")[0] != "lm_head")
    if info["missing_keys"] or unexpected:
        logging.getLogger("rlhf.rm").warning("reward model body from %s: missing weights %s, unexpected weights %s",
                                             model_cfg.path(), sorted(info["missing_keys"]), unexpected)
    if lora is not None:
        from peft import get_peft_model

        body = get_peft_model(body, lora)
    return RewardModel(body).to(device)


def save_reward_model(model: RewardModel, out: str | Path, tokenizer_dir: str | Path | None = None,
                      extra: dict | None = None) -> None:
    """``model.safetensors`` (LoRA merged into the body) + ``config.json`` (+ ``tokenizer/``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    body = model.body.merge_and_unload() if hasattr(model.body, "merge_and_unload") else model.body
    state = {f"body.{k}": v for k, v in body.state_dict().items()}
    state.update({f"head.{k}": v for k, v in model.head.state_dict().items()})
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(out / "model.safetensors"))
    config = body.config.to_dict()
    config["reward_head"] = {"format": HEAD_FORMAT, "class": "tasks.rm.model.RewardModel", "hidden_size": body.config.hidden_size,
                             "score_at": "last_attended_token", **(extra or {})}
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True, default=str))
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, out / "tokenizer")


def load_reward_model(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> RewardModel:
    """The reward model saved by ``save_reward_model`` at ``path``, in one call (no pickle)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel

    path = Path(path)
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"load_reward_model({str(path)!r}): needs config.json and model.safetensors (a reward_model artifact folder)")
    config = AutoConfig.from_pretrained(str(path))
    head = getattr(config, "reward_head", None)
    if not isinstance(head, dict) or head.get("format") != HEAD_FORMAT:
        raise ValueError(f"{path}/config.json has no reward_head entry of format {HEAD_FORMAT}: "
                         "not written by tasks.rm.model.save_reward_model; retrain the reward model")
    model = RewardModel(AutoModel.from_config(config))
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)
