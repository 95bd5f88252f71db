"""What a stage shows on its Prefect artifact pages: a progress bar while it runs, then a card
with the artifact's URI, its metrics, its curves as an image and (PPO) the samples table.

The curves come from the artifact's own ``tensorboard/`` event files (tasks/common/tracking.py),
so the page, TensorBoard and MLflow show the same numbers. Prefect and matplotlib are imported
here only, in the process that runs the stage's Prefect task.
"""

from __future__ import annotations

import base64
import io
import json
import time
from contextlib import contextmanager
from typing import Iterator

from storage.store import ArtifactRef, ArtifactStore

CURVES = {"sft": ("sft/loss", "sft/eval_loss", "sft/lr"),
          "rm": ("rm/loss", "rm/eval_accuracy", "rm/eval_margin"),
          "ppo": ("ppo/reward_mean", "ppo/kl", "ppo/response_length", "eval/rm_score", "eval/true_score", "eval/kl")}
UPDATE_EVERY_S = 2.0  # progress updates are API calls: at most one per this many seconds


@contextmanager
def progress(stage: str) -> Iterator[None]:
    """A Prefect progress artifact ``rlhf-<stage>-progress`` that follows the stage's steps
    (every ``Tracker.log`` of this process) while the block runs."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from tasks.common.tracking import listen

    art = create_progress_artifact(0.0, key=f"rlhf-{stage}-progress", description=f"{stage}: steps done, %")
    last = [0.0]

    def on_log(name: str, step: int, total: int | None, metrics: dict) -> None:
        if name == stage and total and (time.monotonic() - last[0] > UPDATE_EVERY_S or step >= total):
            update_progress_artifact(art, min(100.0, 100.0 * step / total))
            last[0] = time.monotonic()

    with listen(on_log):
        yield
    update_progress_artifact(art, 100.0)


def publish_card(stage: str, store: ArtifactStore, ref: ArtifactRef) -> None:
    """The stage's markdown card (key ``rlhf-<stage>``): URI, metrics, curves, PPO's tables."""
    from prefect.artifacts import create_markdown_artifact

    m = store.manifest(ref.key)
    rows = "\n".join(f"| `{k}` | {_fmt(v)} |" for k, v in sorted(m["metrics"].items()) if not isinstance(v, (list, dict)))
    md = f"## {stage}: `{ref.kind}`\n\nURI: `{ref.uri}`\n\ncontent hash: `{ref.content_hash[:16]}`\n\n"
    if stage in CURVES and "tensorboard" in ref.parts:
        png = curve_png(stage, store.fetch(ref.key) / "tensorboard")
        md += f"![{stage} curves](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
    if stage == "ppo":  # the samples under the curves, before the long tables
        md += _ppo_samples(store, ref)
    md += f"| metric | value |\n|---|---|\n{rows}\n"
    if stage == "ppo":
        md += _ppo_iterations(store, ref)
    create_markdown_artifact(key=f"rlhf-{stage}", markdown=md, description=f"{stage} artifact {ref.uri}")


def curve_png(stage: str, logdir) -> bytes:
    """One small plot per curve of ``CURVES[stage]`` found in the event files, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.common.tracking import read_scalars

    series = read_scalars(logdir)
    tags = [t for t in CURVES[stage] if t in series]
    cols = min(3, len(tags))
    rows = -(-len(tags) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        steps, values = zip(*series[tag])
        ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3)
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel("iteration" if stage == "ppo" else "step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tags):]:
        ax.set_visible(False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _history(store: ArtifactStore, ref: ArtifactRef) -> list[dict]:
    path = store.fetch(ref.key) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _ppo_samples(store: ArtifactStore, ref: ArtifactRef) -> str:
    from tasks.ppo.train import samples_markdown

    evals = [h for h in _history(store, ref) if "eval/samples" in h]
    if not evals:
        return ""
    return f"### samples: held-out prompts, SFT policy vs the trained policy\n\n{samples_markdown(evals[0], evals[-1])}\n\n"


def _ppo_iterations(store: ArtifactStore, ref: ArtifactRef) -> str:
    history = _history(store, ref)
    lines = ["\n### per iteration\n", "| iteration | reward mean | KL | policy loss | eval RM score | eval true score |", "|---|---|---|---|---|---|"]
    for rec in history:
        lines.append(f"| {rec.get('iteration', '')} | {_fmt(rec.get('ppo/reward_mean'))} | {_fmt(rec.get('ppo/kl'))} | "
                     f"{_fmt(rec.get('ppo/policy_loss'))} | {_fmt(rec.get('eval/rm_score'))} | {_fmt(rec.get('eval/true_score'))} |")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))
