"""What one GPU run of the flow measured, from its store and an nvidia-smi sample file (bench/gpu_run.sh).

    python3 bench/gpu_summary.py STORE_ROOT GPU_CSV   # -> JSON: stage wall times, PPO samples/s, memory, GPU busy share

Samples/s = rollout batch / mean iteration time, iteration 1 (compilation) left out; the GPU's busy
share is the share of 250 ms nvidia-smi samples with utilization > 0 within the PPO iterations' span.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from pathlib import Path


def main(root: str, csv: str) -> dict:
    out: dict = {"stages": {}}
    manifests = sorted(Path(root).glob("*/*/MANIFEST.json"))
    for p in manifests:
        m = json.loads(p.read_text())
        stage = m["key"].split("/")[0]
        if m["kind"] in ("dataset", "sft_adapter", "reward_model", "ppo_actor"):
            out["stages"][stage] = {"created_at": m["created_at"], "placement": m.get("placement") or m["config"].get("placement")}
            if m["kind"] == "ppo_actor":
                ppo_dir = p.parent / m["data"]
                hist = [json.loads(x) for x in (ppo_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
                steps = [h for h in hist if "time/iteration_s" in h]
                steady = steps[1:] or steps
                batch = m["config"].get("ppo", {}).get("rollout_batch_size") or m["config"].get("rollout_batch_size")
                it_s = sum(h["time/iteration_s"] for h in steady) / len(steady)
                out["ppo"] = {"iterations": len(steps), "iterations_total_s": sum(h["time/iteration_s"] for h in steps),
                              "first_iteration_s": steps[0]["time/iteration_s"], "steady_iteration_s": it_s,
                              "rollout_batch_size": batch, "samples_per_s": batch / it_s if batch else None,
                              "phases_s_mean": {k: sum(h[k] for h in steady) / len(steady) for k in steady[0] if k.startswith("time/")},
                              "memory": {k: v for k, v in m["metrics"].items() if k.startswith("memory/")},
                              "reward_first_last": [steps[0].get("ppo/reward_mean"), steps[-1].get("ppo/reward_mean")],
                              "kl_last": steps[-1].get("ppo/kl")}
    rows = []
    for line in Path(csv).read_text().splitlines() if Path(csv).exists() else []:
        parts = [x.strip() for x in line.split(",")]
        try:
            rows.append((datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f"), float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    if rows:
        out["gpu"] = {"samples": len(rows), "busy_share_whole_run": sum(u > 0 for _, u, _ in rows) / len(rows),
                      "mean_util_whole_run": sum(u for _, u, _ in rows) / len(rows), "max_memory_used_mib": max(m for _, _, m in rows)}
        st = out["stages"]
        if "ppo" in out:  # the PPO iterations' span: their summed time, back from PPO's manifest (not from SFT/RM's,
            # which a store seeded with another run's artifacts dates from that run)
            end = datetime.fromisoformat(st["ppo"]["created_at"]).replace(tzinfo=None)
            start = end - timedelta(seconds=out["ppo"]["iterations_total_s"])
            span = [u for ts, u, _ in rows if start <= ts <= end]
            if span:
                out["gpu"]["ppo_iterations_s"] = out["ppo"]["iterations_total_s"]
                out["gpu"]["busy_share_ppo_iterations"] = sum(u > 0 for u in span) / len(span)
                out["gpu"]["mean_util_ppo_iterations"] = sum(span) / len(span)
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3]), indent=1, default=str))
