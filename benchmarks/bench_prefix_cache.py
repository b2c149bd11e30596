"""Prefill compute with the prefix cache on vs off, on the demo's held-out evaluation, same run.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--model smollm2] [--tasks 32] [--samples 2] [--mib 256]

The calculator agent's held-out evaluation (``boltstream evaluate``'s measurement:
``--tasks`` test tasks x ``--samples`` attempts at the agent's temperature 0.7,
8 threads) runs against a real ``boltstream serve`` worker (own process, no
capture, no reload), once with ``--prefix-cache-mib 0`` and once with ``--mib``.
Each worker's ``/metrics`` gives the prefill tokens computed and saved and the
cache's hits; the printed ratio is prefill tokens computed off / on. Sampling
is not seeded (as in evaluation), so the two runs' conversations differ a
little; their total prompt tokens are printed next to it. Wall time is the
evaluation's; on a shared machine its ratio is indicative only.
JSON goes to benchmarks/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from boltstream.examples.calc import tasks as calc_tasks
from boltstream.examples.calc.agent import solve
from boltstream.inference.launch import WorkerProcess
from boltstream.runs.pipeline import MODEL_NAME, evaluate

RESULTS = Path(__file__).parent / "results"
METRICS = {"computed": "boltstream_inference_prefill_tokens_computed_total",
           "saved": "boltstream_inference_prefill_tokens_saved_total",
           "hits": "boltstream_inference_prefix_cache_hits_total",
           "misses": "boltstream_inference_prefix_cache_misses_total",
           "evictions": "boltstream_inference_prefix_cache_evictions_total",
           "cache_bytes": "boltstream_inference_prefix_cache_bytes",
           "cache_tokens": "boltstream_inference_prefix_cache_tokens"}


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return {key: values.get(metric, 0.0) for key, metric in METRICS.items()}


def one_run(args: argparse.Namespace, mib: int, tasks: list[dict[str, Any]], logs: Path) -> dict[str, Any]:
    argv = ["--model", args.model, "--served-model-name", MODEL_NAME, "--port", "0", "--no-capture", "--no-reload",
            "--prefix-cache-mib", str(mib)]
    with WorkerProcess(argv, log_path=logs / f"worker-{mib}.log") as worker:
        assert worker.url is not None
        t0 = time.perf_counter()
        result = evaluate(solve, tasks, f"{worker.url}/v1", args.samples)
        wall = time.perf_counter() - t0
        m = scrape(worker.url)
    return {"prefix_cache_mib": mib, "wall_s": wall, "score": result["score"],
            "prompt_tokens": m["computed"] + m["saved"], **m}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", type=int, default=32)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--mib", type=int, default=256, help="the cache's budget in the 'on' run")
    args = p.parse_args(argv)
    os.environ.setdefault("CALC_MODEL", MODEL_NAME)
    _, tasks = calc_tasks.train_test(n_train=256, n_test=32, seed=0)  # the demo's held-out split
    tasks = tasks[:args.tasks]
    with tempfile.TemporaryDirectory(prefix="bench-prefix-cache-") as tmp:
        off = one_run(args, 0, tasks, Path(tmp))
        on = one_run(args, args.mib, tasks, Path(tmp))
    ratio = off["computed"] / max(on["computed"], 1)
    wall_ratio = off["wall_s"] / on["wall_s"]
    for name, r in (("off", off), (f"on ({args.mib} MiB)", on)):
        print(f"cache {name:>14}: prefill tokens computed {r['computed']:>8.0f}  saved {r['saved']:>8.0f}  "
              f"(of {r['prompt_tokens']:.0f} prompt tokens)  hits {r['hits']:.0f}  misses {r['misses']:.0f}  "
              f"wall {r['wall_s']:.1f}s  score {r['score']:.3f}")
    print(f"prefill tokens computed, off / on: {ratio:.2f}x   wall time off / on: {wall_ratio:.2f}x "
          "(shared machine: indicative)")
    print(f"cache at the end: {on['cache_tokens']:.0f} tokens, {on['cache_bytes'] / 2**20:.1f} MiB, "
          f"{on['evictions']:.0f} evictions")
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": "prefix_cache", "model": args.model, "tasks": len(tasks), "samples": args.samples,
           "off": off, "on": on, "prefill_computed_ratio": ratio, "wall_ratio": wall_ratio,
           "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
    (RESULTS / "prefix_cache.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'prefix_cache.json'}")
    return 0 if ratio >= 3.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
