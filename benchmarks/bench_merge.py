"""A new LoRA policy version in the worker, up to its first decode step: a fresh copy merged by PEFT vs
the copy of the version before the current one merged in place.

    .venv/bin/python benchmarks/bench_merge.py [--model smollm2] [--serve-dtype float32|auto] [--versions 6]

Both ways run in this process on the same base weights and the learner's adapter shape (rank 16 on
every linear layer of the decoder, random non-zero factors: one per version). Each version is timed
from the adapter directory on disk to the end of the first decode step on it (16 rows, 256 tokens of
context): the merge, and for the decode step a new model object's probe, fused weights and packed
copies, or a recycled one's refresh of them. The two must agree: each version's decode-step logits
are compared (equal bit for bit is expected; the largest difference is printed). Prints the median per
version of each way and their ratio, with the CPU's flags, the dtype and torch's threads; JSON to
benchmarks/results/merge.json.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_reload import lora_checkpoints
from machine import as_command, cpu_facts, describe_cpu, write_report

RESULTS = Path(__file__).parent / "results"
ROWS, CONTEXT = 16, 256


def context(model: Any) -> list[tuple[Any, Any]]:
    """Keys and values of ``ROWS`` rows of ``CONTEXT`` tokens (computed once: a decode step reads them)."""
    import torch

    from boltstream.inference import transformers_internals

    with torch.inference_mode():
        ids = torch.arange(CONTEXT).remainder(1000).repeat(ROWS, 1)
        return transformers_internals.layers_of(model(input_ids=ids, use_cache=True).past_key_values)


def first_step(model: Any, kv: Any) -> tuple[Any, float]:
    """One decode step of ``ROWS`` rows on ``model`` over ``kv`` (its step built or refreshed first, if
    new): its logits and the step's own seconds."""
    import torch

    from boltstream.inference import llama_step

    with torch.inference_mode():
        step = llama_step.step_for(model)
        started = time.perf_counter()
        logits = step(torch.full((ROWS,), 7), torch.full((ROWS, 1), CONTEXT),
                      torch.ones(ROWS, CONTEXT + 1, dtype=torch.long), kv)
        return logits, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--serve-dtype", default="float32", help="float32 or auto (bfloat16 on a CPU with native bf16)")
    p.add_argument("--versions", type=int, default=6)
    p.add_argument("--out", default=str(RESULTS / "merge.json"))
    args = p.parse_args(argv)
    as_command("serve")
    import torch

    from boltstream.inference.llama_step import KVBuffer
    from boltstream.inference.transformers_backend import TransformersBackend
    from boltstream.learner.config import LORA_TARGETS
    from boltstream.weights.models import load_model, resolve_dtype

    dtype = resolve_dtype(args.serve_dtype) or "float32"
    base, tokenizer = load_model(args.model, dtype=dtype)
    base.eval()
    facts = cpu_facts()
    print(f"machine: {describe_cpu(facts)}; dtype {dtype}; torch threads {torch.get_num_threads()}")
    layers = context(base)
    first_step(base, KVBuffer.from_layers(layers))  # the base's own step: probed and packed outside the timings
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as d:
        dirs = lora_checkpoints(args.model, Path(d), args.versions, LORA_TARGETS)
        ways = {"peft_fresh_copy": TransformersBackend(base, tokenizer, model_name="m", merge_lora=True),
                "recycled_in_place": TransformersBackend(base, tokenizer, model_name="m", merge_lora=True)}
        times: dict[str, list[float]] = {w: [] for w in ways}
        step_s: dict[str, list[float]] = {w: [] for w in ways}
        worst = 0.0
        loop = asyncio.new_event_loop()  # one, as in the worker: its executor threads are reused
        for version, path in enumerate(dirs, start=1):
            logits = {}
            for way, backend in ways.items():
                kv = KVBuffer.from_layers(layers)
                started = time.perf_counter()
                if way == "peft_fresh_copy":  # the way every version was loaded before
                    model = backend._peft_merged(path)
                else:  # the worker's own reload
                    loop.run_until_complete(backend.load_weights(path, "lora", version))
                    model = backend._policies[None].model
                logits[way], step = first_step(model, kv)
                times[way].append(time.perf_counter() - started)
                step_s[way].append(step)
            worst = max(worst, float((logits["peft_fresh_copy"] - logits["recycled_in_place"]).abs().max()))
            print(f"{path.name}: " + ", ".join(f"{w} {times[w][-1]:.2f} s" for w in ways), flush=True)
        loop.close()
    # the first two versions of the recycled way are fresh copies too (nothing to recycle yet)
    med = {w: statistics.median(t[2:] or t) for w, t in times.items()}
    ratio = med["peft_fresh_copy"] / med["recycled_in_place"]
    print(f"\nper version, adapter on disk -> first decode step done (median of versions 3-{args.versions}):")
    for w in ways:
        print(f"  {w:18s} {med[w]:6.2f} s   (the decode step itself {statistics.median(step_s[w]) * 1e3:.0f} ms)")
    print(f"ratio fresh / recycled: {ratio:.1f}x; largest logit difference between the two: {worst:.3g}")
    write_report(args.out, {"benchmark": "merge", "model": args.model, "dtype": dtype, "machine": facts,
                            "platform": platform.machine(), "python": sys.version.split()[0],
                            "seconds_per_version": times, "median_s": med, "ratio": ratio,
                            "max_abs_logit_diff": worst})
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
