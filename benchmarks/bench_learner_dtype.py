"""Learner step time in float32 and with a LoRA learner's base weights in bfloat16, same run.

    .venv/bin/python benchmarks/bench_learner_dtype.py [--steps 3] [--samples 32] [--zero-fraction 0.5]

Where the worker serves bfloat16, a run gives its LoRA learner ``--dtype bfloat16``
(``PipelineConfig.learner_dtype``): the frozen base weights multiply in bf16 while the
adapter and its optimizer stay float32. This benchmark builds the demo's learner both
ways (the pipeline's own ``learner_config()``), then steps each on the same demo-shaped
sample sets, alternating (same machine load, same shapes), and prints the time ratio
with the CPU's flags, torch's threads and the allocator. It re-runs itself with the allocator a
run's learner gets (tcmalloc preloaded where installed, else glibc with the learner's mmap pin:
the pin alone made these steps 1.5-2x slower). Without native bf16 (no ``avx512_bf16`` /
``amx_bf16``) torch emulates it and a run keeps float32. The two updates are not equal
(bf16 rounds the base's products); what they cost in learning is the demo's seeds table
with ``--serve-dtype auto``, and their log-prob agreement with the worker is
``bench_logprob_agreement.py``. JSON goes to benchmarks/results/learner_dtype.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_learner_memory import demo_learner_config, demo_like_step
from bench_learner_step import alternate, timed_step, with_zero_groups
from machine import as_command, cpu_facts, describe_cpu, write_report

RESULTS = Path(__file__).parent / "results"
DTYPES = ("float32", "bfloat16")
CHILD = "BOLTSTREAM_BENCH_ALLOCATOR_SET"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="sample sets, each stepped in both dtypes")
    ap.add_argument("--samples", type=int, default=32, help="samples per step (the demo: 29-32)")
    ap.add_argument("--zero-fraction", type=float, default=0.5, help="share of groups with advantage 0")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(RESULTS / "learner_dtype.json"))
    args = ap.parse_args()
    from boltstream.allocator import active_allocator, child_env

    if os.environ.get(CHILD) is None:  # as a run starts its learner: the allocator is chosen at exec
        os.execve(sys.executable, [sys.executable, *sys.argv], {**child_env(os.environ), CHILD: "1"})
    as_command("learn")

    from boltstream.learner.memory import pin_mmap_threshold
    from boltstream.learner.model_setup import vocab_size
    from boltstream.learner.trainer import make_trainer

    base = demo_learner_config(args.model, pinned=True)
    pin_mmap_threshold(base.malloc_mmap_threshold_kb)
    trainers = {d: make_trainer(dataclasses.replace(base, dtype=d)) for d in DTYPES}
    facts = cpu_facts()
    facts["allocator"] = active_allocator()
    print(f"machine: {describe_cpu(facts)}, allocator {facts['allocator']}", flush=True)
    vocab = vocab_size(trainers["float32"].model)
    sets = (with_zero_groups(demo_like_step(vocab, step, args.samples), args.zero_fraction, step)
            for step in range(args.steps))
    rows, ratio = alternate(
        {d: functools.partial(timed_step, t.step, lr=base.lr) for d, t in trainers.items()}, sets,
        lambda row: (f"float32 {row['float32']['seconds']:.1f} s, base in bfloat16 "
                     f"{row['bfloat16']['seconds']:.1f} s ({row['float32']['input_tokens']} tokens)"))
    print(f"learner step, demo shape, LoRA: base weights in bfloat16 {ratio:.2f}x the float32 step "
          f"(median of {len(rows)})")
    write_report(args.out, {"benchmark": "learner_dtype", "machine": facts, "args": vars(args), "steps": rows,
                            "median_ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
