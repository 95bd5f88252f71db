"""Wall time of the whole CLI, `rlhf run`, cold (empty store) beside warm (every stage cached).

    .venv/bin/python bench/warm_cold.py [--runs 5] [--cold-runs 5] [--out bench/results/warm_cold.json] [--set k=v ...]

Each cold run gets a fresh store; the warm runs reuse the last cold run's store and the Prefect
server the runs leave up (flows/server.py, under a private PREFECT_HOME; the first cold run starts
it). Then the server is stopped and one more warm run starts it again, as the first run after the
server idled out would (``warm_server_start_s``). Reported: every run's wall seconds and the
medians. The default config is the tests' small one (tests/test_flow.py SMALL).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["sft.max_steps=30", "rm.max_steps=20", "ppo.num_iterations=3", "ppo.rollout_batch_size=16",
         "ppo.train_batch_size=8", "ppo.checkpoint_every=2", "ppo.eval_every=3"]


def run(store: Path, sets: list[str], env: dict) -> float:
    args = [str(Path(sys.executable).parent / "rlhf"), "run"]
    for s in [*sets, f"store.uri=file://{store}"]:
        args += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(f"rlhf run failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    stages = [line.split("rlhf: ", 1)[1].strip() for line in (p.stdout + p.stderr).splitlines()
              if "rlhf: " in line and "local Prefect" not in line]
    print(f"  {wall:6.1f}s  " + " | ".join(stages), flush=True)
    return wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="warm runs")
    p.add_argument("--cold-runs", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "warm_cold.json"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides (default: the tests' small config)")
    a = p.parse_args(argv)
    sets = a.set or SMALL
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
        env.update(PREFECT_HOME=f"{tmp}/prefect", RLHF_CACHE=f"{tmp}/cache", RAY_USAGE_STATS_ENABLED="0",
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")
        print("cold (empty store):")
        cold = [run(Path(tmp) / f"store{i}", sets, env) for i in range(a.cold_runs)]
        rlhf = str(Path(sys.executable).parent / "rlhf")
        try:
            print("warm (every stage cached):")
            warm = [run(Path(tmp) / f"store{a.cold_runs - 1}", sets, env) for _ in range(a.runs)]
            subprocess.run([rlhf, "server", "stop"], env=env, check=True, capture_output=True)
            print("warm, the server stopped first (the run starts it):")
            warm_server_start = run(Path(tmp) / f"store{a.cold_runs - 1}", sets, env)
        finally:
            subprocess.run([rlhf, "server", "stop"], env=env, capture_output=True)
    result = {"cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0], "config": sets, "cold_s": cold,
              "warm_s": warm, "warm_server_start_s": warm_server_start,
              "cold_median_s": statistics.median(cold), "warm_median_s": statistics.median(warm)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"cold median {result['cold_median_s']:.1f}s, warm median {result['warm_median_s']:.1f}s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
