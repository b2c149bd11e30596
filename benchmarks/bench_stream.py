"""Stream app: spans/s through one worker and root-span-to-samples latency, against the pure core alone.

    .venv/bin/python benchmarks/bench_stream.py [--shape realistic|small] [--calls 5] [--prompt 2000]
        [--response 200] [--no-shared-prefix] [--tasks N] [--latency-s 10] [--rate R] [--latency-only]

On a private embedded stack (Tansu + moto), with the synthetic rollouts of the
integration tests (tools some of which fail, groups of 4), in one of two span shapes:

* ``realistic`` (default): every rollout makes ``--calls`` LLM calls of ``--prompt`` prompt +
  ``--response`` response token ids, each prompt extending the previous call's prompt + response
  + 50 tool tokens (``--no-shared-prefix``: independent prompts); ~10-13 kB per LLM span.
* ``small``: the integration tests' rollouts (1-5 calls of ~8-40 prompt + 4-16 response ids,
  ~7.5 spans per rollout, ~330 B per span): the per-span fixed costs.

Every figure is reported as spans/s and tokens/s (token ids of the LLM spans: prompt + response),
with the mean encoded bytes per span.

1. Pure core: the same spans decoded, assembled, encoded as Trajectories,
   decoded again, grouped into TrainingBatches and encoded, in one process
   without Kafka, with the worker's GC settings (``tune_gc``). The ceiling for
   a single Python process. Run twice on the same rollouts: with today's
   encoding (packed token bytes) and with the v1 encoding (token ids as Avro
   arrays: Span v1, Trajectory/TrainingBatch v2, benchmarks/legacy_encoding.py);
   ``v1_ratio`` = today's tokens/s / v1's. Only the pure core can run both: the
   worker runs today's code.
2. Throughput: one ``boltstream stream worker`` (a subprocess, group size 4),
   warmed up with one task, then ``--tasks`` x 4 rollouts produced as fast as
   possible; spans/s = spans / (first span produced -> last sample readable).
   Also the worker process' CPU seconds meanwhile, and tokens per worker CPU
   second: producing 10 kB spans into the broker on the same 2 cores can be
   slower than the worker, and then the wall-clock rate measures the producer.
   Measured with the fast consumer (default: each fetch handed to the stages
   as one batch) and with faust's stock per-record agents (``--no-fast-consumer``).
   Then a backlog drain: the spans are produced BEFORE the worker starts, and the clock
   runs from its first hand-over of spans (its INFO log says when) to the last rollout's
   samples: the worker's own rate. Twice, compression ``none`` and ``zstd`` (the default).
3. Latency: a worker with group size 1 (no waiting for the rest of a group)
   under a steady ``--rate`` rollouts/s for ``--latency-s`` seconds; per
   rollout, from just before its root span is produced to the first time a
   consumer reads one of its samples. p50/p99/max; ``written_*``: to the batch record's
   timestamp (the worker's producer sets it), without the reader's own Tansu fetch wait.
   ``--latency-only`` runs this part alone.

Goals: >= 5,000 spans/s per worker (small shape); on the realistic shape
>= 2M tokens/s through one worker and >= 10x the v1 encoding; p99 <= 100 ms
excluding group wait. The load average at start and end is recorded: other processes on the
box (the broker shares the cores too) move every number. JSON goes to
benchmarks/results/stream_realistic.json (``--shape small``: stream.json).

Realistic shape, default arguments, quiet box (load 0.7), 2026-11-26: pure core 8.09M tokens/s
vs 0.70M v1 (11.6x); worker while produced 1.92M; backlog drain 1.94M (compression none) and
2.14M tokens/s (zstd); p99 60 ms (to the batch record: 47 ms) at 20 rollouts/s.
Earlier, realistic shape, load 2.0 at start (docs/results.md):
pure core 5.6M tokens/s packed against 0.59M with the v1 encoding (9.4x; 10.4x in a run at
load 2.3); the worker 1.0M tokens/s by the wall clock, bounded by the bench's producer (7.5
of 10.7 s), and 2.15M tokens per worker CPU second; p99 135 ms at 20 rollouts/s.

Small shape (the default before packed token payloads), measured on the 2-core VM (docs/results.md has the table):
before batch delivery and the pure-core work, load 0.95 at start: pure core
7,484 spans/s, worker 1,991 (stock faust 1,800), p99 184 ms; after, load 0.84:
pure core 20,171, worker 9,660 (stock 2,821), p50 37 ms, p99 200 ms; after,
load 2.60 with another job's model server on the box: pure core 19,030, worker
5,446 (stock 1,643), p99 192 ms. That p99 was aiokafka's 100 ms fetch stalls
at the start of the load (fixed in streams/faust_internals.py; before/after runs in
docs/results.md).
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

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # noqa: E402

from benchmarks.legacy_encoding import legacy_codec  # noqa: E402
from boltstream.broker.kafka import consumer_kwargs, producer_kwargs  # noqa: E402
from boltstream.broker.topics import ensure_topics  # noqa: E402
from boltstream.config import Settings  # noqa: E402
from boltstream.schemas import Codec  # noqa: E402
from boltstream.stack import embedded_stack, settings_env  # noqa: E402
from boltstream.streams import assemble_trajectory, build_training_batches  # noqa: E402
from boltstream.streams.worker import tune_gc  # noqa: E402
from tests.integration.streams.stream_workload import Rollout, Shape, encoded_spans, make_workload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BOLTSTREAM = Path(sys.executable).with_name("boltstream")
GROUP = 4


def llm_tokens(rollouts: list[Rollout]) -> int:
    """Token ids the rollouts' LLM spans carry (prompt + response): what tokens/s counts."""
    return sum(len(p) + len(r) for ro in rollouts for p, r in ro.calls)


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; NaN where /proc cannot tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def rates(spans: int, tokens: int, seconds: float) -> dict[str, float]:
    return {"spans_per_s": round(spans / seconds, 1), "tokens_per_s": round(tokens / seconds)}


def pure_core(records: list[tuple[bytes, bytes]], codec: Codec) -> float:
    """Spans/s of the pure core (with the codec) over ``records``."""
    started = time.perf_counter()
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for _, value in records:
        span = codec.decode(value, topic="bench.spans", expect="Span")
        by_rollout.setdefault(span["rollout_id"], []).append(span)
    by_task: dict[str, list[dict[str, Any]]] = {}
    for spans in by_rollout.values():
        data = codec.encode("Trajectory", assemble_trajectory(spans), topic="bench.trajectories")
        trajectory = codec.decode(data, topic="bench.trajectories", expect="Trajectory")
        by_task.setdefault(trajectory["task_id"], []).append(trajectory)
    for task_id, trajectories in by_task.items():
        for batch in build_training_batches(task_id, trajectories, group_size=GROUP):
            codec.encode("TrainingBatch", batch, topic="bench.batches")
    return len(records) / (time.perf_counter() - started)


def start_worker(settings: Settings, app_id: str, log: Path, *args: str, level: str = "warning") -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env.update(settings_env(settings))
    env["BOLTSTREAM_STATE_FILE"] = str(log.parent / "no-stack.json")
    env["BOLTSTREAM_STREAM_TICK_S"] = "0.1"
    env["BOLTSTREAM_COMPRESSION"] = settings.compression
    argv = [str(BOLTSTREAM), "stream", "worker", "--app-id", app_id, "-l", level, *args]
    return subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


class SampleWatch:
    """Reads the batches topic; remembers when each rollout's samples were first readable."""

    def __init__(self, settings: Settings) -> None:
        self.topic = settings.topic("batches")
        self.codec = Codec()
        self.first_seen: dict[str, float] = {}
        self.written: dict[str, float] = {}  # rollout -> wall-clock time its first batch was produced (record timestamp)
        self.samples = 0
        self._consumer = AIOKafkaConsumer(self.topic, **consumer_kwargs(settings, None, fetch_max_wait_ms=20))

    async def start(self) -> None:
        await self._consumer.start()

    async def stop(self) -> None:
        await self._consumer.stop()

    async def poll(self) -> None:
        batches = await self._consumer.getmany(timeout_ms=50)
        now = time.perf_counter()
        for records in batches.values():
            for record in records:
                for sample in self.codec.decode(record.value, topic=self.topic, expect="TrainingBatch")["samples"]:
                    self.samples += 1
                    if sample["rollout_id"] not in self.first_seen:
                        self.first_seen[sample["rollout_id"]] = now
                        self.written[sample["rollout_id"]] = record.timestamp / 1000

    async def wait_rollouts(self, rollout_ids: set[str], timeout: float) -> None:
        deadline = time.perf_counter() + timeout
        while not rollout_ids <= self.first_seen.keys():
            if time.perf_counter() > deadline:
                missing = len(rollout_ids - self.first_seen.keys())
                raise TimeoutError(f"{missing} rollouts produced no samples within {timeout:.0f}s")
            await self.poll()


async def warm_up(settings: Settings, watch: SampleWatch, codec: Codec, run: str, group: int) -> None:
    """One task through the worker: it has joined its group and recovered before timing starts."""
    rollouts = make_workload(1, group, seed=1, run=f"{run}-warm")  # small: only the worker's start matters
    await produce(settings, encoded_spans(codec, settings.topic("spans"), rollouts))
    await watch.wait_rollouts({r.rollout_id for r in rollouts}, timeout=120)


async def produce(settings: Settings, records: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    try:
        futures = [await producer.send(settings.topic("spans"), value, key=key) for key, value in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


# The pipeline's own speed: no worker spools here, so the grace for spans delivered late after a
# broker outage (3 s by default, docs/streams.md) would only add a constant wait to every rollout.
NO_GRACE = ("--grace-s", "0")


async def throughput(settings: Settings, tmp: Path, tasks: int, fast: bool, shape: Shape | None) -> dict[str, Any]:
    codec = Codec()
    app_id = f"{settings.namespace}bench-{'fast' if fast else 'stock'}"
    proc = start_worker(settings, app_id, tmp / f"{app_id}.log", "--group-size", str(GROUP), *NO_GRACE,
                        *(() if fast else ("--no-fast-consumer",)))
    watch = SampleWatch(settings)
    await watch.start()
    try:
        await warm_up(settings, watch, codec, settings.namespace, GROUP)
        rollouts = make_workload(tasks, GROUP, seed=3, run=settings.namespace, shape=shape)
        records = encoded_spans(codec, settings.topic("spans"), rollouts)
        tokens = llm_tokens(rollouts)
        cpu = proc_cpu(proc.pid)
        started = time.perf_counter()
        await produce(settings, records)
        produced = time.perf_counter() - started
        await watch.wait_rollouts({r.rollout_id for r in rollouts}, timeout=600)
        elapsed = time.perf_counter() - started
        cpu = proc_cpu(proc.pid) - cpu
    finally:
        await watch.stop()
        stop(proc)
    # The worker's own CPU seconds meanwhile: when producing the input is the bottleneck (large spans on
    # a shared 2-core box), tokens per worker CPU second is what one worker with a core of its own does.
    return {"spans": len(records), "rollouts": len(rollouts), "tokens": tokens, "produce_s": round(produced, 3),
            "elapsed_s": round(elapsed, 3), **rates(len(records), tokens, elapsed),
            "worker_cpu_s": round(cpu, 2), "tokens_per_worker_cpu_s": round(tokens / cpu)}


async def first_hand_over(log: Path, topic: str) -> float:
    """perf_counter() when the worker's log says it handed its first records of ``topic`` to the stages."""
    needle = f"record(s) of {topic} handed over"
    while True:
        if log.exists() and needle in log.read_text(errors="replace"):
            return time.perf_counter()
        await asyncio.sleep(0.005)


async def drain(settings: Settings, tmp: Path, tasks: int, shape: Shape | None) -> dict[str, Any]:
    """The worker's own rate, not bounded by a producer on the same cores: the spans are in the log
    before the worker starts (a backlog, as after an outage), and the clock runs from the worker's
    first hand-over of spans (its log says when) to the last rollout's samples readable."""
    codec = Codec()
    app_id = f"{settings.namespace}bench-drain"
    rollouts = make_workload(tasks, GROUP, seed=3, run=settings.namespace, shape=shape)
    records = encoded_spans(codec, settings.topic("spans"), rollouts)
    tokens = llm_tokens(rollouts)
    started = time.perf_counter()
    await produce(settings, records)
    produced = time.perf_counter() - started
    watch = SampleWatch(settings)
    await watch.start()
    log = tmp / f"{app_id}.log"
    proc = start_worker(settings, app_id, log, "--group-size", str(GROUP), *NO_GRACE, level="info")
    try:
        first = await asyncio.wait_for(first_hand_over(log, settings.topic("spans")), 120)
        cpu = proc_cpu(proc.pid)
        await watch.wait_rollouts({r.rollout_id for r in rollouts}, timeout=600)
        elapsed = max(watch.first_seen.values()) - first
        cpu = proc_cpu(proc.pid) - cpu
    finally:
        await watch.stop()
        stop(proc)
    return {"spans": len(records), "rollouts": len(rollouts), "tokens": tokens, "produce_s": round(produced, 3),
            "elapsed_s": round(elapsed, 3), **rates(len(records), tokens, elapsed), "worker_cpu_s": round(cpu, 2),
            "tokens_per_worker_cpu_s": round(tokens / cpu)}


async def latency(settings: Settings, tmp: Path, seconds: float, rate: float, shape: Shape | None) -> dict[str, Any]:
    codec = Codec()
    app_id = f"{settings.namespace}bench-latency"
    proc = start_worker(settings, app_id, tmp / f"{app_id}.log", "--group-size", "1", *NO_GRACE)
    watch = SampleWatch(settings)
    await watch.start()
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    root_sent: dict[str, float] = {}
    root_wall: dict[str, float] = {}
    try:
        await warm_up(settings, watch, codec, settings.namespace, 1)
        count = int(seconds * rate)
        rollouts = make_workload(count, 1, seed=9, run=f"{settings.namespace}lat", shape=shape)
        topic = settings.topic("spans")
        stop_polling = asyncio.Event()

        async def poller() -> None:
            while not stop_polling.is_set():
                await watch.poll()

        polling = asyncio.create_task(poller())
        begin = time.perf_counter()
        for i, rollout in enumerate(rollouts):
            await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))  # steady arrival rate
            key = rollout.rollout_id.encode()
            for span in rollout.spans[:-1]:
                await producer.send(topic, codec.encode("Span", span, topic=topic), key=key)
            root_sent[rollout.rollout_id] = time.perf_counter()
            root_wall[rollout.rollout_id] = time.time()
            await producer.send(topic, codec.encode("Span", rollout.spans[-1], topic=topic), key=key)
        await producer.flush()
        deadline = time.perf_counter() + 60
        while not root_sent.keys() <= watch.first_seen.keys() and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        stop_polling.set()
        await polling
    finally:
        await producer.stop()
        await watch.stop()
        stop(proc)
    lat_ms = sorted((watch.first_seen[r] - t) * 1000 for r, t in root_sent.items() if r in watch.first_seen)
    # To the batch record's timestamp (set by the worker's producer, ms): without the reader's own hop,
    # which on Tansu waits up to its fetch_max_wait (the broker holds a fetch even when records arrive).
    written_ms = sorted((watch.written[r] - t) * 1000 for r, t in root_wall.items() if r in watch.written)
    spans = sum(len(r.spans) for r in rollouts)
    return {
        "rollouts": len(root_sent), "answered": len(lat_ms), "rate_rollouts_per_s": rate,
        "rate_spans_per_s": round(spans / seconds, 1), "rate_tokens_per_s": round(llm_tokens(rollouts) / seconds),
        "p50_ms": round(statistics.median(lat_ms), 2),
        "p99_ms": round(lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))], 2),
        "max_ms": round(lat_ms[-1], 2),
        "written_p50_ms": round(statistics.median(written_ms), 2),
        "written_p99_ms": round(written_ms[min(len(written_ms) - 1, int(0.99 * len(written_ms)))], 2),
    }


def pure_cores(rollouts: list[Rollout], legacy_dir: Path) -> dict[str, Any]:
    """The pure core with today's encoding and with v1's, on the same rollouts, interleaved (3 each)."""
    spans, tokens = sum(len(r.spans) for r in rollouts), llm_tokens(rollouts)
    out: dict[str, Any] = {}
    codecs = {"packed": Codec(), "v1": legacy_codec(legacy_dir)}
    records = {name: encoded_spans(c, "bench.spans", rollouts) for name, c in codecs.items()}
    runs: dict[str, list[float]] = {name: [] for name in codecs}
    for _ in range(3):
        for name, c in codecs.items():
            runs[name].append(pure_core(records[name], c))
    for name in codecs:
        per_s = statistics.median(runs[name])
        out[name] = {**rates(spans, tokens, spans / per_s),
                     "bytes_per_span": round(sum(len(v) for _, v in records[name]) / spans)}
    out["v1_ratio"] = round(out["packed"]["tokens_per_s"] / out["v1"]["tokens_per_s"], 2)
    return out


async def run(args: argparse.Namespace, shape: Shape | None) -> dict[str, Any]:
    results: dict[str, Any] = {"shape": shape.describe() if shape else "small (the integration tests' rollouts)",
                               "tasks": args.tasks, "group_size": GROUP}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if not args.latency_only:
            sample = make_workload(args.tasks, GROUP, seed=3, run="pure", shape=shape)
            results["pure_core"] = pure_cores(sample, tmp / "legacy-schemas")
            del sample
        (tmp / "stack").mkdir()
        with embedded_stack(str(tmp / "stack"), partitions=4) as base:
            labels = (("fast_consumer", True),) + ((("stock_faust", False),) if args.stock else ())
            for label, fast in () if args.latency_only else labels:
                settings = Settings(**{**base.__dict__, "namespace": f"bench{label[:4]}."})
                await ensure_topics(settings)
                results[f"worker_{label}"] = await throughput(settings, tmp, args.tasks, fast, shape)
            for compression in () if args.latency_only else ("none", "zstd"):
                settings = Settings(**{**base.__dict__, "namespace": f"benchdrain{compression}.",
                                       "compression": compression})
                await ensure_topics(settings)
                results[f"worker_backlog_drain_{compression}"] = await drain(settings, tmp, args.tasks, shape)
            settings = Settings(**{**base.__dict__, "namespace": "benchlat."})
            await ensure_topics(settings)
            results["latency_group_size_1"] = await latency(settings, tmp, args.latency_s, args.rate, shape)
    if not args.latency_only:
        best = results["worker_fast_consumer"]["spans_per_s"]
        results["framework_overhead_ratio"] = round(results["pure_core"]["packed"]["spans_per_s"] / best, 2)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("realistic", "small"), default="realistic", help="span shape (see above)")
    ap.add_argument("--calls", type=int, default=5, help="realistic: LLM calls per rollout")
    ap.add_argument("--prompt", type=int, default=2000, help="realistic: prompt token ids of the first call")
    ap.add_argument("--response", type=int, default=200, help="realistic: response token ids per call")
    ap.add_argument("--no-shared-prefix", action="store_true", help="realistic: independent prompts")
    ap.add_argument("--tasks", type=int, default=None,
                    help="tasks (x4 rollouts) for the throughput runs (default 200 realistic, 1500 small)")
    ap.add_argument("--latency-s", type=float, default=10.0, help="seconds of steady load for the latency run")
    ap.add_argument("--rate", type=float, default=None,
                    help="rollouts/s during the latency run (default 20 realistic, 100 small)")
    ap.add_argument("--latency-only", action="store_true", help="run part 3 only (no pure core, no throughput)")
    ap.add_argument("--no-stock", dest="stock", action="store_false", help="skip the stock faust run")
    args = ap.parse_args()
    small = args.shape == "small"
    shape = None if small else Shape(args.calls, args.prompt, args.response, not args.no_shared_prefix)
    args.tasks = args.tasks or (1500 if small else 200)
    args.rate = args.rate or (100.0 if small else 20.0)
    load_at_start = list(os.getloadavg())
    tune_gc()  # the worker's GC settings, so the pure core is measured like the worker runs it
    results = asyncio.run(run(args, shape))
    results["goals"] = {"p99_ms<=100": results["latency_group_size_1"]["p99_ms"] <= 100}
    if not args.latency_only:
        worker = results["worker_fast_consumer"]
        if small:
            results["goals"]["spans_per_s_per_worker>=5000"] = worker["spans_per_s"] >= 5000
        else:
            results["goals"]["tokens_per_s_per_worker>=2M"] = results["worker_backlog_drain_zstd"]["tokens_per_s"] >= 2_000_000
            results["goals"]["v1_ratio>=10"] = results["pure_core"]["v1_ratio"] >= 10
    results["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "loadavg_at_start": load_at_start, "loadavg_at_end": list(os.getloadavg())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"stream{'' if small else '_' + args.shape}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
