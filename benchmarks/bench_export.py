"""``boltstream export``: rows/s and peak memory for spans and batches, against reading the same range.

    .venv/bin/python benchmarks/bench_export.py [--spans 100000] [--batches 2000]

On a private embedded stack (Tansu + moto):

* spans: ``--spans`` spans of the stream benchmarks' synthetic rollouts
  (tests/integration/streams/stream_workload.py: LLM, tool and reward spans, short
  token lists), repeated to the count;
* batches: ``--batches`` TrainingBatch records of 4 samples of 150-400 tokens each
  (the demo's calculator calls are ~200), one row per sample in the export.

For each kind two child processes run over the same range, each measured from the
outside (wall time, and peak RSS from ``wait4`` through a small launcher, so the
child's figure is its own and not this process's high-water mark):

1. baseline: read the range by assignment and decode every record with the codec,
   writing nothing (this script's ``--child-read``);
2. ``boltstream export KIND --format parquet`` as typed.

The ratio is export time / baseline time: what building rows and writing Parquet
costs on top of getting the records at all. Both include interpreter start-up and
imports (the export's pyarrow, about a second). JSON goes to benchmarks/results/export.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from boltstream.broker.log_range import parse_position, read_range, resolve  # noqa: E402
from boltstream.config import Settings, load  # noqa: E402
from boltstream.schemas import Codec  # noqa: E402
from boltstream.stack import embedded_stack, settings_env  # noqa: E402
from tests.integration.peak_rss import run_measured  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BOLTSTREAM = Path(sys.executable).with_name("boltstream")
RECORD_OF = {"spans": "Span", "batches": "TrainingBatch"}


def make_spans(codec: Codec, topic: str, count: int) -> list[tuple[bytes, bytes]]:
    from tests.integration.streams.stream_workload import encoded_spans, make_workload

    one = encoded_spans(codec, topic, make_workload(tasks=200))
    return [one[i % len(one)] for i in range(count)]


def make_batches(codec: Codec, topic: str, count: int) -> list[tuple[bytes, bytes]]:
    rng = random.Random(0)
    out = []
    for b in range(count):
        samples = []
        for i in range(4):
            n, prompt = rng.randint(150, 400), rng.randint(100, 140)
            samples.append({"sample_id": f"a{b}-{i}:0", "rollout_id": f"r{b}-{i}", "attempt_id": f"a{b}-{i}",
                            "task_id": f"t{b}", "call_index": 0, "token_ids": [rng.randrange(49_152) for _ in range(n)],
                            "prompt_length": prompt, "loss_mask": [k >= prompt for k in range(n)],
                            "behaviour_logprobs": [0.0 if k < prompt else -rng.random() for k in range(n)],
                            "advantage": rng.gauss(0, 1), "reward": rng.random(), "policy_version": b // 16,
                            "temperature": 0.7})
        batch = {"batch_id": f"t{b}:0", "task_id": f"t{b}", "samples": samples, "group_size": 4, "num_rollouts": 4,
                 "reward_mean": 0.5, "reward_std": 0.5, "rollout_ids": [s["rollout_id"] for s in samples]}
        out.append((f"t{b}".encode(), codec.encode("TrainingBatch", batch, topic=topic)))
    return out


async def produce(settings: Settings, topic: str, records: list[tuple[bytes, bytes]]) -> int:
    from tests.integration.streams.stream_helpers import produce as produce_all

    await produce_all(settings, topic, records, linger_ms=20, max_batch_size=1_000_000)
    return sum(len(v) for _, v in records)


async def child_read(kind: str) -> None:
    """The baseline: every record of the range, read partition by partition as the export does, decoded."""
    settings = load(Settings)
    topic = settings.topic(kind)
    codec = Codec.from_registry_url(settings.schema_registry_url)
    log_range = await resolve(settings, topic, parse_position("earliest"), parse_position("now", "--to"))
    count = 0
    for part in log_range.partitions:
        one = dataclasses.replace(log_range, partitions=(part,))
        async for fetched in read_range(settings, one, max_records=1000):
            for record in fetched:
                codec.decode(record.value, topic=topic, expect=RECORD_OF[kind])
                count += 1
    print(json.dumps({"records": count}))


def measured(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Wall seconds and peak RSS (MiB) of one child process, its own alone (tests/integration/peak_rss.py)."""
    result = run_measured(argv, env, timeout=900)
    if result.code:
        raise RuntimeError(f"{argv[:3]} exited {result.code}:\n{result.output[-2000:]}")
    return {"seconds": round(result.seconds, 2), "peak_rss_mib": round(result.peak_mib, 1), "output": result.output}


def bench_kind(kind: str, settings: Settings, env: dict[str, str], work: Path) -> dict[str, Any]:
    base = measured([sys.executable, __file__, "--child-read", kind], env)
    records = json.loads(base.pop("output").strip().splitlines()[-1])["records"]
    out = work / f"{kind}.parquet"
    export = measured([str(BOLTSTREAM), "export", kind, "--out", str(out)], env)
    line = [x for x in export.pop("output").splitlines() if x.startswith("boltstream export:")][-1]
    import pyarrow.parquet as pq

    meta = pq.read_metadata(out)
    return {"records": records, "rows": meta.num_rows, "row_groups": meta.num_row_groups,
            "file_mib": round(out.stat().st_size / 2**20, 1),
            "baseline": {**base, "records_per_s": round(records / base["seconds"])},
            "export": {**export, "rows_per_s": round(meta.num_rows / export["seconds"]), "says": line},
            "time_ratio": round(export["seconds"] / base["seconds"], 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=int, default=100_000)
    p.add_argument("--batches", type=int, default=2_000)
    p.add_argument("--child-read", choices=tuple(RECORD_OF), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_read:
        asyncio.run(child_read(args.child_read))
        return 0
    results: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count(),
                               "load_at_start": os.getloadavg()[0], "spans": args.spans, "batches": args.batches}
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp, embedded_stack(Path(tmp) / "stack") as settings:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
        env.update(settings_env(settings))
        env["BOLTSTREAM_STATE_FILE"] = str(Path(tmp) / "no-stack.json")
        codec = Codec()
        for kind, make, count in (("spans", make_spans, args.spans), ("batches", make_batches, args.batches)):
            topic = settings.topic(kind)
            produced = asyncio.run(produce(settings, topic, make(codec, topic, count)))
            results[kind] = {"produced_mib": round(produced / 2**20, 1), **bench_kind(kind, settings, env, Path(tmp))}
    results["load_at_end"] = os.getloadavg()[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(results, indent=2))
    print(f"load average {results['load_at_start']:.2f} -> {results['load_at_end']:.2f}")
    print(f"{'kind':<8} {'records':>8} {'rows':>8} {'MiB in':>7} {'read s':>7} {'export s':>9} {'ratio':>6} "
          f"{'rows/s':>8} {'read RSS':>9} {'export RSS':>11}")
    for kind in RECORD_OF:
        r = results[kind]
        print(f"{kind:<8} {r['records']:>8} {r['rows']:>8} {r['produced_mib']:>7} {r['baseline']['seconds']:>7} "
              f"{r['export']['seconds']:>9} {r['time_ratio']:>6} {r['export']['rows_per_s']:>8} "
              f"{r['baseline']['peak_rss_mib']:>8}M {r['export']['peak_rss_mib']:>10}M")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
