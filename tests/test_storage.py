"""Contract tests for the artifact store, run against memory://, file:// and a real S3 server.

Every backend must behave the same: a reader only ever sees complete artifacts, damage is
caught by hash, keys stay inside the store, and nothing secret reaches a manifest.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import BaseModel

from storage import ArtifactCorrupt, ArtifactRef, ArtifactStore, content_hash, sha256_file, stage_key
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
FILES = {
    "weights.bin": bytes(range(256)) * 64,
    "config.json": b'{"n_layer": 2}',
    "tokenizer/vocab.txt": "héllo\nwörld\n".encode(),
    "tokenizer/deep/er/merges.txt": b"a b\n",
    "empty.txt": b"",
}


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def put_raw(store: ArtifactStore, path: str, data: bytes) -> None:
    """Write straight into the store, past publish: what a crash or another writer leaves."""
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


def s3_store(endpoint: str, bucket: str, **options) -> ArtifactStore:
    return ArtifactStore(f"s3://{bucket}/t-{uuid.uuid4().hex[:10]}",
                         storage_options={"client_kwargs": {"endpoint_url": endpoint}, **options})


def make_store(backend: str, request, tmp_path: Path) -> ArtifactStore:
    if backend == "memory":
        return ArtifactStore(f"memory://t-{uuid.uuid4().hex[:10]}")
    if backend == "file":
        return ArtifactStore(f"file://{tmp_path / 'store'}")
    return s3_store(*request.getfixturevalue("s3_server"))


@pytest.fixture(params=["memory", "file", "s3"])
def store(request, tmp_path) -> ArtifactStore:
    s = make_store(request.param, request, tmp_path)
    yield s
    if s.fs.exists(s.root) and not s.local:
        s.fs.rm(s.root, recursive=True)


@pytest.fixture
def src(tmp_path) -> Path:
    return write_tree(tmp_path / "src", FILES)


# -- round trip and manifest -----------------------------------------------------------------
def test_publish_fetch_round_trip(store, src, tmp_path):
    ref = store.publish("sft/abc123", src, kind="sft_adapter")
    assert ref == ArtifactRef(uri=f"{store.uri}/sft/abc123", key="sft/abc123", kind="sft_adapter",
                              content_hash=ref.content_hash, parts=ref.parts)
    assert set(ref.parts) == {p.split("/")[0] for p in FILES}
    assert store.exists("sft/abc123") and store.ref("sft/abc123") == ref
    local = store.fetch("sft/abc123", cache_dir=tmp_path / "cache")
    assert read_tree(local) == FILES  # exactly the published files: no markers, nothing missing
    again = store.fetch("sft/abc123", cache_dir=tmp_path / "cache")
    assert again == local and read_tree(again) == FILES


def test_content_hash_is_the_same_on_every_backend(request, src, tmp_path):
    expected = content_hash({rel: {"sha256": sha256_file(src / rel)} for rel in FILES})
    hashes = {b: make_store(b, request, tmp_path).publish("data/x", src, kind="dataset").content_hash
              for b in ("memory", "file", "s3")}
    assert hashes == {"memory": expected, "file": expected, "s3": expected}


class TinyConfig(BaseModel):
    lr: float = 1e-4
    layers: list[int] = [1, 2]


def test_manifest_describes_the_artifact(store, src):
    data = store.publish("data/d1", src, kind="dataset")
    before = datetime.now(timezone.utc).replace(microsecond=0)
    store.publish("sft/s1", src, kind="sft_adapter", config={"sft": TinyConfig(), "seed": 3},
                  inputs={"data": data}, metrics={"sft/eval_loss": 1.25}, extra={"iteration": 7})
    m = store.manifest("sft/s1")
    assert (m["kind"], m["key"], m["iteration"]) == ("sft_adapter", "sft/s1", 7)
    assert m["config"] == {"sft": {"lr": 1e-4, "layers": [1, 2]}, "seed": 3}
    assert m["inputs"] == {"data": data.content_hash} and m["input_uris"] == {"data": data.uri}
    assert m["metrics"] == {"sft/eval_loss": 1.25}
    assert {"torch", "fsspec", "transformers"} <= set(m["versions"])
    created = datetime.fromisoformat(m["created_at"])
    assert before <= created <= datetime.now(timezone.utc)
    assert {rel: f["size"] for rel, f in m["files"].items()} == {rel: len(b) for rel, b in FILES.items()}
    assert m["content_hash"] == content_hash(m["files"])
    with pytest.raises(ValueError, match="'files'"):
        store.publish("sft/s2", src, kind="x", extra={"files": {}})
    (src.parent / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no files"):
        store.publish("sft/s3", src.parent / "empty", kind="x")


# -- what a reader may see -------------------------------------------------------------------
def test_missing_artifact_raises_file_not_found_naming_the_uri(store, tmp_path):
    assert not store.exists("rm/none")
    for read in (store.manifest, store.ref, store.verify, lambda k: store.fetch(k, cache_dir=tmp_path)):
        with pytest.raises(FileNotFoundError, match=f"{store.uri}/rm/none"):
            read("rm/none")


def test_files_without_a_manifest_are_not_an_artifact(store):
    # What a crash after the uploads and before the manifest leaves behind.
    put_raw(store, store._path("sft/crashed", "data-20260101T000000-deadbeef", "weights.bin"), b"w" * 10)
    assert not store.exists("sft/crashed")
    assert store.list() == [] and store.list("sft") == []
    with pytest.raises(FileNotFoundError):
        store.manifest("sft/crashed")


def test_failed_publish_leaves_no_artifact(store, src):
    # A file that exists but cannot be read, even by root: uploads before it succeed, then
    # publish fails for real midway through.
    (src / "zz").mkdir()
    (src / "zz" / "unreadable.bin").symlink_to("/proc/self/mem")
    with pytest.raises(OSError):
        store.publish("rm/half", src, kind="reward_model")
    assert not store.exists("rm/half") and store.list() == []
    left = store.fs.find(store._path("rm/half")) if store.fs.exists(store._path("rm/half")) else []
    assert not any(p.endswith("MANIFEST.json") for p in left)
    if not store.remote:  # local and in-memory stores clean up; remote ones may keep orphans
        assert left == []
    (src / "zz" / "unreadable.bin").unlink()
    store.publish("rm/half", src, kind="reward_model")
    assert store.verify("rm/half")["files"].keys() == set(FILES)


def test_list_returns_complete_keys_only(store, src, tmp_path):
    for key in ("sft/a", "sft/b", "rm/c", "ppo/p-ckpt/iter-000001", "ppo/p-ckpt/iter-000002"):
        store.publish(key, src, kind="k")
    put_raw(store, store._path("sft/orphan", "data-x", "f"), b"1")
    # An artifact whose content holds a file named MANIFEST.json is still one key.
    nested = write_tree(tmp_path / "nested", {"inner/MANIFEST.json": b"{}", "a.txt": b"a"})
    store.publish("rm/nested", nested, kind="k")
    assert store.list() == ["ppo/p-ckpt/iter-000001", "ppo/p-ckpt/iter-000002", "rm/c", "rm/nested", "sft/a", "sft/b"]
    assert store.list("sft") == ["sft/a", "sft/b"]
    assert store.list("ppo/p-ckpt") == ["ppo/p-ckpt/iter-000001", "ppo/p-ckpt/iter-000002"]
    assert store.list("nothing") == []
    store.delete("sft/a")
    assert store.list("sft") == ["sft/b"] and not store.exists("sft/a")


# -- damage is detected ----------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "flip", "remove"])
def test_corruption_is_detected_by_verify_and_fetch(store, src, tmp_path, damage):
    store.publish("rm/r1", src, kind="reward_model")
    path = store._path("rm/r1", store.manifest("rm/r1")["data"], "weights.bin")
    good = FILES["weights.bin"]
    if damage == "truncate":
        store.fs.pipe_file(path, good[:100])
    elif damage == "flip":
        store.fs.pipe_file(path, bytes([good[0] ^ 1]) + good[1:])
    else:
        store.fs.rm_file(path)
    with pytest.raises(ArtifactCorrupt, match="weights.bin"):
        store.verify("rm/r1")
    with pytest.raises(ArtifactCorrupt, match="weights.bin"):
        store.fetch("rm/r1", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "artifacts" / store.manifest("rm/r1")["content_hash"]).exists()


def test_verified_once_per_process_until_the_manifest_changes(store, src):
    store.publish("rm/v1", src, kind="reward_model")
    store.verify("rm/v1")
    m = store.manifest("rm/v1")
    path = store._path("rm/v1", m["data"], "weights.bin")
    good = FILES["weights.bin"]
    store.fs.pipe_file(path, bytes([good[0] ^ 1]) + good[1:])  # same size: only a hash sees it
    assert store.verify("rm/v1") == m  # memoised: not hashed again in this process
    assert store.is_good("rm/v1")  # the cheap check of a cache hit compares sizes, not hashes
    with pytest.raises(ArtifactCorrupt, match="weights.bin"):
        store.verify("rm/v1", again=True)
    store.fs.pipe_file(path, good[:10])
    assert not store.is_good("rm/v1")
    with pytest.raises(ArtifactCorrupt, match="10 bytes"):
        store.check("rm/v1")
    store.publish("rm/v1", src, kind="reward_model")  # a new manifest: verified afresh
    store.fs.pipe_file(store._path("rm/v1", store.manifest("rm/v1")["data"], "weights.bin"), bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(ArtifactCorrupt, match="weights.bin"):
        store.verify("rm/v1")


def test_fetch_by_ref_checks_the_content_it_was_keyed_on(store, src, tmp_path):
    ref = store.publish("sft/f1", src, kind="sft_adapter")
    assert store.fetch(ref, cache_dir=tmp_path / "c") == store.fetch(ref.key, cache_dir=tmp_path / "c")
    assert store.fetch(ref.only("tokenizer"), cache_dir=tmp_path / "c")
    (src / "weights.bin").write_bytes(b"other weights")
    store.publish("sft/f1", src, kind="sft_adapter")  # republished since the ref was taken
    assert store.fetch(ref.only("tokenizer"), cache_dir=tmp_path / "c")  # the part the consumer reads is unchanged
    with pytest.raises(ArtifactCorrupt, match="other content than the ref names"):
        store.fetch(ref, cache_dir=tmp_path / "c")
    with pytest.raises(ArtifactCorrupt, match="other content"):
        store.fetch(ref.model_copy(update={"parts": {}}), cache_dir=tmp_path / "c")


def test_corrupt_manifest_is_reported(store, src):
    store.publish("rm/r2", src, kind="reward_model")
    put_raw(store, store._path("rm/r2", "MANIFEST.json"), b'{"kind": "rew')
    with pytest.raises(ArtifactCorrupt, match="MANIFEST.json is not valid JSON"):
        store.manifest("rm/r2")


# -- concurrent writers ----------------------------------------------------------------------
def test_concurrent_republish_gives_one_complete_artifact(store, tmp_path):
    trees = {name: {f"shard-{i:02d}.bin": f"{name}-{i}".encode() * 50 for i in range(20)} for name in "AB"}
    dirs = {name: write_tree(tmp_path / name, files) for name, files in trees.items()}
    for round_ in range(2):
        barrier, errors = threading.Barrier(2), []

        def publish(name):
            barrier.wait()
            try:
                store.publish("sft/same", dirs[name], kind="sft_adapter", metrics={"writer": name})
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=publish, args=(n,)) for n in "AB"]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert errors == []
        m = store.verify("sft/same")
        winner = m["metrics"]["writer"]
        assert set(m["files"]) == set(trees[winner])
        assert read_tree(store.fetch("sft/same", cache_dir=tmp_path / f"cache{round_}")) == trees[winner]
    assert store.list() == ["sft/same"]


# -- keys, schemes, secrets ------------------------------------------------------------------
@pytest.mark.parametrize("key", ["../x", "/abs", "a/../../b", "", ".", "a//b", "a/./b", "a/", "a\\b",
                                 "sft/data-1/x", "sft/MANIFEST.json", ".hidden/x"])
def test_keys_outside_the_store_are_rejected(store, src, key):
    uses = [store.uri_of, store.exists, store.manifest, store.delete, lambda k: store.publish(k, src, kind="x")]
    for use in uses + ([store.list] if key else []):  # list("") is the whole store
        with pytest.raises(ValueError, match="artifact key"):
            use(key)
    assert store.list() == []


def test_unknown_scheme_is_named():
    with pytest.raises(ValueError, match="'nosuchproto'"):
        ArtifactStore("nosuchproto://bucket/x")


def test_storage_options_and_credentials_never_reach_the_manifest(s3_server, src, monkeypatch):
    endpoint, bucket = s3_server
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-7f3a9")  # moto accepts any secret
    env_store = s3_store(endpoint, bucket, skip_instance_cache=True)
    key_store = s3_store(endpoint, bucket, key="AKIDEXPLICIT42", secret="opt-secret-c41d")
    data = env_store.publish("data/d", src, kind="dataset", config={"n": 1})
    key_store.publish("sft/s", src, kind="sft_adapter", inputs={"data": data})
    host = endpoint.split("://", 1)[1]
    for s, key in ((env_store, "data/d"), (key_store, "sft/s")):
        text = s.fs.cat_file(s._path(key, "MANIFEST.json")).decode()
        for secret in (host, "env-secret-7f3a9", "AKIDEXPLICIT42", "opt-secret-c41d", "endpoint"):
            assert secret not in text and secret not in s.ref(key).uri


def test_listing_cache_does_not_hide_other_writers(s3_server, src):
    # s3fs caches listings; another process finishing a publish must still be seen.
    endpoint, bucket = s3_server
    reader = s3_store(endpoint, bucket)
    writer = ArtifactStore(reader.uri, storage_options={"client_kwargs": {"endpoint_url": endpoint},
                                                        "skip_instance_cache": True})
    put_raw(writer, writer._path("sft/k", "data-old", "f"), b"1")  # a crashed earlier attempt
    assert reader.list() == [] and not reader.exists("sft/k")
    writer.publish("sft/k", src, kind="sft_adapter")
    assert reader.exists("sft/k") and reader.list() == ["sft/k"]


def test_stage_key_depends_on_content_not_location():
    ref = ArtifactRef(uri="s3://a/data/1", key="data/1", kind="dataset", content_hash="h1")
    moved = ref.model_copy(update={"uri": "file:///elsewhere/data/1", "key": "data/other"})
    changed = ref.model_copy(update={"content_hash": "h2"})
    cfg = {"sft": TinyConfig(), "seed": 1, "tags": {"b", "a", "c"}}
    key = stage_key("sft", cfg, {"data": ref}, "code1")
    assert key.startswith("sft/") and ArtifactStore("memory://k").uri_of(key)
    assert stage_key("sft", dict(reversed(list(cfg.items()))), {"data": moved}, "code1") == key
    assert stage_key("sft", {**cfg, "sft": TinyConfig().model_dump()}, {"data": ref}, "code1") == key
    others = [stage_key("sft", {**cfg, "seed": 2}, {"data": ref}, "code1"),
              stage_key("sft", {**cfg, "sft": TinyConfig(lr=2e-4)}, {"data": ref}, "code1"),
              stage_key("sft", cfg, {"data": changed}, "code1"),
              stage_key("sft", cfg, {"data": ref}, "code2"),
              stage_key("rm", cfg, {"data": ref}, "code1")]
    assert len({key, *others}) == 6
    with pytest.raises(ValueError, match="stage"):
        stage_key("sft/x", cfg, {}, "c")
    # A set's order follows the hash seed: the key must not.
    script = "from storage import stage_key; print(stage_key('s', {'t': {'x', 'y', 'z', 'w'}}, {}, 'c'))"
    runs = {subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(runs) == 1


# -- real faults -----------------------------------------------------------------------------
def test_publish_survives_the_s3_server_going_away(src, tmp_path):
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="fault")
        many = write_tree(tmp_path / "many", {f"part-{i:03d}.bin": os.urandom(2048) for i in range(80)})
        # One attempt and short timeouts, so that a dead endpoint fails the publish in seconds.
        store = ArtifactStore("s3://fault/root", storage_options={
            "client_kwargs": {"endpoint_url": endpoint},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5}})
        errors: list[BaseException] = []

        def publish():
            try:
                store.publish("sft/big", many, kind="sft_adapter")
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=publish)
        thread.start()
        deadline = time.time() + 10
        while s3.list_objects_v2(Bucket="fault").get("KeyCount", 0) == 0 and time.time() < deadline:
            time.sleep(0.01)
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="fault").get("Contents", [])]
        server.stop()  # mid-publish: the first files are up, the manifest is not
        thread.join(20)
        assert not thread.is_alive() and len(errors) == 1, errors
        assert keys and not any(k.endswith("MANIFEST.json") for k in keys)

        # The in-process server keeps its state across a restart: the orphans are there, and
        # they still do not count as an artifact.
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        left = [o["Key"] for o in s3.list_objects_v2(Bucket="fault").get("Contents", [])]
        assert 0 < len(left) < len(list(many.iterdir())) and not any(k.endswith("MANIFEST.json") for k in left)
        assert not store.exists("sft/big") and store.list() == []
        store.publish("sft/big", many, kind="sft_adapter")
        assert store.list() == ["sft/big"]
        assert read_tree(store.fetch("sft/big", cache_dir=tmp_path / "cache")) == read_tree(many)
    finally:
        server.stop()


CHILD = """
import json, sys
from storage import ArtifactStore
out = []
for uri in sys.argv[1:3]:
    try:
        ArtifactStore(uri).publish("sft/p", sys.argv[3], kind="sft_adapter")
        out.append(["ok", ""])
    except Exception as e:
        out.append([type(e).__name__, str(e)])
print(json.dumps(out))
"""


def drop_root_file_override() -> None:
    """Root ignores file modes (CAP_DAC_OVERRIDE): drop it from the child's bounding set so its
    exec'd Python gets the plain owner checks, as any non-root user would."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; 24 = PR_CAPBSET_DROP
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_read_only_root_raises_permission_error(tmp_path):
    src = write_tree(tmp_path / "src", {"a.bin": b"a", "b/c.bin": b"c"})
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, f"file://{ro}", f"file://{ro / 'sub'}", str(src)],
            cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            preexec_fn=drop_root_file_override if os.geteuid() == 0 else None)
        assert proc.returncode == 0, proc.stderr
        (kind1, msg1), (kind2, msg2) = json.loads(proc.stdout)
        assert kind1 == "PermissionError" and "'sft/p'" in msg1 and f"file://{ro}" in msg1, msg1
        assert kind2 == "PermissionError" and str(ro / "sub") in msg2, msg2
        assert list(ro.rglob("*")) == []  # no manifest, no data folder
        assert not ArtifactStore(f"file://{ro}").exists("sft/p")
    finally:
        ro.chmod(0o755)


def test_ref_only_keys_on_the_parts_a_consumer_reads(tmp_path):
    """A dataset whose prompts change keeps the hash of its SFT parts (so SFT is reused)."""
    store = ArtifactStore("memory://parts-" + tmp_path.name)

    def publish(prompts: str):
        d = tmp_path / prompts
        (d / "tokenizer").mkdir(parents=True)
        (d / "tokenizer" / "t.json").write_text("{}")
        (d / "sft_train.jsonl").write_text("sft\n")
        (d / "prompts_train.jsonl").write_text(prompts)
        return store.publish(f"data/{prompts}", d, kind="dataset")

    a, b = publish("p1"), publish("p2")
    assert a.content_hash != b.content_hash
    assert a.only("tokenizer", "sft_train.jsonl").content_hash == b.only("tokenizer", "sft_train.jsonl").content_hash
    assert a.only("prompts_train.jsonl").content_hash != b.only("prompts_train.jsonl").content_hash
    assert store.ref("data/p1").parts == a.parts
    with pytest.raises(KeyError, match="no parts"):
        a.only("pref_train.jsonl")


def test_rlhf_verify_rehashes_every_artifact(src, tmp_path, capsys):
    from flows.cli import main

    store = ArtifactStore(f"file://{tmp_path / 'store'}")
    store.publish("sft/a", src, kind="sft_adapter")
    store.publish("rm/b", src, kind="reward_model")
    assert main(["verify", "--set", f"store.uri={store.uri}"]) == 0
    store.verify("rm/b")
    path = Path(store._path("rm/b", store.manifest("rm/b")["data"], "weights.bin"))
    path.write_bytes(bytes([FILES["weights.bin"][0] ^ 1]) + FILES["weights.bin"][1:])  # same size: a hash sees it
    assert main(["verify", "--set", f"store.uri={store.uri}"]) == 1  # not fooled by this process's memo
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "rm/b" in out and "1 of 2 artifacts failed" in out
