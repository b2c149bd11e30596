"""Replay vs the live stream worker: spans/s over the same spans, measured in one run.

    .venv/bin/python benchmarks/bench_replay.py [--tasks 1500] [--repeats 3]

On a private embedded stack (Tansu + moto), with the synthetic rollouts of the
integration tests (benchmarks/bench_stream.py's workload, groups of 4):

1. Live: one ``boltstream stream worker`` (fast consumer, grace 0), warmed up with one
   task, then ``--tasks`` x 4 rollouts produced as fast as possible; spans/s = spans /
   (first span produced -> last sample readable). bench_stream.py's own measurement.
2. Replay: ``boltstream replay`` of that same ``spans`` topic (the warm-up task
   included) with the same stage settings (``--grace-s 0 --group-size 4``), each run
   into a fresh namespace, ``--repeats`` times. Reported two ways: the replay's own
   spans/s (reading the range -> every output acked), and over the whole command
   (process start, imports, range resolution and topic creation included).

The ratio printed is replay / live (median replay run). The load average at start and
end is recorded: the broker and every other process on the box share the cores. JSON
goes to benchmarks/results/replay.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_stream import BOLTSTREAM, GROUP, throughput  # noqa: E402

from boltstream.broker.topics import ensure_topics  # noqa: E402
from boltstream.config import Settings  # noqa: E402
from boltstream.stack import embedded_stack, settings_env  # noqa: E402
from boltstream.streams.worker import tune_gc  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def replay(settings: Settings, tmp: Path, namespace: str) -> dict[str, Any]:
    """One ``boltstream replay`` of ``settings``' spans topic into ``namespace``; its summary and wall time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env.update(settings_env(settings))
    env["BOLTSTREAM_STATE_FILE"] = str(tmp / "no-stack.json")
    argv = [str(BOLTSTREAM), "replay", "--namespace", namespace, "--grace-s", "0", "--group-size", str(GROUP),
            "--json", "-l", "warning"]
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"replay failed ({done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"spans": summary["spans"], "samples": summary["samples"], "elapsed_s": summary["elapsed_s"],
            "spans_per_s": summary["spans_per_s"], "command_s": round(wall, 3),
            "command_spans_per_s": round(summary["spans"] / wall, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name, embedded_stack(tmp_name, partitions=4) as base:
        tmp = Path(tmp_name)
        settings = Settings(**{**base.__dict__, "namespace": "benchlive."})
        await ensure_topics(settings)
        results["live_worker"] = await throughput(settings, tmp, args.tasks, fast=True)
        runs = [replay(settings, tmp, f"benchreplay{i}.") for i in range(args.repeats)]
    results["replay_runs"] = runs
    median = statistics.median(r["spans_per_s"] for r in runs)
    live = results["live_worker"]["spans_per_s"]
    results["replay_spans_per_s_median"] = median
    results["replay_command_spans_per_s_median"] = statistics.median(r["command_spans_per_s"] for r in runs)
    results["ratio_replay_vs_live"] = round(median / live, 2)
    results["ratio_replay_command_vs_live"] = round(results["replay_command_spans_per_s_median"] / live, 2)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=1500, help="tasks (x4 rollouts) produced for the live worker")
    ap.add_argument("--repeats", type=int, default=3, help="replays of the same spans")
    args = ap.parse_args()
    load_at_start = list(os.getloadavg())
    tune_gc()
    results = asyncio.run(run(args))
    results["goals"] = {"replay_at_least_as_fast_as_live": results["ratio_replay_vs_live"] >= 1.0}
    results["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "loadavg_at_start": load_at_start, "loadavg_at_end": list(os.getloadavg())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replay.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"replay {results['replay_spans_per_s_median']:.0f} spans/s vs live worker "
          f"{results['live_worker']['spans_per_s']:.0f} spans/s: ratio {results['ratio_replay_vs_live']:.2f} "
          f"({results['ratio_replay_command_vs_live']:.2f} counting the whole command)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
