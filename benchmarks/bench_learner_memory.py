"""Learner memory: peak RSS per phase of the demo's learner, with and without the pinned mmap threshold.

    .venv/bin/python benchmarks/bench_learner_memory.py [--steps 3] [--samples 16] [--model smollm2]

Each variant runs in a process of its own (a process's heap is what is measured), which
builds the trainer exactly as ``boltstream learn`` does in ``boltstream demo`` (SmolLM2 +
LoRA on every linear layer, lr 1e-3, 1,024 tokens per micro-batch, kl_coef 0: the
pipeline's own ``learner_config()``), on ONE model thread as the learner loop does, and
trains on synthetic steps shaped like the demo's (4 groups x 4 rollouts: 16 samples of
150-230 tokens, 15-40 of them response). Phases, each with its own peak (the kernel's
high-water mark is reset between them): import, model load, the first micro-batch's
forward (plus the bytes autograd saved for backward: what the step needs by itself),
the first optimizer step, the later steps. Anonymous vs file-backed memory separates the
heap from the memory-mapped weights and torch's libraries.

Variants (run side by side): ``glibc`` (``--malloc-mmap-threshold-kb none``: glibc's rising threshold, the
baseline) and ``pinned`` (the learner's default, see learner/memory.py). The ratio of
their peaks is printed; the goal is the demo's learner under 4 GB. Step seconds are
printed too (the shared machine makes them noisy). JSON goes to
benchmarks/results/learner_memory.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("glibc", "pinned")
GOAL_MB = 4096.0


def demo_learner_config(model: str, pinned: bool) -> Any:
    """The learner settings ``boltstream demo`` runs with; ``pinned=False`` turns the mmap threshold off."""
    import dataclasses

    from boltstream.learner.config import LearnerConfig
    from boltstream.runs.pipeline import PipelineConfig

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tasks.jsonl"
        data.write_text("{}\n")
        pipeline = PipelineConfig(agent="calc", train=data, test=data, out=Path(tmp), model=model,
                                  learner={"lr": 1e-3, "groups_per_step": 4})
        cfg: LearnerConfig = pipeline.learner_config()
    return cfg if pinned else dataclasses.replace(cfg, malloc_mmap_threshold_kb=None)


def demo_like_step(vocab: int, seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` samples shaped like the calculator demo's LLM calls (prompt + short answer)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(150, 230)
        plen = length - rng.randint(15, 40)
        mask = [False] * plen + [True] * (length - plen)
        out.append({"token_ids": [rng.randrange(3, vocab) for _ in range(length)], "prompt_length": plen,
                    "loss_mask": mask, "behaviour_logprobs": [-1.0 if m else 0.0 for m in mask],
                    "advantage": 1.0 if i % 2 else -1.0, "loss_weight": 1.0, "temperature": 0.7})
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant, in this process: phases in order, each with its own peak."""
    from boltstream.learner.memory import memory_status, reset_peak_rss

    phases: list[dict[str, Any]] = []

    def phase(name: str, t0: float, **extra: Any) -> None:
        phases.append({"phase": name, "seconds": round(time.perf_counter() - t0, 2), **memory_status(), **extra})
        reset_peak_rss()

    t0 = time.perf_counter()
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from boltstream.learner.collate import micro_batches
    from boltstream.learner.memory import pin_mmap_threshold
    from boltstream.learner.model_setup import vocab_size
    from boltstream.learner.step import sequence_logprobs
    from boltstream.learner.trainer import make_trainer

    cfg = demo_learner_config(args.model, pinned=args.child == "pinned")
    phase("import", t0, torch_threads=torch.get_num_threads())
    if cfg.malloc_mmap_threshold_kb is not None:  # what boltstream learn's main does first
        pin_mmap_threshold(cfg.malloc_mmap_threshold_kb)
    model_thread = ThreadPoolExecutor(1)  # the learner loop's single model thread
    t0 = time.perf_counter()
    trainer = model_thread.submit(make_trainer, cfg).result()
    vocab = vocab_size(trainer.model)
    phase("model load", t0)

    def first_forward() -> dict[str, float]:
        batch = micro_batches(demo_like_step(vocab, 0, args.samples), cfg.step.max_tokens_per_micro_batch,
                              trainer.plan.cfg.pad_token_id)[0]
        params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                saved[ptr] = t.untyped_storage().nbytes()
            # Detached: a node's own output packed as itself would hold its grad_fn, a cycle that kept
            # this forward's whole graph (1.15 GB) alive into the steps after it.
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sequence_logprobs(trainer.model, batch, trainer.plan.cfg, with_entropy=True, fused_head=trainer.plan.fused_head)
        return {"saved_for_backward_mb": round(sum(saved.values()) / 2**20, 1),
                "micro_batch_shape": list(batch.input_ids.shape)}

    t0 = time.perf_counter()
    extra = model_thread.submit(first_forward).result()
    phase("first forward", t0, **extra)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        m = model_thread.submit(trainer.step, demo_like_step(vocab, step, args.samples), cfg.lr).result()
        if step == 1 or step == args.steps:
            phase("first step" if step == 1 else f"steps 2-{args.steps}", t0, micro_batches=m.micro_batches,
                  input_tokens=m.input_tokens, step_seconds=round(m.seconds, 1))
    model_thread.shutdown()
    return {"variant": args.child, "malloc_mmap_threshold_kb": cfg.malloc_mmap_threshold_kb,
            "peak_mb": max(p["peak_rss_mb"] for p in phases), "phases": phases}


def run_variants(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every variant in its own process, side by side: both see the same machine load, so their step
    seconds compare (RSS does not depend on load)."""
    procs = {}
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--samples",
               str(args.samples), "--model", args.model]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                raise SystemExit(f"variant {name} failed ({proc.returncode}):\n{err[-3000:]}")
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=16, help="samples per step (the demo: 4 groups x 4)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the variants may take")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be >= 2 (the later steps are a phase of their own)")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    results = run_variants(args)
    for name, r in results.items():
        print(f"{name} (mmap threshold {r['malloc_mmap_threshold_kb'] or 'glibc, rising'} KiB): "
              f"peak {r['peak_mb']:.0f} MiB")
        for ph in r["phases"]:
            extra = {k: v for k, v in ph.items() if k not in ("phase", "rss_mb", "peak_rss_mb", "anon_mb", "file_mb")}
            print(f"  {ph['phase']:<12} peak {ph['peak_rss_mb']:>6.0f}  after {ph['rss_mb']:>6.0f} "
                  f"(anon {ph['anon_mb']:>6.0f}, file {ph['file_mb']:>5.0f}) MiB  {extra}")
    ratio = results["pinned"]["peak_mb"] / results["glibc"]["peak_mb"]
    ok = results["pinned"]["peak_mb"] <= GOAL_MB
    print(f"peak RSS pinned / glibc: {ratio:.2f} ({results['pinned']['peak_mb']:.0f} vs "
          f"{results['glibc']['peak_mb']:.0f} MiB); goal <= {GOAL_MB:.0f} MiB: {'met' if ok else 'NOT met'}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "learner_memory.json"
    out.write_text(json.dumps({"machine": platform.platform(), "model": args.model, "steps": args.steps,
                               "samples_per_step": args.samples, "ratio_pinned_vs_glibc": ratio,
                               "goal_mb": GOAL_MB, "goal_met": ok, "variants": results}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
