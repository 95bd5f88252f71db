"""Using what the pipeline made: find a stage's artifact, export it as a Hugging Face model,
sample from it, list the store (``rlhf export``, ``rlhf generate``, ``rlhf ls``).

Plain functions over an ``ArtifactStore``; the CLI only parses arguments and prints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from storage.store import ArtifactStore
from tasks.common.model import ModelConfig

KINDS = {"data": "dataset", "sft": "sft_adapter", "rm": "reward_model", "ppo": "ppo_actor"}
POLICIES = ("sft", "ppo")  # the stages whose artifact is a causal LM (a LoRA adapter on the base)


def find_artifact(store: ArtifactStore, stage: str, run: str = "latest") -> str:
    """The key of ``stage``'s artifact: the newest one (``latest``), or the one whose key is
    ``run`` or ends with it (a key, its hash, or a unique prefix of the hash)."""
    if stage not in KINDS:
        raise ValueError(f"--stage {stage!r} is not a stage: use one of {list(KINDS)}")
    keys = [k for k in store.list(stage) if store.manifest(k)["kind"] == KINDS[stage]]
    if not keys:
        raise ValueError(f"--stage {stage}: the store {store.uri} holds no {KINDS[stage]} artifact; run the pipeline "
                         "first (rlhf run) or point --set store.uri at the store it wrote")
    if run == "latest":
        return max(keys, key=lambda k: (store.manifest(k)["created_at"], k))
    found = [k for k in keys if k == run or k.rsplit("/", 1)[-1].startswith(run.rsplit("/", 1)[-1])]
    if len(found) != 1:
        raise ValueError(f"--run {run!r} matches {len(found)} {stage} artifacts in {store.uri}; "
                         f"give 'latest' or one of: {', '.join(k.rsplit('/', 1)[-1][:12] for k in keys)}")
    return found[0]


def base_model(store: ArtifactStore, key: str) -> ModelConfig:
    """The base model an adapter artifact was trained on: the SFT artifact's config (PPO's
    lineage leads to it through its ``sft`` input)."""
    m = store.manifest(key)
    if m["kind"] == KINDS["ppo"]:
        root = store.uri_of("x")[:-1]
        sft_uri = m["input_uris"]["sft"]
        if not sft_uri.startswith(root):
            raise ValueError(f"{store.uri_of(key)}: its SFT input {sft_uri} is in another store; fetch it into this one")
        return base_model(store, sft_uri[len(root):])
    return ModelConfig.model_validate(m["config"]["model"])


def _check_policy(store: ArtifactStore, key: str) -> str:
    kind = store.manifest(key)["kind"]
    if kind not in (KINDS[s] for s in POLICIES):
        raise ValueError(f"{store.uri_of(key)} is a {kind!r} artifact, not a policy: use --stage sft or --stage ppo "
                         "(the reward model loads with tasks.rm.model.load_reward_model(path))")
    return kind


def load_policy(store: ArtifactStore, key: str, merge: bool = True):
    """(model, tokenizer) of an SFT or PPO artifact on CPU: the base with its LoRA adapter
    (merged into the weights when ``merge``)."""
    from peft import PeftModel

    from tasks.common.model import load_causal_lm, load_tokenizer

    _check_policy(store, key)
    path = store.fetch(key)
    cfg = base_model(store, key)
    model = PeftModel.from_pretrained(load_causal_lm(cfg), str(path / "adapter")).eval()
    return (model.merge_and_unload() if merge else model), load_tokenizer(cfg, str(path / "tokenizer"))


def generation_config(model, tokenizer):
    """The base model's generation config, with every stop token the tokenizer and the base know
    (eos of the tokenizer first) and the tokenizer's pad token."""
    from transformers import GenerationConfig

    gen = model.generation_config if getattr(model, "generation_config", None) is not None else GenerationConfig()
    base_eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    stops = list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *base_eos] if i is not None))
    gen.eos_token_id = stops if len(stops) > 1 else stops[0]
    gen.pad_token_id = tokenizer.pad_token_id
    return gen


def export_model(store: ArtifactStore, key: str, out: str | Path, adapter_only: bool = False) -> Path:
    """Write a Hugging Face folder: the merged full model (``AutoModelForCausalLM.from_pretrained``),
    or with ``adapter_only`` the PEFT adapter (``PeftModel.from_pretrained`` on the base); both with
    the tokenizer and a generation config carrying the stop tokens."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {str(out)!r} exists and is not empty: give a new folder")
    _check_policy(store, key)
    model, tok = load_policy(store, key, merge=not adapter_only)
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        shutil.copytree(store.fetch(key) / "adapter", out, dirs_exist_ok=True)
        gen = generation_config(model.get_base_model(), tok)
    else:
        gen = generation_config(model, tok)
        model.generation_config = gen
        model.save_pretrained(str(out))
    gen.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "rlhf_source.json").write_text(json.dumps({"artifact": store.uri_of(key), "base_model": base_model(store, key).model_dump(mode="json")}, indent=1))
    return out


def generate(store: ArtifactStore, key: str, prompts: list[str], max_new_tokens: int = 48, greedy: bool = False,
             seed: int = 0) -> list[str]:
    """Responses of an SFT or PPO artifact's policy to ``prompts`` (sampled, or greedy)."""
    import torch

    model, tok = load_policy(store, key)
    gen = generation_config(model, tok)
    torch.manual_seed(seed)
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")
        with torch.no_grad():
            seq = model.generate(**ids, generation_config=gen, max_new_tokens=max_new_tokens, do_sample=not greedy)
        out.append(tok.decode(seq[0, ids.input_ids.shape[1]:], skip_special_tokens=True))
    return out


HEADLINE = {"dataset": (), "sft_adapter": ("sft/eval_loss_start", "sft/eval_loss"),
            "reward_model": ("rm/eval_accuracy_start", "rm/eval_accuracy"),
            "ppo_actor": ("eval/rm_score_before", "eval/rm_score_after", "eval/true_score_after", "eval/kl_after")}


def list_artifacts(store: ArtifactStore) -> list[dict]:
    """One row per final artifact (no checkpoints), oldest first: stage, key, kind, created time,
    inputs (stage -> key, the lineage) and headline metrics."""
    root = store.uri_of("x")[:-1]
    rows = []
    for key in store.list():
        m = store.manifest(key)
        if m["kind"] not in KINDS.values():
            continue
        rows.append({"stage": key.split("/", 1)[0], "key": key, "kind": m["kind"], "created_at": m["created_at"],
                     "inputs": {n: u[len(root):] if u.startswith(root) else u for n, u in m.get("input_uris", {}).items()},
                     "metrics": {k: m["metrics"][k] for k in HEADLINE[m["kind"]] if k in m["metrics"]}})
    return sorted(rows, key=lambda r: (r["created_at"], r["key"]))


def format_ls(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        short = r["key"].rsplit("/", 1)[-1][:12]
        inputs = " ".join(f"{n}={k.rsplit('/', 1)[-1][:12]}" for n, k in r["inputs"].items()) or "-"
        metrics = " ".join(f"{k}={v:.4g}" for k, v in r["metrics"].items())
        lines.append(f"{r['created_at'][:19]}Z  {r['stage']:4s} {short}  inputs: {inputs}  {metrics}".rstrip())
    return "\n".join(lines)
