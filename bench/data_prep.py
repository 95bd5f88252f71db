"""Data prep throughput and peak memory on a generated JSONL of a given size (CPU).

    .venv/bin/python bench/data_prep.py --mb 64 256 1024 --out bench/results/data_prep_cpu.json

For each size a fresh process writes an HH-style preference file (full transcripts, the prompt
implicit) of that many MB, then times the two passes data prep makes over it: the validating
scan (pre-flight and the key: read + hash + parse) and the build (read + parse + tokenize +
write the artifact). Records/s, MB/s and the process's peak RSS per size, side by side: a peak
that does not grow with the file is what "streamed" means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "river", "lamp", "garden", "city", "tree"]
WORDS = "kind warm calm bright gentle rude cold sad dark cruel and the is very quite".split()


def write_file(path: Path, mb: int) -> int:
    import random

    rng, n, target = random.Random(0), 0, mb * 2**20
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < target:
            a = rng.choice(ANIMALS)
            turns = "".join(f"\n\nHuman: Tell me more about the {a}.\n\nAssistant: " + " ".join(rng.choices(WORDS, k=12))
                            for _ in range(rng.randint(0, 2)))
            head = f"\n\nHuman: Describe the {a}.{turns}\n\nHuman: And now?\n\nAssistant:"
            chosen = " " + " ".join(rng.choices(WORDS, k=rng.randint(8, 40)))
            rejected = " " + " ".join(rng.choices(WORDS, k=rng.randint(8, 40)))
            f.write(json.dumps({"chosen": head + chosen, "rejected": head + rejected}) + "\n")
            n += 1
    return n


def child(mb: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from storage.store import ArtifactStore
    from tasks.common.model import ModelConfig
    from tasks.data.config import DataConfig
    from tasks.data.prepare import check_data, data_key, prepare_data

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        src = Path(tmp) / "pairs.jsonl"
        n_lines = write_file(src, mb)
        size = src.stat().st_size
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cfg, model = DataConfig(preference_path=str(src), max_length=256), ModelConfig()
        t = time.perf_counter()
        kept = check_data(cfg)["preference"]
        scan_s = time.perf_counter() - t
        key = data_key(cfg, model, 0)  # memoised: no second read
        store = ArtifactStore(f"file://{tmp}/store")
        t = time.perf_counter()
        ref = prepare_data(cfg, model, store, 0, key=key)
        build_s = time.perf_counter() - t
        meta = json.loads((store.fetch(ref.key) / "meta.json").read_text())["sources"]["preference"]
    return {"mb": mb, "bytes": size, "records": n_lines, "kept": kept, "samples": meta["samples"],
            "tokens": meta["tokens"], "truncated": meta["truncated"],
            "scan_s": round(scan_s, 2), "scan_records_per_s": round(n_lines / scan_s), "scan_mb_per_s": round(size / 2**20 / scan_s, 1),
            "build_s": round(build_s, 2), "build_records_per_s": round(n_lines / build_s), "build_mb_per_s": round(size / 2**20 / build_s, 2),
            "peak_rss_mib_before_data_prep": round(rss_before / 1024), "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--out", default="bench/results/data_prep_cpu.json")
    ap.add_argument("--child", type=int)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return
    rows = []
    for mb in a.mb:
        out = subprocess.run([sys.executable, __file__, "--child", str(mb)], capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": f"{platform.node()} {os.cpu_count()} cores {platform.processor()}",
              "python": platform.python_version(), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
