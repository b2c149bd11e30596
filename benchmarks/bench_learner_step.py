"""Learner step time: the demo's steps with and without skipping zero-advantage samples.

    .venv/bin/python benchmarks/bench_learner_step.py [--steps 2] [--samples 30] [--zero-fraction 0.62]

A sample whose advantage is 0 (every attempt of its group scored alike) has an exactly zero
gradient when there is no KL term, so the learner does not run it
(``StepConfig.skip_zero_advantage``, learner/step.py ``contributes``). In the calculator
demo's recorded run 153 of 246 samples (62 %) had advantage 0. This benchmark builds the
demo's learner (SmolLM2 + LoRA, the pipeline's own ``learner_config()``), then for each of
``--steps`` demo-shaped sample sets (prompt + short answer, whole groups of 4 with zero
advantage at ``--zero-fraction``) takes one step without skipping and one with, in the same
process one after the other (same machine load, same shapes), and prints the time ratio.
The two updates are the same (unit test: tests/unit/learner/test_step.py); only the time
differs. JSON goes to benchmarks/results/learner_step.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_learner_memory import demo_learner_config, demo_like_step

RESULTS = Path(__file__).parent / "results"


def with_zero_groups(samples: list[dict[str, Any]], fraction: float, seed: int) -> list[dict[str, Any]]:
    """Groups of 4 consecutive samples; ``fraction`` of the groups get advantage 0 (no spread)."""
    rng = random.Random(seed)
    groups = [samples[i:i + 4] for i in range(0, len(samples), 4)]
    zero = set(rng.sample(range(len(groups)), round(fraction * len(groups))))
    for g, members in enumerate(groups):
        for s in members:
            if g in zero:
                s["advantage"] = 0.0
    return samples


def timed_step(step: Callable[[list[dict[str, Any]], float], Any], samples: list[dict[str, Any]],
               lr: float) -> dict[str, Any]:
    """One learner step (``trainer.step``) on ``samples``: its seconds and what it ran."""
    t0 = time.perf_counter()
    m = step(samples, lr)
    return {"seconds": round(time.perf_counter() - t0, 2), "input_tokens": m.input_tokens,
            "skipped_samples": m.zero_advantage_skipped, "loss": m.loss}


def alternate(variants: Mapping[str, Callable[[list[dict[str, Any]]], dict[str, Any]]],
              sample_sets: Iterable[list[dict[str, Any]]],
              describe: Callable[[dict[str, Any]], str]) -> tuple[list[dict[str, Any]], float]:
    """Each sample set stepped by every variant (:func:`timed_step` results), one after the other: the
    same machine load and shapes for all. Rows carry the first variant's seconds over the second's;
    returns them and the median ratio, printing ``describe(row)`` per set."""
    first, second = list(variants)[:2]
    rows = []
    for step, samples in enumerate(sample_sets):
        row: dict[str, Any] = {"step": step, **{name: run(samples) for name, run in variants.items()}}
        row["ratio"] = round(row[first]["seconds"] / row[second]["seconds"], 2)
        rows.append(row)
        print(f"step {step}: {describe(row)}: {row['ratio']:.2f}x", flush=True)
    return rows, statistics.median(r["ratio"] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="sample sets, each stepped with and without skipping")
    ap.add_argument("--samples", type=int, default=32, help="samples per step (the demo: 29-32)")
    ap.add_argument("--zero-fraction", type=float, default=0.62, help="share of groups with advantage 0")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()

    from boltstream.learner.memory import pin_mmap_threshold
    from boltstream.learner.model_setup import vocab_size
    from boltstream.learner.step_plan import plan_step
    from boltstream.learner.trainer import make_trainer

    cfg = demo_learner_config(args.model, pinned=True)
    pin_mmap_threshold(cfg.malloc_mmap_threshold_kb)
    trainer = make_trainer(cfg)
    vocab = vocab_size(trainer.model)
    base = trainer.plan.cfg

    def planned(skip: bool) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        def run(samples: list[dict[str, Any]]) -> dict[str, Any]:
            trainer.plan = plan_step(trainer.model, dataclasses.replace(base, skip_zero_advantage=skip),
                                     ref_model=trainer.ref_model)
            return timed_step(trainer.step, samples, cfg.lr)
        return run

    sets = (with_zero_groups(demo_like_step(vocab, step, args.samples), args.zero_fraction, step)
            for step in range(args.steps))
    rows, ratio = alternate(
        {"all": planned(False), "skip": planned(True)}, sets,
        lambda row: (f"all samples {row['all']['seconds']:.1f} s ({row['all']['input_tokens']} tokens), "
                     f"zero-advantage skipped {row['skip']['seconds']:.1f} s ({row['skip']['input_tokens']} "
                     f"tokens, {row['skip']['skipped_samples']} samples not run)"))
    print(f"learner step, demo shape, {args.zero_fraction:.0%} of groups at advantage 0: "
          f"skipping them is {ratio:.2f}x faster (median of {len(rows)})")
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": "learner_step", "machine": platform.node(), "args": vars(args), "steps": rows,
           "median_ratio": ratio}
    (RESULTS / "learner_step.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
