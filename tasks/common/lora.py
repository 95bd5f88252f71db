"""Which modules LoRA wraps, checked against the model's own module names before any weights load.

``target_modules="auto"`` picks the attention and MLP projections per architecture (the names
each family's modelling code uses); unknown families fall back to PEFT's ``"all-linear"``. An
explicit list is checked against a weightless skeleton of the model (built on the ``meta``
device from its config), so a typo fails in a second with the names that do exist, not after
the model is loaded and PEFT raises deep inside ``get_peft_model``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Sequence

from tasks.common.model import ModelConfig

_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
AUTO_TARGETS: dict[str, list[str]] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "bloom": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}
ALL_LINEAR = "all-linear"


def model_skeleton(model_cfg: ModelConfig, body_only: bool = False):
    """The model built from its config on the ``meta`` device: module names, no weights."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_cfg.path(), revision=model_cfg.revision,
                                        trust_remote_code=model_cfg.trust_remote_code)
    auto = AutoModel if body_only else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=model_cfg.trust_remote_code)


def leaf_names(model) -> list[str]:
    """Last name component of every module without children (what PEFT targets match on)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and not list(m.children())})


def resolve_target_modules(requested: Sequence[str] | Literal["auto"], model, builtin: bool = False,
                           field: str = "sft.target_modules") -> list[str] | str:
    """The LoRA targets for ``model``: the per-architecture list for 'auto', else ``requested``
    checked against the model's module names. Raises ValueError naming the missing ones.

    For the built-in model 'auto' adds ``lm_head``: it is untrained (N(0, 0.02) init), so its
    frozen output layer bounds every logit by about |w_row| |h| ~ 0.16 x 8, and no adapter in the
    layers below can take the loss under ~5.3 nats (ln 479 = 6.2). Real models do not need it.
    """
    if requested == "auto":
        targets = AUTO_TARGETS.get(getattr(model.config, "model_type", None))
        if targets is None:
            return ALL_LINEAR
        if builtin:
            targets = [*targets, "lm_head"]
    elif requested in (ALL_LINEAR, [ALL_LINEAR]):
        return ALL_LINEAR
    else:
        targets = list(requested)
        if not targets:
            raise ValueError(f"{field} is empty: give module names (e.g. ['q_proj', 'v_proj']) or 'auto'")
    names = {name for name, _ in model.named_modules() if name}
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"{field} {targets!r}: {missing!r} not found in {type(model).__name__} "
            f"(model_type {getattr(model.config, 'model_type', '?')!r}); its module names are "
            f"{leaf_names(model)}; use some of those or 'auto'"
        )
    return targets


def lora_config(cfg, targets: list[str] | str, task_type: str | None = "CAUSAL_LM"):
    """PEFT LoraConfig from a stage config with ``lora_rank``, ``lora_alpha``, ``lora_dropout``."""
    from peft import LoraConfig

    return LoraConfig(task_type=task_type, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                      lora_dropout=cfg.lora_dropout, target_modules=targets)


def save_adapter(model, out: str | Path, **kwargs) -> None:
    """``model.save_pretrained(out)`` with an ``adapter_config.json`` that has the same bytes in every
    process: PEFT keeps ``target_modules`` (and ``exclude_modules``) as sets and writes them in set
    order, which follows the process's string hash seed (PYTHONHASHSEED), so two builds of one key
    wrote different files. Sorted here; PEFT reads them back as sets."""
    model.save_pretrained(str(out), **kwargs)
    for path in Path(out).rglob("adapter_config.json"):
        config = json.loads(path.read_text())
        for field in ("target_modules", "exclude_modules"):
            if isinstance(config.get(field), list):
                config[field] = sorted(config[field])
        path.write_text(json.dumps(config, indent=2, sort_keys=True))
