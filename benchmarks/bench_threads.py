"""torch's OpenMP wait policy on a shared machine: decode and prefill, spinning vs sleeping threads.

    .venv/bin/python benchmarks/bench_threads.py [--model smollm2] [--rounds 2] [--busy 1]

torch runs its CPU kernels on an OpenMP team (two threads on two cores). Between parallel
regions the team's threads spin by default; when another process holds one of the cores (the
demo's learner, stream app and agents share the inference worker's two cores), the spinning
thread and the descheduled one wait on each other at every barrier. ``boltstream`` sets
``OMP_WAIT_POLICY=PASSIVE`` (boltstream/cli.py) so waiting threads sleep instead. This measures
a SmolLM2 batched prefill (8 x 200 tokens) and 20 decode steps of the same batch in a fresh
process for each policy (the runtime reads the variables once, at load; SPIN is PASSIVE with a
bounded spin before sleeping, ``GOMP_SPINCOUNT``), alternating, with
``--busy`` CPU-bound competitor processes running and with none. Prints the times and the ratio
active / passive per condition; writes benchmarks/results/threads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from boltstream.cli import SERVE_SPINCOUNT

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
# name -> the OpenMP settings of the child (libgomp: GOMP_SPINCOUNT bounds how long a waiting thread spins
# before it sleeps; PASSIVE alone sleeps at once; SPIN is what `boltstream serve` sets)
POLICIES = {"ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            "SPIN": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SERVE_SPINCOUNT}}

CHILD = """
import json, sys, time, torch
from boltstream.weights.models import load_model
model, _ = load_model(sys.argv[1]); model.eval()
ids = torch.randint(100, 20000, (8, 200), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    model(ids[:, :16], use_cache=True)  # warm-up: first-call allocations and kernel choices
    t = time.perf_counter(); out = model(ids, use_cache=True); prefill = time.perf_counter() - t
    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    t = time.perf_counter()
    for _ in range(20):
        out = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    decode = time.perf_counter() - t
print(json.dumps({"prefill_s": prefill, "decode_step_ms": decode / 20 * 1000}))
"""

BUSY = "while True: pass"


def run_child(model: str, policy: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(POLICIES[policy], PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True,
                         timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(model: str, rounds: int, busy: int) -> dict[str, dict[str, float]]:
    """Median prefill seconds and decode ms per step of each policy, with ``busy`` competitors running."""
    competitors = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        rows: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
        for r in range(rounds):
            for policy in list(POLICIES) if r % 2 == 0 else reversed(list(POLICIES)):
                rows[policy].append(run_child(model, policy))
                print(f"busy {busy} round {r + 1} {policy:<7} {rows[policy][-1]}", flush=True)
    finally:
        for p in competitors:
            p.kill()
            p.wait(timeout=10)
    return {p: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for p, xs in rows.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy", type=int, default=1, help="CPU-bound competitor processes in the loaded condition")
    args = p.parse_args()
    started = time.time()
    result: dict[str, object] = {"model": args.model, "rounds": args.rounds, "machine": platform.node(),
                                 "cpus": os.cpu_count()}
    for busy in (0, args.busy):
        medians = measure(args.model, args.rounds, busy)
        ratios = {k: medians["ACTIVE"][k] / medians["PASSIVE"][k] for k in medians["ACTIVE"]}
        result[f"busy_{busy}"] = {"medians": medians, "active_over_passive": ratios}
        print(f"{busy} competitor(s): " + "; ".join(
            f"{name} prefill {m['prefill_s']:.2f} s, decode {m['decode_step_ms']:.0f} ms/step"
            for name, m in medians.items()) + f" (active / passive decode {ratios['decode_step_ms']:.2f}x)", flush=True)
    result["seconds"] = round(time.time() - started, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "threads.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
