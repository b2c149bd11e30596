"""``make bench``: run every benchmark in its own process and print one summary table.

Each benchmark measures its own baseline in the same run (the machines are
shared and noisy) and writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("bench_exporter.py", "bench_stream.py", "bench_replay.py", "bench_serving.py",
              "bench_serving_adapters.py", "bench_reload.py", "bench_merge.py",
              "bench_propagation.py", "bench_baselines.py", "bench_export.py", "bench_vs_bare.py",
              "bench_learner_memory.py", "bench_learner_step.py", "bench_learner_dtype.py", "bench_prefix_sharing.py", "bench_prefix_cache.py",
              "bench_prefix_tree.py", "bench_allocators.py", "bench_threads.py", "bench_logprob_agreement.py",
              "bench_agent_step.py", "bench_agent_clients.py")


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        print(f"=== {name}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(HERE / name)], cwd=HERE.parent)
        print(f"=== {name}: exit {rc} in {time.monotonic() - t0:.0f}s", flush=True)
        if rc:
            failed.append(name)
    print("\nresults:")
    for path in sorted((HERE / "results").glob("*.json")):
        size = len(json.dumps(json.loads(path.read_text())))
        print(f"  {path.relative_to(HERE.parent)} ({size} bytes)")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
