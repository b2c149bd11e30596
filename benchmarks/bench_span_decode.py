"""What ``Codec.decode`` of a Span costs the stream worker: fastavro against the hand-written reader.

    .venv/bin/python benchmarks/bench_span_decode.py [--tasks 40] [--llm-tasks 2] [--rounds 15]

The spans are the stream benchmark's (tests/integration/streams/stream_workload.py): the small random
rollouts of the integration tests (tool and LLM spans of a few hundred bytes) and realistic LLM
rollouts (``Shape(5, 2000, 200, True)``: 5 calls, 2000-token prompts growing by shared prefixes, 200
response tokens), encoded by the codec as the exporter writes them (Span v2, single-object). Both
readers run through the real call, ``codec.decode(value, topic, expect="Span")``; the baseline is the
same codec with the hand-written reader detached (what ``decode`` did before it). In one process, in
alternating rounds (the machine is shared: each round times both once, in turn first), CPU time of
the thread, medians over rounds and the median of each round's ratio; every span is checked equal
both ways first. JSON goes to benchmarks/results/span_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from boltstream.schemas import Codec  # noqa: E402
from boltstream.schemas.span_decoder import same  # noqa: E402
from tests.integration.streams.stream_workload import Shape, encoded_spans, make_workload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TOPIC = "spans"


def fastavro_codec() -> Codec:
    """A codec whose newest-Span records go to fastavro, as before the hand-written reader."""
    codec = Codec()
    fingerprint = codec.catalog.latest("Span").fingerprint
    codec._by_fingerprint[fingerprint] = replace(codec._by_fingerprint[fingerprint], fast=None)
    return codec


def per_decode_us(codec: Codec, values: list[bytes]) -> float:
    """CPU µs of this thread per decode: time spent preempted by the machine's other work does not count."""
    decode = codec.decode
    t0 = time.thread_time()
    for value in values:
        decode(value, TOPIC, "Span")
    return (time.thread_time() - t0) / len(values) * 1e6


def measure(values: list[bytes], rounds: int) -> dict[str, object]:
    codecs = {"fastavro": fastavro_codec(), "fast": Codec()}
    assert codecs["fast"].decode(values[0], TOPIC, "Span") is not None
    for value in values:  # the same records both ways, or the timing means nothing
        assert same(codecs["fast"].decode(value, TOPIC, "Span"), codecs["fastavro"].decode(value, TOPIC, "Span"))
    runs: dict[str, list[float]] = {name: [] for name in codecs}
    for r in range(rounds):
        for name in (("fastavro", "fast") if r % 2 else ("fast", "fastavro")):
            runs[name].append(per_decode_us(codecs[name], values))
    median = {name: statistics.median(v) for name, v in runs.items()}
    paired = statistics.median(a / b for a, b in zip(runs["fastavro"], runs["fast"], strict=True))
    return {"spans": len(values), "mean_bytes": sum(map(len, values)) / len(values), "us_per_decode": median,
            "speedup": median["fastavro"] / median["fast"], "speedup_median_of_rounds": paired,
            "runs_us_per_decode": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=40, help="tasks of 4 small rollouts")
    p.add_argument("--llm-tasks", type=int, default=2, help="tasks of 4 realistic LLM rollouts")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()

    codec = Codec()
    workloads = {
        "small": make_workload(args.tasks, 4, seed=3, run="bench"),
        "llm": make_workload(args.llm_tasks, 4, seed=3, run="bench", shape=Shape(5, 2000, 200, True)),
    }
    results = {}
    for name, rollouts in workloads.items():
        values = [value for _, value in encoded_spans(codec, TOPIC, rollouts)]
        res = results[name] = measure(values, args.rounds)
        us = res["us_per_decode"]
        print(f"{name:>6}: {res['spans']} spans of {res['mean_bytes']:.0f} bytes on average: fastavro "
              f"{us['fastavro']:.1f} µs/decode, hand-written {us['fast']:.1f} µs/decode "
              f"({res['speedup']:.2f}x; median of the rounds' ratios {res['speedup_median_of_rounds']:.2f}x)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "span_decode.json").write_text(json.dumps({
        "rounds": args.rounds, "workloads": results,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
