"""Public data in its published shapes and containers, through the real data prep.

Every fixture is written here by the library that makes such files in the wild (json, csv,
pyarrow for Parquet, Hugging Face ``datasets.save_to_disk`` for Arrow folders, fsspec's
compressors), then goes through ``check_data`` (pre-flight) and ``prepare_data`` (tokenized
artifact) with the built-in tokenizer; a short end-to-end run takes them through SFT, RM and PPO.
"""

from __future__ import annotations

import csv
import io
import json
import uuid

import fsspec
import pytest

from storage.store import ArtifactStore
from tasks.common.model import ModelConfig, load_tokenizer
from tasks.data.config import DataConfig
from tasks.data.dataset import read_jsonl
from tasks.data.formats import read_records, split_implicit_prompt
from tasks.data.prepare import check_data, data_key, prepare_data
from tasks.data.sources import DataError

MODEL = ModelConfig()
CAT, DOG = "Describe the cat.", "Describe the dog."
HH = [  # Anthropic HH-RLHF: full transcripts, the prompt implicit
    {"chosen": f"\n\nHuman: {CAT}\n\nAssistant: The cat is kind and warm.",
     "rejected": f"\n\nHuman: {CAT}\n\nAssistant: The cat is rude."},
    {"chosen": f"\n\nHuman: {DOG}\n\nAssistant: It barks.\n\nHuman: And then?\n\nAssistant: The dog is calm.",
     "rejected": f"\n\nHuman: {DOG}\n\nAssistant: It barks.\n\nHuman: And then?\n\nAssistant: The dog bites."},
    {"chosen": f"\n\nHuman: {CAT}\n\nAssistant: The cat is kind.", "rejected": f"\n\nHuman: {CAT}\n\nAssistant: The cat is kind."},
]
USER, GOOD, BAD = {"role": "user", "content": CAT}, {"role": "assistant", "content": "The cat is kind."}, {"role": "assistant", "content": "The cat is rude."}
ALPACA = [{"instruction": CAT, "input": "", "output": "The cat is kind."},
          {"instruction": "Describe this animal.", "input": "a dog", "output": "The dog is calm."}]
SHAREGPT = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": CAT},
                               {"from": "gpt", "value": "The cat is kind."}]},
            {"conversations": [{"from": "human", "value": DOG}, {"from": "gpt", "value": "The dog is calm."}]}]


def uri_of(name: str) -> str:
    return f"memory://fmt-{uuid.uuid4().hex[:8]}/{name}"


def put(uri: str, data: bytes, compression: str | None = None) -> str:
    with fsspec.open(uri, "wb", compression=compression) as f:
        f.write(data)
    return uri


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet(rows) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def csv_bytes(rows, delimiter=",") -> bytes:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(rows[0]), delimiter=delimiter)
    w.writeheader()
    w.writerows(rows)
    return out.getvalue().encode()


def hf_folder(tmp_path, rows, dict_split: str | None = None) -> str:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / f"hf-{uuid.uuid4().hex[:6]}"
    (datasets.DatasetDict({dict_split: ds, "test": ds}) if dict_split else ds).save_to_disk(str(path))
    return str(path)


# -- shapes ------------------------------------------------------------------------------------
def test_hh_transcripts_split_at_the_last_assistant_turn():
    got = read_records("preference", put(uri_of("hh.jsonl"), jsonl(HH)))
    assert got[0] == {"prompt": f"\n\nHuman: {CAT}\n\nAssistant:", "chosen": " The cat is kind and warm.",
                      "rejected": " The cat is rude.", "verbatim": True}
    assert got[1]["prompt"].endswith("And then?\n\nAssistant:") and got[1]["chosen"] == " The dog is calm."
    assert len(got) == 2  # the identical pair is dropped
    # without a role marker: the shared text up to a word boundary (TRL's implicit prompt)
    assert split_implicit_prompt("Q: sky? It is blue", "Q: sky? It is red") == ("Q: sky? It is ", "blue", "red")


SHAPES = [  # (kind, records, what the first record becomes)
    ("preference", [{"chosen": [USER, GOOD], "rejected": [USER, BAD]}] * 2,
     {"prompt_messages": [USER], "chosen_messages": [GOOD], "rejected_messages": [BAD]}),
    ("preference", [{"prompt": [USER], "chosen": GOOD, "rejected": BAD}] * 2,  # dicts, not lists
     {"prompt_messages": [USER], "chosen_messages": [GOOD], "rejected_messages": [BAD]}),
    ("preference", [{"prompt": CAT, "chosen": [GOOD], "rejected": [BAD]}] * 2,
     {"prompt_messages": [USER], "chosen_messages": [GOOD], "rejected_messages": [BAD]}),
    ("preference", [{"prompt": CAT, "chosen": "Kind.", "rejected": "Rude."}] * 2, {"prompt": CAT, "chosen": "Kind.", "rejected": "Rude."}),
    ("sft", ALPACA, {"prompt": CAT, "response": "The cat is kind."}),
    ("sft", ALPACA[1:] * 2, {"prompt": "Describe this animal.\n\na dog", "response": "The dog is calm."}),
    ("sft", SHAREGPT, {"messages": [{"role": "system", "content": "Be brief."}, USER, GOOD]}),
    ("sft", [{"messages": [USER, GOOD]}] * 2, {"messages": [USER, GOOD]}),
    ("sft", [{"prompt": [USER], "completion": [GOOD]}] * 2, {"messages": [USER, GOOD]}),  # TRL conversational
    ("sft", [{"prompt": CAT, "completion": "Kind."}] * 2, {"prompt": CAT, "response": "Kind."}),
    ("sft", [{"text": "The lamp is bright."}] * 2, {"text": "The lamp is bright."}),
    ("prompts", SHAREGPT, {"messages": [{"role": "system", "content": "Be brief."}, USER]}),
    ("prompts", ALPACA, {"prompt": CAT}),
    ("prompts", HH[:2], {"prompt": f"\n\nHuman: {CAT}\n\nAssistant:", "verbatim": True}),
    ("prompts", [{"prompt": [USER]}] * 2, {"messages": [USER]}),
    ("ptx", SHAREGPT, {"messages": [{"role": "system", "content": "Be brief."}, USER, GOOD]}),
]


@pytest.mark.parametrize("kind,rows,first", SHAPES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(SHAPES)])
def test_published_shapes(kind, rows, first):
    assert read_records(kind, put(uri_of("d.jsonl"), jsonl(rows)))[0] == first


def test_column_mapping():
    rows = [{"question": CAT, "answer": "Kind.", "bad": "Rude."}, {"question": DOG, "answer": "Calm.", "bad": "Bites."}]
    uri = put(uri_of("qa.jsonl"), jsonl(rows))
    assert read_records("sft", uri, columns={"prompt": "question", "response": "answer"})[0] == {"prompt": CAT, "response": "Kind."}
    pairs = read_records("preference", uri, columns={"prompt": "question", "preference.chosen": "answer", "preference.rejected": "bad"})
    assert pairs[1] == {"prompt": DOG, "chosen": "Calm.", "rejected": "Bites."}
    with pytest.raises(DataError, match=r"line 1: data.columns maps preference.chosen to 'best', but the record has no 'best'; "
                                        r"found keys \['answer', 'bad', 'question'\]"):
        read_records("preference", uri, columns={"preference.chosen": "best", "rejected": "bad"})
    cfg = DataConfig(sft_path=uri, columns={"prompt": "question", "response": "answer", "text": "body"})
    with pytest.raises(DataError, match=r"data.columns\['text'\] = 'body': no record of any source has a field 'body'"):
        check_data(cfg)
    with pytest.raises(ValueError, match=r"data.columns key 'prompts.answer': expected one of prompt, response"):
        DataConfig(columns={"prompts.answer": "a"})


# -- containers --------------------------------------------------------------------------------
def _containers(tmp_path):
    pairs = [{"prompt": CAT, "chosen": "Kind.", "rejected": "Rude."}, {"prompt": DOG, "chosen": "Calm.", "rejected": "Bites."}]
    return {
        "jsonl": put(uri_of("p.jsonl"), jsonl(pairs)),
        "json-array": put(uri_of("p.json"), json.dumps(pairs).encode()),
        "json-data": put(uri_of("p.json"), json.dumps({"version": 1, "data": pairs}).encode()),
        "csv": put(uri_of("p.csv"), csv_bytes(pairs)),
        "tsv": put(uri_of("p.tsv"), csv_bytes(pairs, "\t")),
        "parquet": put(uri_of("p.parquet"), parquet(pairs)),
        "save_to_disk": hf_folder(tmp_path, pairs),
        "DatasetDict": hf_folder(tmp_path, pairs, dict_split="train"),
        "gz": put(uri_of("p.jsonl.gz"), jsonl(pairs), "gzip"),
        "bz2": put(uri_of("p.jsonl.bz2"), jsonl(pairs), "bz2"),
        "xz": put(uri_of("p.jsonl.xz"), jsonl(pairs), "xz"),
        "zst": put(uri_of("p.csv.zst"), csv_bytes(pairs), "zstd"),
        "glob": _shards("p-*.jsonl.gz", pairs)[0],
        "folder": _shards("p-{}.parquet", pairs)[1],
    }


def _shards(pattern: str, rows) -> tuple[str, str]:
    base = uri_of("shards")
    for i, row in enumerate(rows):
        name = pattern.replace("*", "{}").format(f"{i:05d}")
        data = parquet([row]) if name.endswith(".parquet") else jsonl([row])
        put(f"{base}/{name}", data, "gzip" if name.endswith(".gz") else None)
    put(f"{base}/_SUCCESS", b"")  # markers and hidden files are not data
    return f"{base}/{pattern}", base


def test_every_container_reads_the_same_records(tmp_path):
    want = [{"prompt": CAT, "chosen": "Kind.", "rejected": "Rude."}, {"prompt": DOG, "chosen": "Calm.", "rejected": "Bites."}]
    for name, uri in _containers(tmp_path).items():
        assert read_records("preference", uri) == want, name


def test_glob_of_s3_shards_through_data_prep(s3_server):
    endpoint, bucket = s3_server
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    base = f"s3://{bucket}/prefs-{uuid.uuid4().hex[:8]}"
    with fsspec.open_files(f"{base}/part-*.jsonl.gz", "wb", compression="gzip", num=3, **opts) as files:
        for i, f in enumerate(files):
            f.write(jsonl(HH[:2] * (i + 1)))
    cfg = DataConfig(preference_path=f"{base}/part-*.jsonl.gz", prompts_path=f"{base}/part-*.jsonl.gz", storage_options=opts)
    assert check_data(cfg)["preference"] == 12
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex[:8]}")
    meta = json.loads((store.fetch(prepare_data(cfg, MODEL, store, seed=0).key) / "meta.json").read_text())
    assert meta["sources"]["preference"]["shards"] == 3 and meta["sources"]["preference"]["kept"] == 12
    assert meta["sources"]["prompts"]["uri"] == f"{base}/part-*.jsonl.gz"


# -- the artifact: counts, drops, percentiles, one read per process ------------------------------
def test_stats_and_degenerate_records(rlhf_cache):
    rows = HH * 3 + [{"prompt": CAT, "chosen": "  ", "rejected": "Rude."}]
    cfg = DataConfig(preference_path=put(uri_of("hh.jsonl.gz"), jsonl(rows), "gzip"),
                     sft_path=put(uri_of("a.json"), json.dumps(ALPACA * 2).encode()))
    store = ArtifactStore(f"memory://store-{uuid.uuid4().hex[:8]}")
    path = store.fetch(prepare_data(cfg, MODEL, store, seed=0).key)
    meta = json.loads((path / "meta.json").read_text())
    pref = meta["sources"]["preference"]
    assert (pref["records"], pref["kept"], pref["samples"]) == (10, 6, 6)
    assert pref["dropped"] == {"chosen_equals_rejected": 3, "empty_response": 1}
    assert set(pref["tokens"]) == {"p50", "p95", "max"} and 0 < pref["tokens"]["p50"] <= pref["tokens"]["max"] <= cfg.max_length
    assert meta["sources"]["sft"]["records"] == 4 and meta["counts"]["sft_train.jsonl"] + meta["counts"]["sft_eval.jsonl"] == 4
    # HH text is used as written: no second "Human:" template around it
    tok = load_tokenizer(MODEL, str(path / "tokenizer"))
    pair = (read_jsonl(path / "pref_train.jsonl") + read_jsonl(path / "pref_eval.jsonl"))[0]
    text = tok.decode(pair["chosen_ids"][: pair["prompt_len"]])
    assert text.startswith("\n\nHuman: ") and text.endswith("Assistant:") and text.count("Human:") in (1, 2)
    assert store.manifest(store.list("data")[0])["metrics"]["data/dropped"] == 4

    all_bad = cfg.model_copy(update={"preference_path": put(uri_of("same.jsonl"), jsonl([HH[2]] * 4))})
    with pytest.raises(DataError, match=r"data.preference_path .*same.jsonl': all 4 records are degenerate \(dropped: \{'chosen_equals_rejected': 4\}\)"):
        check_data(all_bad)


def test_each_source_is_read_once_per_process_and_a_change_is_seen():
    uri = put(uri_of("a.jsonl"), jsonl(ALPACA * 2))
    cfg = DataConfig(sft_path=uri)
    from tasks.data import prepare

    before = len(prepare._SCANS)
    k1 = data_key(cfg, MODEL, 0)
    assert check_data(cfg)["sft"] == 4 and data_key(cfg, MODEL, 0) == k1
    user_scans = [m for m in prepare._SCANS if m[1][0] == uri]
    assert len(user_scans) == 1 and len(prepare._SCANS) - before <= 4  # one scan per source, whatever the calls
    put(uri, jsonl(ALPACA * 3))  # new bytes, new size: a new scan and a new key
    assert data_key(cfg, MODEL, 0) != k1


# -- malformed files: an error naming the field, the URI, the record and the fix -----------------
def _bad_sources(tmp_path):
    good = jsonl(ALPACA)
    return [
        ("sft", put(uri_of("bad.parquet"), parquet(ALPACA)[:-20]), "not a readable Parquet file"),
        ("sft", put(uri_of("cut.jsonl.gz"), _gz(good * 200)[:-40]), "the gzip stream is truncated or corrupt"),
        ("sft", put(uri_of("t.json"), json.dumps([{"instruction": 3, "output": "x"}]).encode()), r"record 0: 'instruction' must be a string, got int 3"),
        ("sft", put(uri_of("t.json"), b'{"rows": 3}'), "a JSON object with keys \\['rows'\\] and no list of records"),
        ("sft", put(uri_of("m.parquet"), parquet([{"question": "q"}] * 2)), r"record 0: found keys \['question'\]; a record needs text, prompt\+response"),
        ("preference", put(uri_of("p.csv"), b"prompt,chosen\nq,a\n"), r"line 2: missing key 'rejected'"),
        ("preference", hf_folder(tmp_path, [{"a": 1}], dict_split="validation"), r"a DatasetDict with splits \['validation', 'test'\] and no 'train'"),
        ("prompts", put(uri_of("x.csv"), b'prompt\n"unclosed\n'), r"the record after line 1: malformed CSV \(unexpected end of data\); check the quoting"),
        ("prompts", put(uri_of("empty.jsonl.gz"), _gz(b"")), "is empty; it needs at least one record"),
        ("prompts", uri_of("nothing/*.parquet"), "the pattern matches no file"),
    ]


def _gz(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def test_malformed_sources_fail_in_preflight_with_field_uri_and_record(tmp_path):
    field = {"sft": "sft_path", "preference": "preference_path", "prompts": "prompts_path"}
    for kind, uri, message in _bad_sources(tmp_path):
        with pytest.raises((DataError, FileNotFoundError)) as e:
            check_data(DataConfig(**{field[kind]: uri}))
        text = str(e.value)
        assert f"data.{field[kind]}" in text and uri.rstrip("/").split("/")[-1] in text, text
        assert __import__("re").search(message, text), (message, text)


# -- end to end: public shapes through SFT, RM and PPO -------------------------------------------
@pytest.mark.slow
def test_public_shapes_through_sft_rm_and_ppo(rlhf_cache, ray_cluster, tmp_path):
    """HH transcripts (.jsonl.gz) as preference pairs and as PPO prompts, Alpaca (.json) for SFT,
    ShareGPT (.parquet) for ptx: each stage trains on them and publishes its artifact."""
    from tasks.ppo.config import PPOConfig
    from tasks.ppo.train import train_ppo
    from tasks.rm.config import RewardConfig
    from tasks.rm.train import train_reward_model
    from tasks.sft.config import SFTConfig
    from tasks.sft.train import train_sft

    hh = [{"chosen": f"\n\nHuman: Describe the {a}.\n\nAssistant: The {a} is kind.",
           "rejected": f"\n\nHuman: Describe the {a}.\n\nAssistant: The {a} is rude."}
          for a in ("cat", "dog", "bird", "fish", "horse", "river", "lamp", "garden")]
    cfg = DataConfig(
        preference_path=put(uri_of("hh.jsonl.gz"), jsonl(hh), "gzip"),
        prompts_path=put(uri_of("hh.jsonl.gz"), jsonl(hh), "gzip"),
        sft_path=put(uri_of("alpaca.json"), json.dumps(ALPACA * 8).encode()),
        ptx_path=put(uri_of("sharegpt.parquet"), parquet(SHAREGPT * 4)),
    )
    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    data = prepare_data(cfg, MODEL, store, seed=0)
    sft = train_sft(SFTConfig(max_steps=3, eval_every=3, batch_size=4), MODEL, store, data, 0)
    rm = train_reward_model(RewardConfig(max_steps=3, eval_every=3, batch_size=4), MODEL, store, data, 0)
    ppo = train_ppo(PPOConfig(num_iterations=1, rollout_batch_size=8, train_batch_size=4, ppo_epochs=1, max_new_tokens=6,
                              eval_every=100, eval_prompts=2, ptx_coef=0.5, ptx_batch_size=2), MODEL, store, data, sft, rm, 0)
    for ref in (sft, rm, ppo):
        assert store.is_good(ref.key)
    hist = [json.loads(x) for x in (store.fetch(ppo.key) / "metrics.jsonl").read_text().splitlines()]
    assert any("ppo/reward_mean" in h for h in hist) and any("ppo/ptx_loss" in h for h in hist)
    prompts = read_jsonl(store.fetch(data.key) / "prompts_train.jsonl")
    assert all(p["prompt"].startswith("\n\nHuman: Describe the ") and p["prompt"].endswith("Assistant:") for p in prompts)
