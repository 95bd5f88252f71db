"""Data prep: parsers of every format, tokenization invariants, the artifact end to end."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from storage.store import ArtifactStore
from tasks.common.model import ModelConfig, load_tokenizer
from tasks.data.config import DataConfig
from tasks.data.dataset import collate_lm, collate_pairs, collate_prompts, read_jsonl
from tasks.data.encode import Encoder
from tasks.data.formats import DataError, read_records
from tasks.data.prepare import check_data, data_key, group_lines, prepare_data, split_indices

TEMPLATE = DataConfig().prompt_template


def read_sft(uri, storage_options=None, **kw):
    return read_records("sft", uri, storage_options, **kw)


def read_ptx(uri, storage_options=None, **kw):
    return read_records("ptx", uri, storage_options, **kw)


def read_prompts(uri, storage_options=None, **kw):
    return read_records("prompts", uri, storage_options, **kw)


def read_preferences(uri, storage_options=None, **kw):
    return read_records("preference", uri, storage_options, **kw)


def mem(name: str, content: bytes | str) -> str:
    """Write ``content`` to a fresh memory:// file and return its URI."""
    uri = f"memory://data-{uuid.uuid4().hex[:8]}/{name}"
    with fsspec.open(uri, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    return uri


def jsonl(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture(scope="module")
def tok(rlhf_cache):
    return load_tokenizer(ModelConfig())


# -- formats -----------------------------------------------------------------------------------
def test_sft_formats():
    assert read_sft(mem("a.txt", "first line\n\nsecond line\r\n")) == [{"text": "first line"}, {"text": "second line"}]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    got = read_sft(mem("a.jsonl", jsonl({"prompt": "P", "response": "R"}, {"messages": msgs}, {"text": "T"})))
    assert got == [{"prompt": "P", "response": "R"}, {"messages": msgs}, {"text": "T"}]


def test_prompt_formats():
    txt = "Human: Describe the cat. Assistant: The cat is kind.\nTell me about the dog.\n"
    assert read_prompts(mem("p.txt", txt), prompt_template=TEMPLATE) == [{"prompt": "Describe the cat."}, {"prompt": "Tell me about the dog."}]
    csv_text = 'act,prompt\nLinux Terminal,"I want you to act as a terminal, and ""echo"" things"\nPoet,"Write a poem\nabout rain"\n'
    assert read_prompts(mem("p.csv", csv_text)) == [
        {"prompt": 'I want you to act as a terminal, and "echo" things'}, {"prompt": "Write a poem\nabout rain"}]
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "answer to drop"}]
    assert read_prompts(mem("p.jsonl", jsonl({"prompt": "A"}, {"messages": conv}))) == [
        {"prompt": "A"}, {"messages": conv[:1]}]


def test_preference_formats():
    user = {"role": "user", "content": "Describe the cat."}
    good, bad = {"role": "assistant", "content": "Kind."}, {"role": "assistant", "content": "Rude."}
    got = read_preferences(mem("p.jsonl", jsonl(
        {"prompt": "P", "chosen": "C", "rejected": "R"},
        {"chosen": [user, good], "rejected": [user, bad]},  # HH style: the prompt is the shared prefix
        {"prompt": "Describe the cat.", "chosen": [good], "rejected": [bad]},
    )))
    assert got[0] == {"prompt": "P", "chosen": "C", "rejected": "R"}
    assert got[1] == got[2] == {"prompt_messages": [user], "chosen_messages": [good], "rejected_messages": [bad]}


def test_ptx_formats():
    assert read_ptx(mem("x.txt", "a b\nc d\n")) == [{"text": "a b"}, {"text": "c d"}]
    assert read_ptx(mem("x.jsonl", jsonl({"text": "t"}, {"prompt": "p", "response": "r"}))) == [
        {"text": "t"}, {"prompt": "p", "response": "r"}]


BAD = [
    (read_sft, "e.txt", b"\n  \n", "is empty; it needs at least one record"),
    (read_prompts, "p.csv", b"act,text2\nx,y\n", "line 2: found keys ['act', 'text2']; a record needs prompt"),
    (read_sft, "s.jsonl", b'{"text": "a"}\n{"text": \n', "line 2: malformed JSON"),
    (read_sft, "s.txt", b"ok\nfine\ncaf\xe9\n", "line 3: bytes b'\\xe9' are not UTF-8; re-save the file as UTF-8"),
    (read_preferences, "p.jsonl", jsonl({"prompt": "p", "chosen": "c"}).encode(), "line 1: missing key 'rejected'; a preference record needs chosen and rejected"),
    (read_preferences, "p.jsonl", jsonl({"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "p", "rejected": "r"}).encode(), "line 2: missing key 'chosen'"),
    (read_preferences, "p.jsonl", jsonl({"prompt": "p", "chosen": 3, "rejected": "r"}).encode(), "line 1: 'chosen' must be a string, got int 3"),
    (read_prompts, "p.jsonl", jsonl({"question": "x"}).encode(), "line 1: found keys ['question']; a record needs prompt"),
    (read_sft, "s.jsonl", jsonl({"prompt": "x"}).encode(), "line 1: missing key 'response'"),
    (read_sft, "s.jsonl", jsonl({"prompt": 3, "response": "x"}).encode(), "'prompt' must be a string, got int 3"),
    (read_sft, "s.jsonl", b"[1, 2]\n", "a JSON list, not an object"),
    (read_sft, "s.jsonl", jsonl({"messages": [{"role": "robot", "content": "x"}]}).encode(), "roles are system, user, assistant"),
    (read_sft, "s.parquet", b"x", "not a readable Parquet file"),
    (read_sft, "s.xlsx", b"x", "unknown extension '.xlsx'"),
    (read_preferences, "p.txt", b"x\n", "a line of text; preference pairs need prompt, chosen and rejected"),
]


@pytest.mark.parametrize("reader,name,content,message", BAD, ids=[f"{r.__name__}-{m[:24]}" for r, _, _, m in BAD])
def test_bad_inputs_name_the_problem(reader, name, content, message):
    uri = mem(name, content)
    with pytest.raises(DataError) as e:
        reader(uri)
    assert message in str(e.value)
    assert uri in str(e.value) and "data." in str(e.value)  # names the field and the value


def test_nonexistent_uri():
    with pytest.raises(FileNotFoundError, match=r"data.sft_path 'memory://nowhere/sft.jsonl': no such file"):
        read_sft("memory://nowhere/sft.jsonl")
    with pytest.raises(FileNotFoundError, match="data.prompts_path"):
        check_data(DataConfig(prompts_path="memory://nowhere/p.csv"))


def test_reads_from_s3(s3_server):
    endpoint, bucket = s3_server
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    base = f"s3://{bucket}/data-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe({f"{base}/sft.txt": b"one\ntwo\nthree\n", f"{base}/prompts.csv": b"prompt\nA\nB\n",
             f"{base}/pairs.jsonl": jsonl(*[{"prompt": "p", "chosen": "c", "rejected": "r"}] * 2).encode(),
             f"{base}/ptx.jsonl": jsonl({"text": "t"}).encode()})
    assert read_sft(f"{base}/sft.txt", opts) == [{"text": "one"}, {"text": "two"}, {"text": "three"}]
    cfg = DataConfig(sft_path=f"{base}/sft.txt", prompts_path=f"{base}/prompts.csv", preference_path=f"{base}/pairs.jsonl",
                     ptx_path=f"{base}/ptx.jsonl", storage_options=opts)
    assert check_data(cfg) == {"sft": 3, "preference": 2, "prompts": 2, "ptx": 1}


# -- pure logic --------------------------------------------------------------------------------
def test_group_lines_hand_case():
    E = 0  # EOS
    lines = [[1, 2, E], [3, 4, E], [5, E], [6, 7, 8, 9, 10, 11, 12, E]]
    groups, n_split = group_lines(lines, max_length=5)
    # [3, 4, E] overflows the first group and starts the second (the seed dropped it);
    # the 8-token line is cut into 5 + 3 tokens.
    assert groups == [[1, 2, E], [3, 4, E, 5, E], [6, 7, 8, 9, 10], [11, 12, E]]
    assert n_split == 1
    assert sum(groups, []) == sum(lines, [])  # no token lost or duplicated
    short, _ = group_lines(lines, max_length=5, short_text=True)
    assert short == [[1, 2, E], [3, 4, E], [5, E], [6, 7, 8, 9, 10], [11, 12, E]]


def test_split_is_deterministic_by_seed():
    train, held = split_indices(100, 0.1, seed=1)
    assert (train, held) == split_indices(100, 0.1, seed=1)
    assert held != split_indices(100, 0.1, seed=2)[1]
    assert len(held) == 10 and sorted(train + held) == list(range(100))
    assert split_indices(2, 0.1, seed=0)[1] and split_indices(2, 0.9, seed=0)[0]  # both sides non-empty


def test_labels_masked_exactly_on_the_prompt(tok):
    enc = Encoder(tok, DataConfig())
    ids, labels, truncated = enc.prompt_response("Describe the cat.", "The cat is kind, warm and sad.")
    p = tok("Human: Describe the cat.\nAssistant:", add_special_tokens=False)["input_ids"]
    assert not truncated and ids[: len(p)] == p
    assert labels[: len(p)] == [-100] * len(p)
    assert labels[len(p):] == ids[len(p):]
    assert tok.decode(ids[len(p):]) == " The cat is kind, warm and sad.<|endoftext|>"


def test_chat_labels_only_on_assistant_turns(tok):
    enc = Encoder(tok, DataConfig())
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe the cat."},
            {"role": "assistant", "content": "The cat is kind."}, {"role": "user", "content": "And the dog?"},
            {"role": "assistant", "content": "The dog is rude."}]
    ids, labels = enc.messages(msgs)
    spans, cur = [], []
    for i, l in zip(ids, labels):
        if l == -100:
            spans, cur = (spans + [cur] if cur else spans), []
        else:
            assert l == i
            cur.append(i)
    spans.append(cur)
    assert [tok.decode(s) for s in spans] == [" The cat is kind.<|endoftext|>\n", " The dog is rude.<|endoftext|>"]
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False).rstrip("\n")


# -- prepare_data ------------------------------------------------------------------------------
def test_prepare_builtin_end_to_end(rlhf_cache):
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex[:8]}")
    cfg, model = DataConfig(), ModelConfig()
    ref = prepare_data(cfg, model, store, seed=7)
    assert ref.kind == "dataset" and ref.key == data_key(cfg, model, seed=7)
    path = store.fetch(ref.key)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["sources"]["sft"]["uri"] == "builtin:task/sft.jsonl?seed=0" and len(meta["sources"]["sft"]["sha256"]) == 64
    assert meta["counts"]["sft_train.jsonl"] + meta["counts"]["sft_eval.jsonl"] == 600
    tok = load_tokenizer(model, str(path / "tokenizer"))
    pad, eos = tok.pad_token_id, tok.eos_token_id

    sft = read_jsonl(path / "sft_train.jsonl")
    assert len(sft) == meta["counts"]["sft_train.jsonl"] and all(r["input_ids"][-1] == eos for r in sft)
    batch = collate_lm(sft[:4], pad)
    assert batch["input_ids"].shape == batch["labels"].shape
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    assert (batch["labels"][:, 0] == -100).all()  # prompts are masked

    pairs = collate_pairs(read_jsonl(path / "pref_eval.jsonl")[:4], pad)
    assert pairs["chosen_ids"].shape == pairs["rejected_ids"].shape
    prompts = read_jsonl(path / "prompts_train.jsonl")
    assert all(r["prompt"].startswith("Human: ") and r["prompt"].endswith("\nAssistant:") for r in prompts)
    left = collate_prompts(prompts[:8], pad)
    assert (left["attention_mask"][:, -1] == 1).all()  # left padded: every prompt ends at the right edge
    ptx = read_jsonl(path / "ptx_train.jsonl")
    assert ptx and all(r["labels"] == r["input_ids"] and len(r["input_ids"]) <= cfg.max_length for r in ptx)

    # Again: the same key, the same published folder, no second artifact.
    data_dir = store.manifest(ref.key)["data"]
    assert prepare_data(cfg, model, store, seed=7) == ref
    assert store.manifest(ref.key)["data"] == data_dir and store.list("data") == [ref.key]
    # New data or a new split seed is a new key.
    assert data_key(cfg.model_copy(update={"builtin_seed": 1}), model, 7) != ref.key
    assert data_key(cfg, model, 8) != ref.key


def test_prepare_user_files_truncates_and_drops(rlhf_cache):
    long_prompt = "Describe the cat and the dog and the river and the city and the garden."
    long_response = "The cat is kind, warm and sad. " * 6
    cfg = DataConfig(
        max_length=24, max_prompt_length=10,
        sft_path=mem("sft.txt", "The cat is kind.\nThe dog is rude.\nThe river is calm.\n"),
        preference_path=mem("pairs.jsonl", jsonl(
            {"prompt": "Describe the cat.", "chosen": "The cat is kind.", "rejected": "The cat is rude."},
            {"prompt": "Describe the dog.", "chosen": "The dog is kind.", "rejected": "The dog is rude."},
            {"prompt": long_prompt, "chosen": "The cat is kind.", "rejected": "The cat is sad."},
            {"prompt": "Describe the cat.", "chosen": long_response, "rejected": "The cat is sad."})),
        prompts_path=mem("prompts.csv", f"prompt\nDescribe the cat.\n{long_prompt}\n"),
        ptx_path=mem("ptx.txt", "The lamp is bright.\n"),
        short_text=True,
    )
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex[:8]}")
    path = store.fetch(prepare_data(cfg, ModelConfig(), store, seed=0).key)
    meta = json.loads((path / "meta.json").read_text())
    tok = load_tokenizer(ModelConfig(), str(path / "tokenizer"))
    assert meta["truncated"]["preference"] == 1 and meta["dropped"]["preference"] == {"response_too_long": 1}
    assert meta["truncated"]["prompts"] == 1
    assert meta["counts"]["sft_train.jsonl"] + meta["counts"]["sft_eval.jsonl"] == 3  # short_text: a line a sample

    pairs = read_jsonl(path / "pref_train.jsonl") + read_jsonl(path / "pref_eval.jsonl")
    assert len(pairs) == 3
    cut = max(pairs, key=lambda r: len(r["chosen_ids"]))
    assert len(cut["chosen_ids"]) == 24 and cut["chosen_ids"][-1] == tok.eos_token_id
    # The prompt lost its left end; the response is whole.
    assert tok.decode(cut["chosen_ids"][cut["prompt_len"]:]) == " The cat is kind.<|endoftext|>"
    assert tok.decode(cut["chosen_ids"][: cut["prompt_len"]]).endswith("garden.\nAssistant:")
    prompts = read_jsonl(path / "prompts_train.jsonl") + read_jsonl(path / "prompts_eval.jsonl")
    assert all(len(r["prompt_ids"]) <= 10 and r["prompt"].endswith("\nAssistant:") for r in prompts)
    assert {len(r["prompt_ids"]) for r in prompts} & {10}

    all_long = cfg.model_copy(update={"preference_path": mem("p.jsonl", jsonl(
        *[{"prompt": "Describe the cat.", "chosen": long_response, "rejected": "x"}] * 3))})
    with pytest.raises(DataError, match=r"data.preference_path .*3 records gave 0 samples.*response_too_long': 3"):
        prepare_data(all_long, ModelConfig(), store, seed=0)


def test_plain_text_grouped_into_too_few_samples(rlhf_cache):
    cfg = DataConfig(sft_path=mem("sft.txt", "a\nb\nc\n"))
    with pytest.raises(DataError, match=r"3 records gave 1 samples.*data.short_text=true"):
        prepare_data(cfg, ModelConfig(), ArtifactStore(f"memory://store-{uuid.uuid4().hex[:8]}"), seed=0)


def test_messages_need_a_chat_template(rlhf_cache, tmp_path):
    tok = load_tokenizer(ModelConfig())
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain-tok")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    cfg = DataConfig(sft_path=mem("chat.jsonl", jsonl({"messages": msgs}, {"messages": msgs})))
    model = ModelConfig(tokenizer=str(tmp_path / "plain-tok"))
    for check in (lambda: check_data(cfg, model),  # pre-flight
                  lambda: prepare_data(cfg, model, ArtifactStore(f"memory://store-{uuid.uuid4().hex[:8]}"), seed=0)):
        with pytest.raises(DataError, match=r"data.sft_path .* has chat `messages` records, but the tokenizer .* has no chat template"):
            check()


def test_chat_data_end_to_end(rlhf_cache):
    user = {"role": "user", "content": "Describe the cat."}
    msgs = [user, {"role": "assistant", "content": "The cat is kind."}]
    cfg = DataConfig(
        sft_path=mem("chat.jsonl", jsonl(*[{"messages": msgs}] * 3)),
        preference_path=mem("p.jsonl", jsonl(*[{"chosen": msgs, "rejected": [user, {"role": "assistant", "content": "Rude."}]}] * 2)),
        prompts_path=mem("p.jsonl", jsonl(*[{"messages": msgs}] * 2)),
    )
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex[:8]}")
    path = store.fetch(prepare_data(cfg, ModelConfig(), store, seed=0).key)
    tok = load_tokenizer(ModelConfig(), str(path / "tokenizer"))
    pair = read_jsonl(path / "pref_train.jsonl")[0]
    assert tok.decode(pair["chosen_ids"]) == "Human: Describe the cat.\nAssistant: The cat is kind.<|endoftext|>"
    assert tok.decode(pair["rejected_ids"][pair["prompt_len"]:]) == " Rude.<|endoftext|>"
    assert read_jsonl(path / "prompts_eval.jsonl")[0]["prompt"] == "Human: Describe the cat.\nAssistant:"
