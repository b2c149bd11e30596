"""``boltstream replay``: the stream stages over a range of the live ``spans`` topic, with another configuration.

    boltstream replay --namespace exp1. [--from earliest] [--to now] [--gamma 0.9 --air-rules-file air.yaml ...]

Reads ``<live namespace>spans`` (the usual ``BOLTSTREAM_NAMESPACE``, or ``--live-namespace``)
from ``--from`` to ``--to`` without a consumer group, runs the live worker's stages on it in
event time (streams/replay.py) and writes ``<namespace>trajectories``, ``<namespace>batches``
and ``<namespace>dlq``; exits 0 with a summary once every rollout and group of the range closed.

Every stage setting of ``boltstream stream worker`` is a flag here too (and a
``BOLTSTREAM_STREAM_*`` variable): AIR rules, credit, grace and timeouts, ``group_size``,
``agent_match``... Settings that only mean something to a faust worker (app id, store, commit
interval, consumer path, log period, profile) are not offered.

The output namespace must differ from the live one. One that already holds data is refused
unless ``--overwrite``, which deletes and recreates its four topics (verified empty, with a
bounded retry: boltstream.broker.topics.recreate_topics); a namespace with a non-empty ``spans`` topic
is a live pipeline's and is always refused. A replay killed half-way is simply run again with
``--overwrite``: nothing of it is kept but its partial output, which the re-run replaces.
A finished replay writes one ``ReplayDone`` record to ``<namespace>replay`` last, once every
other write is acknowledged (boltstream.broker.replay_marker): ``learn --offline`` refuses a replay
namespace without it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from aiokafka import AIOKafkaProducer, TopicPartition

from boltstream.broker import replay_marker
from boltstream.broker.kafka import log_end_offsets, producer_kwargs, wait_for_broker
from boltstream.broker.log_range import Position, parse_position, read_merged, resolve
from boltstream.broker.topics import ensure_topics, held_records, recreate_topics
from boltstream.config import Settings, flags_from_dataclass, knobs, load, opt
from boltstream.errors import ConfigError
from boltstream.schemas import Codec

from .config import StreamConfig, load_stream_config
from .replay import MAX_STEP_RECORDS, OutputProducer, ReplayEngine, ReplayError, steps

log = logging.getLogger(__name__)

OUTPUTS = ("trajectories", "batches", "dlq", replay_marker.TOPIC)  # the marker topic: written last, see below
# StreamConfig settings that only a faust worker uses (and the live namespace, which has its own flag).
NOT_REPLAYED = ("app_id", "store", "commit_interval_s", "fast_consumer", "log_every_s", "profile", "namespace",
                "metrics_port", "metrics_host")
REPLAY_SETTINGS = tuple(k.name for k in knobs(StreamConfig) if k.name not in NOT_REPLAYED)
TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
PROGRESS_EVERY_S = 10.0
TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """What one replay reads, how it processes it and where it writes (``BOLTSTREAM_REPLAY_*``)."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_REPLAY_"
    stream: StreamConfig = dataclasses.field(default_factory=StreamConfig)
    namespace: str = opt("", "prefix of the replay's own topics (<namespace>trajectories, batches, dlq); "
                             "must differ from the live namespace")
    start: str = opt("earliest", "first record: earliest, an ISO time (2026-11-24T10:00:00Z) or "
                                 "partition:offset,...")
    end: str = opt("now", "end of the range, exclusive: now (the log end when the replay starts), an ISO time "
                          "or partition:offset,...")
    # Deletes data: only ever from an explicit --overwrite, never from an environment variable.
    overwrite: bool = opt(False, "delete and recreate the replay namespace's topics when they hold data", cli=False)

    def __post_init__(self) -> None:
        live = self.stream.settings.namespace
        if not self.namespace:
            raise ConfigError("namespace", self.namespace, "a replay needs --namespace, the prefix of its own topics")
        if not TOPIC_CHARS.fullmatch(self.namespace):
            raise ConfigError("namespace", self.namespace, "letters, digits, '.', '_' and '-' only (topic names)")
        if self.namespace == live:
            raise ConfigError("namespace", self.namespace, "is the live pipeline's namespace; a replay writes "
                                                           "topics of its own (e.g. --namespace replay1.)")

    def positions(self) -> tuple[Position, Position]:
        return parse_position(self.start, "--from"), parse_position(self.end, "--to")

    def stage_config(self) -> StreamConfig:
        """The stages' configuration, writing into the replay namespace."""
        return dataclasses.replace(self.stream, settings=self.output_settings())

    def output_settings(self) -> Settings:
        return dataclasses.replace(self.stream.settings, namespace=self.namespace)


def stage_settings(config: StreamConfig) -> dict[str, Any]:
    """The settings that decide a replay's output (for its summary): no broker settings, no secrets."""
    values = dataclasses.asdict(config)
    values.pop("settings")
    return {k: v for k, v in values.items() if k not in NOT_REPLAYED}


async def prepare_outputs(settings: Settings, overwrite: bool, timeout: float = TIMEOUT_S) -> None:
    """Refuse a live namespace, or one holding data unless ``overwrite`` (then recreate it); create the topics."""
    spans = settings.topic("spans")
    held = await held_records(settings, [spans, *(settings.topic(t) for t in OUTPUTS)])
    if held.get(spans):
        raise ReplayError(f"namespace {settings.namespace!r} has a spans topic holding {held[spans]} records: it is "
                          "a live pipeline's namespace; give the replay a namespace of its own")
    data = {topic: n for topic, n in held.items() if n and topic != spans}
    if data and not overwrite:
        holding = ", ".join(f"{topic}: {n} records" for topic, n in sorted(data.items()))
        raise ReplayError(f"namespace {settings.namespace!r} already holds data ({holding}); choose another "
                          "--namespace, or pass --overwrite to delete and recreate its topics")
    if data:
        log.info("--overwrite: deleting and recreating %s", ", ".join(sorted(data)))
        await recreate_topics(settings, OUTPUTS, timeout)
    else:
        await ensure_topics(settings, OUTPUTS, timeout)


async def run(config: ReplayConfig, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Resolve the range, prepare the output namespace, replay, wait for every ack; returns the summary."""
    start, end = config.positions()
    live, out = config.stream.settings, config.output_settings()
    await wait_for_broker(live, timeout=timeout)
    log_range = await resolve(live, live.topic("spans"), start, end)
    await prepare_outputs(out, config.overwrite, timeout)
    stages = config.stage_config()
    log.info("replay of %s %s into %s*: %s", log_range.topic, log_range.describe()["offsets"], out.namespace,
             stage_settings(stages))
    producer = AIOKafkaProducer(**producer_kwargs(out))
    await producer.start()
    try:
        trajectories = out.topic("trajectories")
        partitions = sorted(await producer.partitions_for(trajectories))
        ends = await log_end_offsets(out, [TopicPartition(trajectories, p) for p in partitions])
        output = OutputProducer(producer, trajectories, partitions, {tp.partition: e for tp, e in ends.items()})
        codec = Codec.from_registry_url(out.schema_registry_url)
        engine = ReplayEngine(stages, log_range.topic, [p.partition for p in log_range.partitions], output, codec)
        started = last_log = time.perf_counter()
        async for records in read_merged(live, log_range, max_records=MAX_STEP_RECORDS):
            for step in steps(records, stages.tick_s):
                await engine.feed(step)
            if time.perf_counter() - last_log > PROGRESS_EVERY_S:
                last_log = time.perf_counter()
                log.info("replay: %d of at most %d spans, event time %.3f", engine.rollouts.stats["records"],
                         log_range.size, engine.clock.now)
        await engine.finish()
        await output.settle(timeout)
        elapsed = time.perf_counter() - started
        counters = engine.counters()
        written = [TopicPartition(out.topic(t), p) for t in OUTPUTS if t != replay_marker.TOPIC
                   for p in sorted(await producer.partitions_for(out.topic(t)))]
        ends = await log_end_offsets(out, written)
        done = replay_marker.done_record(out.namespace, log_range, {(tp.topic, tp.partition): e
                                                                   for tp, e in ends.items()},
                                         stage_settings(stages), counters)
        marker = out.topic(replay_marker.TOPIC)  # last: only a replay that got here has one
        await producer.send_and_wait(marker, codec.encode(replay_marker.RECORD, done, topic=marker), partition=0)
    finally:
        await producer.stop()
    return {
        "range": log_range.describe(),
        "namespace": out.namespace,
        "topics": [out.topic(t) for t in OUTPUTS],
        **counters,
        "elapsed_s": round(elapsed, 3),
        "spans_per_s": round(counters["spans"] / elapsed, 1) if elapsed > 0 else 0.0,
        "config": stage_settings(stages),
        "done_marker": out.topic(replay_marker.TOPIC),
    }


def format_summary(summary: dict[str, Any]) -> str:
    r = summary["range"]
    offsets = ", ".join(f"{p}:{lo}..{hi}" for p, (lo, hi) in r["offsets"].items())
    counts = ", ".join(f"{k.replace('_', ' ')} {summary[k]}" for k in (
        "spans", "rollouts", "trajectories", "groups", "batches", "samples", "dead_letters", "late"))
    return (f"replayed {r['topic']} from {r['from']} to {r['to']} (offsets {offsets}) into "
            f"{', '.join(summary['topics'])}\n  {counts}\n"
            f"  {summary['spans']} spans in {summary['elapsed_s']:.2f} s: {summary['spans_per_s']:.0f} spans/s\n"
            f"  done: marker written to {summary['done_marker']}\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream replay", description=(
        "Re-run the stream stages over a range of the live spans topic with another configuration, "
        "into topics of the replay's own namespace; exits when the range is done."))
    p.add_argument("--namespace", dest="replay_namespace", metavar="NAME",
                   help="prefix of the replay's own topics (required; env BOLTSTREAM_REPLAY_NAMESPACE)")
    p.add_argument("--from", dest="start", metavar="POSITION",
                   help="earliest (default), an ISO time (2026-11-24T10:00:00Z) or partition:offset,...")
    p.add_argument("--to", dest="end", metavar="POSITION",
                   help="now (default: the log end when the replay starts), an ISO time or partition:offset,...")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="delete and recreate the replay namespace's topics if they hold data")
    p.add_argument("--live-namespace", metavar="NAMESPACE",
                   help="namespace whose spans are replayed (default boltstream.; env BOLTSTREAM_NAMESPACE)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("-l", "--loglevel", default="info", help="log level (default info)")
    flags_from_dataclass(p, StreamConfig, only=REPLAY_SETTINGS)
    return p


def config_from_args(args: dict[str, Any], env: Mapping[str, str] | None = None) -> ReplayConfig:
    """The ReplayConfig of parsed flags (``vars(parser().parse_args(...))`` without loglevel and json)."""
    args = dict(args)
    replay = {"namespace": args.pop("replay_namespace"), "start": args.pop("start"), "end": args.pop("end"),
              "overwrite": args.pop("overwrite")}
    args["namespace"] = args.pop("live_namespace")
    config = load(ReplayConfig, {"stream": load_stream_config(args, env), **replay}, env)
    config.positions()  # a malformed --from/--to fails before the broker is asked anything
    return config


def main(argv: list[str]) -> int:
    args = vars(parser().parse_args(argv))
    level = logging.getLevelName(args.pop("loglevel").upper())
    logging.getLogger().setLevel(level if isinstance(level, int) else logging.INFO)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    as_json = args.pop("json")
    summary = asyncio.run(run(config_from_args(args)))
    sys.stdout.write(json.dumps(summary) + "\n" if as_json else format_summary(summary))
    return 0
