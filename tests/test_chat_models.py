"""Chat models as users bring them: a chat template, two stop ids, pad == eos.

The model is built here, offline, shaped like a ChatML instruct model (Qwen's layout): eos and
pad are both ``<|endoftext|>``, an assistant turn ends with ``<|im_end|>``, and its
``generation_config.json`` lists both as ``eos_token_id``. The tokenizer and the tiny random Llama
come from ``tasks/common/builtin.py``; only the special tokens and the template differ.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from pydantic import ValidationError

from tasks.common.builtin import build_model, build_tokenizer, generate_task
from tasks.common.model import ModelConfig, load_causal_lm, load_tokenizer, model_stop_ids, turn_end_id
from tasks.data.config import DataConfig
from tasks.data.dataset import collate_lm, collate_prompts, pad_batch, read_jsonl
from tasks.data.encode import Encoder
from tasks.data.prepare import prepare_data
from tasks.ppo.config import PPOConfig
from tasks.ppo.fast_generate import FastGenerator
from tasks.ppo.generation import generate
from tasks.ppo.losses import token_rewards
from tasks.ppo.train import resolve_stop_ids
from tasks.rm.model import build_reward_model
from tasks.sft.loss import causal_lm_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N = 12


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(ModelConfig of the saved chat model, its tokenizer, eot id, im_end id)."""
    from transformers import GenerationConfig

    out = tmp_path_factory.mktemp("chat-model")
    tok = build_tokenizer(special={"eos_token": EOT, "pad_token": EOT, "unk_token": "<|unk|>"},
                          extra_special=(IM_START, IM_END), chat_template=CHATML)
    model = build_model(tok)
    eot, im_end = tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)
    model.generation_config = GenerationConfig(eos_token_id=[eot, im_end], pad_token_id=eot, bos_token_id=eot)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [eot, im_end]
    cfg = ModelConfig(pretrain=str(out))
    return cfg, load_tokenizer(cfg), eot, im_end


def spans(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of labelled (not -100) tokens."""
    out, cur = [], []
    for i, lab in zip(ids, labels):
        if lab == -100:
            out, cur = (out + [cur] if cur else out), []
        else:
            assert lab == i
            cur.append(i)
    return out + [cur] if cur else out


# -- stop ids ------------------------------------------------------------------------------------
def test_stop_ids_come_from_the_model_and_the_config(chat, rlhf_cache):
    cfg, tok, eot, im_end = chat
    assert tok.pad_token_id == tok.eos_token_id == eot and turn_end_id(tok) == im_end
    assert model_stop_ids(cfg, tok) == [eot, im_end]  # eos first, then generation_config's list
    im_start = tok.convert_tokens_to_ids(IM_START)
    assert resolve_stop_ids(PPOConfig(stop_token_ids=[7, im_end], stop_strings=[IM_START]), cfg, tok) == [eot, im_end, 7, im_start]
    builtin = ModelConfig()
    assert model_stop_ids(builtin, load_tokenizer(builtin)) == [load_tokenizer(builtin).eos_token_id]  # its turns end with eos

    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"ppo.stop_token_ids \[5, 100000\]: \[100000\] not in the tokenizer's vocabulary "
                                         r"\(ids 0..\d+\); use ids of that tokenizer, or give the token as text in ppo.stop_strings"):
        resolve_stop_ids(PPOConfig(stop_token_ids=[5, 100000]), cfg, tok)
    with pytest.raises(ValueError, match=r"ppo.stop_strings entry '</answer>' is \d tokens .*not one: a stop string must be a "
                                         r"single token .*ppo.stop_token_ids"):
        resolve_stop_ids(PPOConfig(stop_strings=["</answer>"]), cfg, tok)
    assert time.perf_counter() - t < 5  # tokenizer and json files only
    with pytest.raises(ValidationError, match=r"ppo.stop_token_ids \[-1\]: token ids are >= 0"):
        PPOConfig(stop_token_ids=[-1])
    with pytest.raises(ValidationError, match=r"ppo.stop_strings \[''\]: an empty string can never be generated"):
        PPOConfig(stop_strings=[""])

    from flows.config import PipelineConfig
    from flows.preflight import check_tokenizer

    check_tokenizer(PipelineConfig(model=cfg.model_dump(), ppo={"stop_strings": [IM_END]}))
    with pytest.raises(ValueError, match=r"ppo.stop_strings entry 'STOP'"):  # `rlhf run` stops here, before data prep
        check_tokenizer(PipelineConfig(model=cfg.model_dump(), ppo={"stop_strings": ["STOP"]}))


# -- SFT -----------------------------------------------------------------------------------------
def test_sft_labels_only_on_assistant_turns_ending_at_the_turn_end(chat):
    """A chat sequence ends at <|im_end|> (what the model emits, and a stop id), with no
    <|endoftext|> after it; prompt/response records end with eos, which is also the pad token:
    collate_lm must keep that final eos as a label."""
    _, tok, eot, im_end = chat
    enc = Encoder(tok, DataConfig())
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe the cat."},
            {"role": "assistant", "content": "The cat is kind."}, {"role": "user", "content": "And the dog?"},
            {"role": "assistant", "content": "The dog is rude."}]
    ids, labels = enc.messages(msgs)
    assert [tok.decode(s) for s in spans(ids, labels)] == ["The cat is kind.<|im_end|>\n", "The dog is rude.<|im_end|>"]
    assert ids[-1] == im_end and eot not in ids
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False).removesuffix("\n")
    prompt, chosen, _ = enc.pair({"prompt_messages": msgs[:2], "chosen_messages": [msgs[2]], "rejected_messages": [msgs[4]]})
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n") and tok.decode(chosen) == "The cat is kind.<|im_end|>"

    records = [dict(zip(("input_ids", "labels"), enc.prompt_response(p, r)[:2]))
               for p, r in (("Describe the cat.", "The cat is kind."), ("Tell me about the storm.", "The storm is harsh, cold and sad."))]
    assert all(r["input_ids"][-1] == eot for r in records)
    batch = collate_lm(records, tok.pad_token_id)
    short = min(range(2), key=lambda i: len(records[i]["input_ids"]))
    n = len(records[short]["input_ids"])
    assert batch["input_ids"][short, n - 1] == eot and batch["labels"][short, n - 1] == eot  # the final eos is learned
    assert batch["attention_mask"][short].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    assert (batch["input_ids"][short, n:] == eot).all() and (batch["labels"][short, n:] == -100).all()  # padding is not
    logits = torch.randn(*batch["input_ids"].shape, len(tok))
    want = sum(sum(x != -100 for x in r["labels"]) for r in records)  # responses, each with its eos
    assert int(causal_lm_loss(logits, batch["labels"]).n_tokens) == want


# -- reward model --------------------------------------------------------------------------------
def test_reward_model_scores_the_last_real_token_with_pad_equal_eos(chat):
    cfg, tok, eot, im_end = chat
    enc = Encoder(tok, DataConfig())
    user = [{"role": "user", "content": "Describe the cat."}]
    p, c, r = enc.pair({"prompt": "Describe the river.", "chosen": "The river is calm.", "rejected": "The river is dark, cold and sad."})
    cp, cc, _ = enc.pair({"prompt_messages": user, "chosen_messages": [{"role": "assistant", "content": "The cat is kind."}],
                          "rejected_messages": [{"role": "assistant", "content": "Rude."}]})
    seqs = [p + c, p + r, cp + cc]
    assert [s[-1] for s in seqs] == [eot, eot, im_end]
    lengths = torch.tensor([len(s) for s in seqs])
    torch.manual_seed(0)
    rm = build_reward_model(cfg).eval()
    with torch.no_grad():
        ids, mask = pad_batch(seqs, tok.pad_token_id)
        score = rm(ids, mask)
        values = rm.values(ids, mask)
        torch.testing.assert_close(score, values[torch.arange(3), lengths - 1])  # at the eos / <|im_end|> itself
        more = torch.cat([ids, torch.full((3, 9), eot)], 1), torch.cat([mask, torch.zeros(3, 9, dtype=mask.dtype)], 1)
        torch.testing.assert_close(rm(*more), score, atol=1e-5, rtol=1e-5)  # padding more (with eos) changes nothing
        torch.testing.assert_close(rm(*pad_batch(seqs, tok.pad_token_id, side="left")), score, atol=1e-5, rtol=1e-5)
        # "the last token that is not pad" would score the eos-ending rows one token early
        by_pad = (ids != tok.pad_token_id).long().sum(-1) - 1
        assert by_pad[:2].tolist() == (lengths[:2] - 2).tolist()
        assert not torch.allclose(values[torch.arange(2), by_pad[:2]], score[:2])


# -- PPO rollouts --------------------------------------------------------------------------------
def _peaky(model):
    """Larger weights than the init, so greedy rows differ from each other (as test_fast_generate)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
    return model.eval()


def _prompts(tok, n: int = 6):
    enc = Encoder(tok, DataConfig())
    rows = generate_task(seed=3, n_prompts=n)["prompts"]
    ids = [enc.enc(enc.render_prompt({"messages": [{"role": "user", "content": r["prompt"]}]})) for r in rows]
    b = collate_prompts([{"prompt_ids": i} for i in ids], tok.pad_token_id)
    return b["input_ids"], b["attention_mask"]


def _forced(free: list[list[int]], t: int, u: int, eot: int, im_end: int, pad: int):
    """Expected rows once t's logit is moved to <|im_end|> and u's to <|endoftext|>: (responses, lengths)."""
    out, lengths = [], []
    for row in free:
        hits = [j for j, x in enumerate(row) if x in (t, u)]
        if not hits:
            out.append(row), lengths.append(len(row))
            continue
        j = hits[0]
        out.append(row[:j] + [im_end if row[j] == t else eot] + [pad] * (len(row) - j - 1))
        lengths.append(j + 1)
    return out, lengths


def _outcomes(rows: list[list[int]], lengths: list[int], eot: int, im_end: int) -> set[str]:
    """How the rows end: on <|im_end|>, on <|endoftext|>, or truncated at N."""
    return {{im_end: "im_end", eot: "eot"}.get(row[n - 1], "truncated") for row, n in zip(rows, lengths)}


def test_rollouts_stop_on_the_second_stop_id_with_the_score_there(chat):
    """Greedy rollouts of a model whose <|im_end|> (the second stop id) and <|endoftext|> (eos ==
    pad) logits were swapped with those of two tokens it emits mid-response: rows stop on
    <|im_end|>, on <|endoftext|>, or run to N; the action mask ends at (and includes) the stop,
    the reward lands there and the reward model reads it there. The static-cache decode agrees
    token for token, greedy and sampled (on the GPU where there is one: its CUDA graphs hold the stop ids)."""
    cfg, tok, eot, im_end = chat
    pad, stops = tok.pad_token_id, resolve_stop_ids(PPOConfig(), cfg, tok)
    assert stops == [eot, im_end]
    model = _peaky(load_causal_lm(cfg)).to(DEVICE)
    ids, mask = (x.to(DEVICE) for x in _prompts(tok))
    P = ids.shape[1]
    free = generate(model, ids, mask, max_new_tokens=N, eos_token_id=[], pad_token_id=pad, greedy=True).sequences[:, P:].tolist()
    assert not {eot, im_end} & {x for row in free for x in row}
    cands = sorted({x for row in free for x in row[1:]})
    pick = next(((t, u) for t in cands for u in cands
                 if t != u and _outcomes(*_forced(free, t, u, eot, im_end, pad), eot, im_end) == {"im_end", "eot", "truncated"}), None)
    assert pick is not None, free
    t, u = pick
    with torch.no_grad():  # relabel only the outputs: the prompts (which hold <|im_end|>) read as before
        w = model.lm_head.weight
        w[[t, im_end]] = w[[im_end, t]].clone()
        w[[u, eot]] = w[[eot, u]].clone()
    want, lengths = _forced(free, t, u, eot, im_end, pad)

    ro = generate(model, ids, mask, max_new_tokens=N, eos_token_id=stops, pad_token_id=pad, greedy=True)
    assert ro.sequences[:, P:].tolist() == want
    assert ro.action_mask.tolist() == [[1.0] * n + [0.0] * (N - n) for n in lengths]
    assert ro.ended_with_eos.tolist() == [row[n - 1] in stops for row, n in zip(want, lengths)]
    assert torch.equal(ro.attention_mask[:, P:].float(), ro.action_mask)
    old = generate(model, ids, mask, max_new_tokens=N, eos_token_id=tok.eos_token_id, pad_token_id=pad, greedy=True)
    stopped_on_im_end = [b for b, row in enumerate(want) if im_end in row]
    assert all(old.action_mask[b].sum() > lengths[b] for b in stopped_on_im_end)  # eos alone runs past <|im_end|>

    score = torch.arange(1.0, len(want) + 1, device=DEVICE)
    rewards = token_rewards(score, torch.zeros(len(want), N, device=DEVICE), ro.action_mask, kl_coef=0.1)
    assert [int(row.nonzero()[-1]) for row in rewards] == [n - 1 for n in lengths]
    torch.manual_seed(0)
    rm = build_reward_model(cfg).to(DEVICE).eval()
    with torch.no_grad():
        rm_score, values = rm(ro.sequences, ro.attention_mask), rm.values(ro.sequences, ro.attention_mask)
    torch.testing.assert_close(rm_score, values[torch.arange(len(want), device=DEVICE), P + torch.tensor(lengths, device=DEVICE) - 1])

    fg = FastGenerator(model, max_batch=8, max_len=P + N)
    fast = fg.generate(ids, mask, max_new_tokens=N, eos_token_id=stops, pad_token_id=pad, greedy=True)
    for field in ro._fields:
        assert torch.equal(getattr(fast, field), getattr(ro, field)), field
    for seed in (1, 2):
        # two more stop ids: the tokens this seed samples most often in the responses' second half
        free = generate(model, ids, mask, max_new_tokens=N, eos_token_id=[], pad_token_id=pad,
                        generator=torch.Generator(DEVICE).manual_seed(seed)).sequences[:, P + N // 2:]
        late = torch.bincount(free.flatten().cpu(), minlength=len(tok)).topk(2).indices.tolist()
        kw = dict(max_new_tokens=N, eos_token_id=stops + [x for x in late if x not in stops], pad_token_id=pad)
        a = generate(model, ids, mask, generator=torch.Generator(DEVICE).manual_seed(seed), **kw)
        b = fg.generate(ids, mask, generator=torch.Generator(DEVICE).manual_seed(seed), **kw)
        assert a.ended_with_eos.any(), (seed, kw["eos_token_id"], a.sequences[:, P:].tolist())
        for field in a._fields:
            assert torch.equal(getattr(a, field), getattr(b, field)), (seed, field)


# -- end to end ----------------------------------------------------------------------------------
def _chat_files(out) -> dict[str, str]:
    """The built-in task as chat data: messages for SFT, conversational pairs, message prompts."""
    task = generate_task(seed=0, n_sft=400, n_pairs=400, n_prompts=120, n_ptx=50)

    def turn(role, text):
        return [{"role": role, "content": text}]

    rows = {"sft": [{"messages": turn("user", r["prompt"]) + turn("assistant", r["response"])} for r in task["sft"]],
            "preference": [{"prompt": turn("user", r["prompt"]), "chosen": turn("assistant", r["chosen"]),
                            "rejected": turn("assistant", r["rejected"])} for r in task["preference"]],
            "prompts": [{"messages": turn("user", r["prompt"])} for r in task["prompts"]],
            "ptx": task["ptx"]}
    paths = {}
    for name, records in rows.items():
        paths[name] = str(out / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return paths


@pytest.mark.slow
def test_chat_model_through_data_sft_rm_and_ppo(chat, rlhf_cache, ray_cluster, tmp_path):
    """Data prep, SFT, reward model and PPO with the chat model on chat data. SFT sequences end at
    <|im_end|>, so the policy learns to end its answers there, and PPO's rollouts (the fast
    decode path, on CPU) stop on it: the second stop id, which eos alone would run past."""
    from peft import PeftModel

    from storage import ArtifactStore
    from tasks.ppo.train import train_ppo
    from tasks.rm.config import RewardConfig
    from tasks.rm.train import train_reward_model
    from tasks.sft.config import SFTConfig
    from tasks.sft.train import train_sft

    cfg, _, eot, im_end = chat
    files = _chat_files(tmp_path)
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    t = time.perf_counter()
    data = prepare_data(DataConfig(sft_path=files["sft"], preference_path=files["preference"], prompts_path=files["prompts"],
                                   ptx_path=files["ptx"]), cfg, store, 0)
    data_dir = store.fetch(data.key)
    tok = load_tokenizer(cfg, str(data_dir / "tokenizer"))
    assert all(r["input_ids"][-1] == im_end and eot not in r["input_ids"] for r in read_jsonl(data_dir / "sft_train.jsonl"))
    assert all(r["chosen_ids"][-1] == r["rejected_ids"][-1] == im_end for r in read_jsonl(data_dir / "pref_train.jsonl"))
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") for r in read_jsonl(data_dir / "prompts_eval.jsonl"))

    # the model is random like the built-in one: LoRA on lm_head too (see tasks/common/lora.py)
    sft = train_sft(SFTConfig(max_steps=60, eval_every=30, target_modules=[*LLAMA_TARGETS, "lm_head"]), cfg, store, data, 0)
    rm = train_reward_model(RewardConfig(max_steps=30, eval_every=30), cfg, store, data, 0)
    t_stages = time.perf_counter() - t
    ppo_cfg = PPOConfig(num_iterations=2, rollout_batch_size=16, train_batch_size=8, eval_every=2, eval_prompts=12,
                        fast_generate="on")
    ppo = train_ppo(ppo_cfg, cfg, store, data, sft, rm, 0)
    wall = time.perf_counter() - t
    sft_m, rm_m, ppo_m = (store.manifest(r.key)["metrics"] for r in (sft, rm, ppo))
    steps = [json.loads(line) for line in (store.fetch(ppo.key) / "metrics.jsonl").read_text().splitlines()]
    print(f"\nchat e2e: {wall:.1f}s ({t_stages:.1f}s data+sft+rm); sft eval loss {sft_m['sft/eval_loss_start']:.2f} -> "
          f"{sft_m['sft/eval_loss']:.2f}; rm accuracy {rm_m['rm/eval_accuracy_start']:.2f} -> {rm_m['rm/eval_accuracy']:.2f}; "
          f"ppo stop fraction {[h.get('ppo/eos_fraction') for h in steps]}, eval length "
          f"{[h.get('eval/response_length') for h in steps if 'eval/response_length' in h]}")
    assert sft_m["sft/eval_loss"] < sft_m["sft/eval_loss_start"] - 2.0
    assert rm_m["rm/eval_accuracy"] > rm_m["rm/eval_accuracy_start"]
    rollouts = [h for h in steps if "ppo/eos_fraction" in h]
    assert len(rollouts) == 2 and all(h["ppo/eos_fraction"] > 0.7 for h in rollouts)
    assert all(h["eval/response_length"] < ppo_cfg.max_new_tokens for h in steps if "eval/response_length" in h)

    # the trained policy ends its answers with <|im_end|>; with eos alone as the stop it runs on
    policy = PeftModel.from_pretrained(load_causal_lm(cfg), str(store.fetch(ppo.key) / "adapter")).eval()
    batch = collate_prompts(read_jsonl(data_dir / "prompts_eval.jsonl")[:12], tok.pad_token_id)
    kw = dict(max_new_tokens=ppo_cfg.max_new_tokens, pad_token_id=tok.pad_token_id, greedy=True)
    ro = generate(policy, batch["input_ids"], batch["attention_mask"], eos_token_id=resolve_stop_ids(ppo_cfg, cfg, tok), **kw)
    n = ro.action_mask.sum(1).long()
    last = ro.sequences[:, -ppo_cfg.max_new_tokens:].gather(1, (n - 1)[:, None]).squeeze(1)
    print("greedy answer:", repr(tok.decode(ro.sequences[0, -ppo_cfg.max_new_tokens:][: int(n[0])])), "lengths", n.tolist())
    assert ro.ended_with_eos.float().mean() > 0.7 and (last[ro.ended_with_eos] == im_end).all()
    assert n.float().mean() > 3  # an answer of words, then <|im_end|>
    old = generate(policy, batch["input_ids"], batch["attention_mask"], eos_token_id=eot, **kw)
    assert old.action_mask.sum(1).mean() > n.float().mean()
