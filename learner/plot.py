"""Learning curves from a learner metrics JSONL file, as one PNG (``boltstream learn --plot IN OUT``).

Reads the surviving step history (:func:`.metrics.read_steps`: steps redone after a
resume replace the crashed run's), so the curves show what the published weights went
through. Checkpoints are drawn as vertical lines. matplotlib's Agg backend: no display.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .metrics import read_records, read_steps

logger = logging.getLogger(__name__)

# (record key, panel title); panels whose key never appears are left out
PANELS = (
    ("loss", "policy loss"),
    ("reward_mean", "group reward (mean)"),
    ("advantage_mean", "advantage mean ± std"),
    ("clip_fraction", "clip fraction"),
    ("approx_kl", "approx. KL (behaviour → current)"),
    ("entropy", "entropy (nats/token)"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s (compute | wall)"),
    ("staleness", "mean staleness (versions)"),
    ("dropped_total", "samples/records dropped (cumulative)"),
)


def _mean_staleness(hist: dict[str, int]) -> float | None:
    known = {int(k): v for k, v in hist.items() if k.isdigit()}
    total = sum(known.values())
    return sum(k * v for k, v in known.items()) / total if total else None


def _series(steps: list[dict[str, Any]], key: str) -> list[float | None]:
    if key == "staleness":
        return [_mean_staleness(r.get("staleness", {})) for r in steps]
    if key == "dropped_total":
        return [float(sum(r.get("dropped_total", {}).values())) for r in steps]
    return [r.get(key) for r in steps]


def plot_metrics(metrics_path: str | Path, out_path: str | Path, title: str | None = None) -> Path:
    """Render ``metrics_path`` to ``out_path`` (PNG); returns the output path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics_path)
    steps = read_steps(records)
    if not steps:
        raise ValueError(f"{metrics_path} holds no step records")
    checkpoints = sorted({int(r["step"]) for r in records if r.get("event") == "checkpoint"})
    panels = [(k, t) for k, t in PANELS if any(v is not None for v in _series(steps, k))]
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.6 * rows), sharex=True, squeeze=False)
    x = [r["step"] for r in steps]
    for ax, (key, label) in zip(axes.flat, panels, strict=False):
        y = _series(steps, key)
        ax.plot(x, [float("nan") if v is None else v for v in y], lw=1.2, marker="." if len(x) < 50 else None)
        if key == "advantage_mean":
            std = [r.get("advantage_std") or 0.0 for r in steps]
            lo = [(m or 0.0) - s for m, s in zip(y, std, strict=True)]
            hi = [(m or 0.0) + s for m, s in zip(y, std, strict=True)]
            ax.fill_between(x, lo, hi, alpha=0.2)
        if key == "tokens_per_s":
            ax.plot(x, [r.get("wall_tokens_per_s") for r in steps], lw=1.0, ls="--")
        for c in checkpoints:
            ax.axvline(c, color="grey", alpha=0.25, lw=0.8)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("learner step")
    fig.suptitle(title or f"{Path(metrics_path).name}: {len(steps)} steps, {len(checkpoints)} checkpoints",
                 fontsize=10)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    logger.info("plotted %d steps to %s", len(steps), out)
    return out
