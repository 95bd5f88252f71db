"""Which base model the pipeline starts from, and the one place that loads it.

``model.pretrain`` is ``builtin:tiny`` (the embedded default, built offline), a Hugging Face
name, or a local path. Every stage loads through ``load_tokenizer`` / ``load_causal_lm``, which
are plain ``from_pretrained`` calls; the built-in model is first materialised to a local folder.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from tasks.common.builtin import BUILTIN_PREFIX, builtin_dir

# PEFT 0.21 reads `model.is_gradient_checkpointing`, which transformers 5 deprecates: a notice from
# one library about the other, on every LoRA wrap, that no user of ours can act on. Every process
# that builds a model imports this module.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pretrain: str = Field(
        "builtin:tiny",
        description="Base model: 'builtin:tiny' (embedded, offline), a Hugging Face name (gpt2, facebook/opt-125m, ...) or a local path.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer name or path; defaults to `pretrain`.")
    revision: str | None = Field(None, description="Model revision (branch, tag or commit) for hub names.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype: 'auto' is bf16 on a GPU that supports it, fp32 on CPU."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off: safer).")

    @field_validator("pretrain")
    @classmethod
    def _pretrain_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model.pretrain is empty: use 'builtin:tiny', a hub name or a local path")
        return v

    @property
    def is_builtin(self) -> bool:
        return self.pretrain.startswith(BUILTIN_PREFIX)

    def path(self) -> str:
        """What to hand ``from_pretrained``: a local folder for builtin models, else the name."""
        if self.is_builtin:
            return str(builtin_dir(self.pretrain[len(BUILTIN_PREFIX):]))
        return self.pretrain

    def identity(self) -> dict:
        """What makes this base model what it is, for cache keys."""
        if self.is_builtin:
            return {"pretrain": f"{self.pretrain}@{Path(self.path()).name}", "dtype": self.dtype}
        return {"pretrain": self.pretrain, "revision": self.revision, "tokenizer": self.tokenizer, "dtype": self.dtype}


def check_model_exists(cfg: ModelConfig) -> None:
    """Fail early, before any training starts, when ``model.pretrain`` cannot be resolved."""
    if cfg.is_builtin:
        cfg.path()
        return
    p = Path(cfg.pretrain).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise ValueError(f"model.pretrain {cfg.pretrain!r}: the folder has no config.json; point it at a saved Hugging Face model")
        return
    if cfg.pretrain.startswith((".", "/", "~")):
        raise ValueError(f"model.pretrain {cfg.pretrain!r}: no such folder; give an existing local path, a hub name or 'builtin:tiny'")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(cfg.pretrain, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # OSError for unknown names / no network; the message says which
        raise ValueError(
            f"model.pretrain {cfg.pretrain!r} could not be resolved ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "give a local path to a saved model, a hub name reachable from here, or 'builtin:tiny'"
        ) from None


def torch_dtype(cfg: ModelConfig, device: str):
    import torch

    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(cfg: ModelConfig, path: str | None = None):
    """The tokenizer, with a pad token (eos where it has none, as the seeds do; unk for llama)."""
    from transformers import AutoTokenizer

    name = path or cfg.tokenizer or cfg.path()
    tok = AutoTokenizer.from_pretrained(name, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token if getattr(tok, "unk_token", None) and "llama" in type(tok).__name__.lower() else tok.eos_token
    if tok.pad_token is None:
        field = "model.tokenizer" if cfg.tokenizer else "model.pretrain"
        raise ValueError(f"{field}: the tokenizer of {name!r} has neither pad, unk nor eos token; "
                         "set model.tokenizer to one that has (or save this one with a pad_token)")
    return tok


def turn_end_id(tok) -> int | None:
    """The special token the chat template writes right after an assistant message's content:
    ``<|im_end|>`` (ChatML), ``<|eot_id|>`` (Llama 3), ``<end_of_turn>`` (Gemma), or eos itself
    (templates that end turns with ``eos_token``). None without a chat template, or when the
    template writes plain text there. It is what a chat model emits to end its answer, so SFT
    sequences end at it (``tasks.data.encode``) and PPO rollouts stop on it."""
    from jinja2 import TemplateError

    if not getattr(tok, "chat_template", None):
        return None
    mark = "Zq7TurnEndProbe"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": mark}], tokenize=False)
    except (TemplateError, ValueError):  # a template that refuses this conversation shape: no probe
        return None
    if mark not in text:
        return None
    # lstrip: templates such as Llama 2's write "{{ content }} {{ eos_token }}"
    after = tok(text[text.rindex(mark) + len(mark):].lstrip(), add_special_tokens=False)["input_ids"]
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return after[0] if after and after[0] in special else None


def model_stop_ids(cfg: ModelConfig, tok) -> list[int]:
    """The ids that end a response of this model, first seen first: the tokenizer's eos,
    ``generation_config.eos_token_id`` (an int or a list; instruct models list their turn end
    there, e.g. Llama 3's ``<|eot_id|>``; read from generation_config.json, else config.json) and
    the chat template's turn end (``turn_end_id``). Reads json files only, no weights."""
    from transformers import AutoConfig, GenerationConfig

    try:
        listed = GenerationConfig.from_pretrained(cfg.path(), revision=cfg.revision).eos_token_id
    except OSError:  # no generation_config.json: the model config's eos
        config = AutoConfig.from_pretrained(cfg.path(), revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        listed = getattr(config, "eos_token_id", None)
    listed = listed if isinstance(listed, (list, tuple)) else [listed]
    ids = [tok.eos_token_id, *listed, turn_end_id(tok)]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def no_cudnn_attention(device: str) -> None:
    """Keep torch's attention (SDPA) off its cuDNN backend in a process that puts a model on CUDA.

    cuDNN's SDPA backward returns NaN query gradients for a query row whose logsumexp is below
    about -88.7, which every left-pad row of a PPO batch has (no key to attend); the forward is
    fine, so the loss is finite and the gradient norm NaN (seen on the H200 with torch 2.11: both
    PPO learners at their first step, issue 18; pytorch/pytorch#196678, huggingface/trl#7181).
    Flash and memory-efficient attention are clean on the same inputs and take over. A
    process-wide switch, set where models are loaded: every forward of the process is covered."""
    if device.startswith("cuda"):
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)


def load_causal_lm(cfg: ModelConfig, device: str = "cpu", path: str | None = None):
    from transformers import AutoModelForCausalLM

    no_cudnn_attention(device)
    return AutoModelForCausalLM.from_pretrained(
        path or cfg.path(), revision=cfg.revision, dtype=torch_dtype(cfg, device),
        trust_remote_code=cfg.trust_remote_code,
    ).to(device)


def pick_device(requested: str = "auto") -> str:
    """'auto' -> cuda when there is a GPU, else cpu. An explicit 'cuda' without one is an error."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} asked for, but torch sees no CUDA GPU here; use 'auto' or 'cpu'")
    return requested


def placement_record(device: str) -> dict:
    """Where this process trained, for a manifest: the torch device, the Ray resources assigned
    to it (None outside Ray: a direct call) and the GPU's name on CUDA."""
    import torch

    rec: dict = {"device": device, "ray_resources": None}
    try:
        import ray

        if ray.is_initialized():
            rec["ray_resources"] = ray.get_runtime_context().get_assigned_resources()
    except (ImportError, AssertionError):  # AssertionError: a Ray driver, which has no assigned resources
        pass
    if device.startswith("cuda"):
        rec["gpu"] = torch.cuda.get_device_name()
    return rec


# 'auto' activation checkpointing: on for CUDA models above this many parameters, where the
# activations of a realistic batch (64 x 512 tokens) outgrow what recomputing them costs
CHECKPOINT_AUTO_PARAMS = 1e9


def _bare_switch(v):
    """YAML 1.1 reads a bare on / off (``--set ppo.compile=off``, ``compile: off`` in a config
    file) as a bool: take True / False as 'on' / 'off'."""
    return ("on" if v else "off") if isinstance(v, bool) else v


Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_bare_switch)]  # a config field of 'auto' / 'on' / 'off'
CHECKPOINT_HELP = ("Activation (gradient) checkpointing of every transformer block: its activations are recomputed in the "
                   "backward pass instead of kept (about a third more compute; memory of one block's activations instead "
                   "of all). 'auto' = on for CUDA models over 1B parameters, 'on', 'off'.")


RECOMPILE_LIMIT = 64


def allow_recompiles() -> None:
    """Raise dynamo's limit of versions per compiled function in a process (8) to ``RECOMPILE_LIMIT``:
    past it a function compiled with ``fullgraph=True`` fails and any other silently runs eagerly.
    The learners' compiled blocks (``tasks.ppo.group.compile_blocks``) and FastGenerator's compiled
    decode layer (one version per batch size until the batch turns symbolic, one per dtype, per
    split count of the decode attention) both reach it."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def transformer_blocks(model) -> list:
    """The model's transformer blocks (the classes its ``_no_split_modules`` names): the units
    FSDP2 shards, ``torch.compile`` compiles and activation checkpointing recomputes one by one."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def checkpoint_blocks(model, mode: str, device: str) -> bool:
    """Activation checkpointing per transformer block (``mode``: see ``CHECKPOINT_HELP``); returns
    whether it is on. Non-reentrant ``torch.utils.checkpoint`` whenever grad is enabled, in eval
    mode too (the PPO learners run in eval mode; HF's ``gradient_checkpointing_enable`` acts only
    in train mode); no-grad forwards (generation with a KV cache, scoring) run the block as is.
    The recomputation replays the RNG state, so results equal the plain forward's."""
    import torch
    from torch.utils.checkpoint import checkpoint

    n = sum(p.numel() for p in model.parameters())
    if not (mode == "on" or (mode == "auto" and device.startswith("cuda") and n > CHECKPOINT_AUTO_PARAMS)):
        return False
    for block in transformer_blocks(model):
        def forward(*args, _forward=block.forward, **kwargs):
            if torch.is_grad_enabled():
                for k in ("cache", "past_key_values", "past_key_value"):  # a KV cache would be appended to twice (forward and
                    if k in kwargs:                               # recompute); a training forward reads none (SFT's
                        kwargs[k] = None                          # forward leaves use_cache at the config's True)
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        block.forward = forward
    return True
