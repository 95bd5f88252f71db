"""Do the PPO inputs and outputs cross between this environment and one pinned to ColossalAI 0.5's
versions (transformers 4.51.3, peft 0.13.2)? Run by two interpreters over one folder (issue 19):

    PYTHONPATH=$PWD .venv/bin/python bench/cross_env_adapter.py write  DIR    # ours: built-in base + an SFT-shaped adapter
    OTHER_PYTHON               bench/cross_env_adapter.py read   DIR    # pinned env: load both, logits vs ours; write its own adapter
    PYTHONPATH=$PWD .venv/bin/python bench/cross_env_adapter.py back   DIR    # ours: load the pinned env's adapter, logits vs its
    PYTHONPATH=$PWD .venv/bin/python bench/cross_env_adapter.py ray    DIR OTHER_PYTHON   # `read` in a Ray actor on OTHER_PYTHON

`write` needs this project (the built-in model and ``tasks.sft.lora.lora_config``); `read` needs
only torch, transformers and peft, as a ColossalAI environment has them. The adapter's LoRA B is
set non-zero so the logits depend on it. Each step prints one JSON line: versions, what loaded,
the max |logit difference| against the other environment's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

IDS = [[1, 5, 9, 17, 33, 65, 129, 257, 3, 4, 6, 8]]


def versions() -> dict:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits.float()


def write(d: Path) -> dict:
    from peft import get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tasks.common.model import ModelConfig
    from tasks.sft.config import SFTConfig
    from tasks.sft.lora import lora_config, model_skeleton, resolve_target_modules

    cfg = ModelConfig()
    base = AutoModelForCausalLM.from_pretrained(cfg.path(), dtype=torch.float32)
    base.save_pretrained(d / "base")  # as written by this environment's transformers
    sft = SFTConfig()
    targets = resolve_target_modules(sft.target_modules, model_skeleton(cfg), builtin=True, field="sft.target_modules")
    model = get_peft_model(base, lora_config(sft, targets)).eval()
    g = torch.Generator().manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    model.save_pretrained(d / "adapter_ours")
    save_file({"logits": logits(model)}, d / "logits_ours.safetensors")
    return {"step": "write", **versions(), "adapter_config": json.loads((d / "adapter_ours" / "adapter_config.json").read_text())}


def narrowed(src: Path, dst: Path, out: dict) -> Path:
    """A copy of adapter ``src`` whose adapter_config.json keeps only the fields this peft's
    LoraConfig has; ``out`` records the dropped ones, and which of them were not at their
    off value (dropping those would change what the adapter computes)."""
    import dataclasses
    import shutil

    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    cfg = json.loads((src / "adapter_config.json").read_text())
    dropped = {k: v for k, v in cfg.items() if k not in known}
    shutil.copytree(src, dst, dirs_exist_ok=True)
    (dst / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k in known}, indent=2))
    out["dropped_config_fields"] = sorted(dropped)
    out["dropped_fields_not_off"] = {k: v for k, v in dropped.items() if v not in (None, False, {}, [], "megatron.core")}
    return dst


def read(d: Path) -> dict:
    from peft import PeftModel, get_peft_model
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    out: dict = {"step": "read", **versions()}
    base = AutoModelForCausalLM.from_pretrained(d / "base", torch_dtype=torch.float32)
    out["base_loaded"] = type(base).__name__
    try:
        model = PeftModel.from_pretrained(base, d / "adapter_ours").eval()
        out["adapter_ours_loads_as_written"] = True
    except TypeError as e:  # a newer peft's adapter_config.json has fields this LoraConfig does not know
        out["adapter_ours_loads_as_written"] = f"{type(e).__name__}: {e}"
        model = PeftModel.from_pretrained(base, narrowed(d / "adapter_ours", d / "adapter_ours_narrowed", out)).eval()
    theirs = load_file(d / "logits_ours.safetensors")["logits"]
    out["max_abs_logit_diff_vs_ours"] = float((logits(model) - theirs).abs().max())
    # its own adapter, written by this peft, for the way back
    base2 = AutoModelForCausalLM.from_pretrained(d / "base", torch_dtype=torch.float32)
    targets = json.loads((d / "adapter_ours" / "adapter_config.json").read_text())["target_modules"]
    mine = get_peft_model(base2, LoraConfig(r=8, lora_alpha=16, target_modules=targets)).eval()
    g = torch.Generator().manual_seed(1)
    for n, p in mine.named_parameters():
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    mine.save_pretrained(d / "adapter_pinned")
    save_file({"logits": logits(mine)}, d / "logits_pinned.safetensors")
    return out


def back(d: Path) -> dict:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tasks.common.model import ModelConfig

    base = AutoModelForCausalLM.from_pretrained(ModelConfig().path(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, d / "adapter_pinned").eval()
    theirs = load_file(d / "logits_pinned.safetensors")["logits"]
    return {"step": "back", **versions(), "max_abs_logit_diff_vs_pinned": float((logits(model) - theirs).abs().max())}


def ray_actor(d: Path, python: str) -> dict:
    """The supported path's mechanism: a driver in this environment starts a Ray actor whose
    interpreter is ``python`` (``runtime_env={"py_executable": ...}``, the pinned environment,
    which has the same Ray and Python), and the actor runs ``read`` there."""
    import os
    import tempfile

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # one local machine, as the tests run it

    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="rlhf-xenv-ray-"),
             runtime_env={"env_vars": {"PYTHONPATH": ""}})
    try:
        @ray.remote(num_cpus=1, runtime_env={"py_executable": python})
        class Pinned:
            def run(self, folder: str) -> dict:
                return {"sys.executable": sys.executable, **read(Path(folder))}

        return {"step": "ray", "driver": versions(), "actor": ray.get(Pinned.remote().run.remote(str(d)), timeout=600)}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    step, d = sys.argv[1], Path(sys.argv[2])
    d.mkdir(parents=True, exist_ok=True)
    if step == "ray":
        print(json.dumps(ray_actor(d, sys.argv[3])))
    else:
        print(json.dumps({"write": write, "read": read, "back": back}[step](d)))
