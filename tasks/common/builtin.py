"""The embedded default: a tiny Llama-style model, a byte-level BPE tokenizer trained offline,
and a small task whose preference is known, so every stage can show that learning happened.

The task: a prompt asks to describe a thing ("Describe the river."); a response names it and
gives three adjectives ("The river is calm, warm and dark."). Adjectives are positive or
negative; ``score_response`` is the checkable property (mean sentiment, in [-1, 1]). SFT data
mixes adjectives at random (score ~0), preference pairs prefer the higher score, so the reward
model can learn it and PPO should push the policy towards positive adjectives.

Nothing is downloaded: the tokenizer is trained here with ``tokenizers`` and the model is built
from a config with a fixed seed, then saved once to a local folder. From there on it is loaded
with the same ``from_pretrained`` path a real model takes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
BUILTIN_VERSION = "tiny-v1"

THINGS = [
    "cat", "dog", "river", "city", "garden", "robot", "ocean", "forest", "train", "book",
    "song", "mountain", "house", "bird", "island", "teacher", "market", "bridge", "lamp", "storm",
    "village", "horse", "window", "kitchen",
]
POSITIVE = ["bright", "kind", "calm", "warm", "happy", "gentle", "clean", "friendly", "lovely", "sunny", "joyful", "brave"]
NEGATIVE = ["dark", "cruel", "noisy", "cold", "sad", "harsh", "dirty", "rude", "ugly", "gloomy", "angry", "weak"]
PROMPT_TEMPLATES = ["Describe the {x}.", "Tell me about the {x}.", "What is the {x} like?"]
N_ADJ = 3

# The prompt/response rendering every stage uses for the built-in tokenizer (and its chat template).
PROMPT_FORMAT = "Human: {prompt}\nAssistant:"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}Human: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
SPECIAL = {"pad_token": "<|pad|>", "eos_token": "<|endoftext|>", "unk_token": "<|unk|>"}
MODEL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=256)

_WORD = re.compile(r"[a-z]+")


def score_response(text: str) -> float:
    """Mean sentiment of the adjectives in ``text``: +1 per positive, -1 per negative, / N_ADJ.

    Clipped to [-1, 1]. The ground truth the reward model learns and PPO evaluation reports.
    """
    words = _WORD.findall(text.lower())
    s = sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)
    return max(-1.0, min(1.0, s / N_ADJ))


def sentiment_reward(prompts: list[str], responses: list[str], **metadata) -> list[float]:
    """``score_response`` as a reward function (``ppo.rewards: [{kind: function, function:
    'tasks.common.builtin:sentiment_reward'}]``): the rule-based reward of the built-in task."""
    return [score_response(r) for r in responses]


def thing_reward(prompts: list[str], responses: list[str], thing: list[str], **metadata) -> list[float]:
    """1.0 when the response names the prompt's thing, else 0.0: a verifier against a reference
    column (``data.prompt_metadata: [thing]``), the shape of a reward with a reference answer."""
    return [float(t in _WORD.findall(r.lower())) for t, r in zip(thing, responses)]


def make_prompt(rng: random.Random) -> tuple[str, str]:
    thing = rng.choice(THINGS)
    return thing, rng.choice(PROMPT_TEMPLATES).format(x=thing)


def make_response(rng: random.Random, thing: str, n_positive: int) -> str:
    adjs = rng.sample(POSITIVE, n_positive) + rng.sample(NEGATIVE, N_ADJ - n_positive)
    rng.shuffle(adjs)
    return f"The {thing} is {adjs[0]}, {adjs[1]} and {adjs[2]}."


def generate_task(seed: int = 0, n_sft: int = 600, n_pairs: int = 600, n_prompts: int = 300, n_ptx: int = 300) -> dict:
    """Records of the built-in task in the formats data prep reads (see tasks/data/formats.py)."""
    rng = random.Random(seed)
    sft, pairs, prompts, ptx = [], [], [], []
    for _ in range(n_sft):
        thing, prompt = make_prompt(rng)
        sft.append({"prompt": prompt, "response": make_response(rng, thing, rng.randint(0, N_ADJ))})
    for _ in range(n_pairs):
        thing, prompt = make_prompt(rng)
        hi = rng.randint(1, N_ADJ)
        lo = rng.randint(0, hi - 1)
        pairs.append({"prompt": prompt, "chosen": make_response(rng, thing, hi), "rejected": make_response(rng, thing, lo)})
    for _ in range(n_prompts):
        thing, prompt = make_prompt(rng)
        prompts.append({"prompt": prompt, "thing": thing})  # `thing`: a metadata column (data.prompt_metadata)
    for _ in range(n_ptx):
        thing, _ = make_prompt(rng)
        ptx.append({"text": make_response(rng, thing, rng.randint(0, N_ADJ))})
    return {"sft": sft, "preference": pairs, "prompts": prompts, "ptx": ptx}


def write_task_files(out: str | Path, seed: int = 0) -> dict[str, Path]:
    """The built-in task as JSONL files (what a user's own data would look like)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, records in generate_task(seed).items():
        paths[name] = out / f"{name}.jsonl"
        with open(paths[name], "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return paths


def _corpus() -> list[str]:
    lines = []
    for name, records in generate_task(seed=12345).items():
        for r in records:
            if name == "prompts":  # its text only: the `thing` column is metadata, not text the tokenizer sees
                lines.append(PROMPT_FORMAT.format(prompt=r["prompt"]))
                continue
            lines += r.values()
    lines += [PROMPT_FORMAT.format(prompt=t.format(x=x)) for t in PROMPT_TEMPLATES for x in THINGS]
    lines += [" ".join(POSITIVE + NEGATIVE + THINGS), "Human: Assistant: The is , and ."]
    return lines


def build_tokenizer(vocab_size: int = 512, special: dict[str, str] = SPECIAL, extra_special: tuple[str, ...] = (),
                    chat_template: str = CHAT_TEMPLATE):
    """Byte-level BPE trained on the task's corpus, wrapped as a transformers fast tokenizer.

    ``special``: the named special tokens (pad may be the eos token); ``extra_special``: more
    special tokens (e.g. ChatML's ``<|im_start|>``, ``<|im_end|>``), each one id, never split.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(dict.fromkeys([*special.values(), *extra_special])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens=list(extra_special), **special)
    fast.chat_template = chat_template
    fast.padding_side = "right"
    return fast


def build_model(tokenizer, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def builtin_dir(name: str = "tiny", cache_dir: str | Path | None = None) -> Path:
    """Materialise ``builtin:<name>`` once (tokenizer + config + safetensors) and return its folder.

    The folder name carries a hash of this file, so changing the built-in model makes a new one.
    A file lock keeps concurrent Ray workers from building it twice.
    """
    from filelock import FileLock

    if name != "tiny":
        raise ValueError(f"model.pretrain 'builtin:{name}' is unknown: the built-in model is 'builtin:tiny'")
    src = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
    cache = Path(cache_dir or os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf")) / "builtin"
    out = cache / f"{BUILTIN_VERSION}-{src}"
    if (out / ".complete").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / ".complete").exists():
            return out
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out)
        model.save_pretrained(out)
        (out / ".complete").touch()
    return out
