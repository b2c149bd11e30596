"""The stream worker's Prometheus metrics (``GET /metrics`` on ``--metrics-port``).

Why a snapshot: the stages' counters and faust's consumer belong to the event
loop, while prometheus_client serves scrapes from a thread of its own. A timer on
the loop (:meth:`StreamMetrics.refresh`, every ``tick_s``) copies what a scrape
shows into one immutable :class:`Snapshot`; the scrape thread only reads the
latest one. The changelog save latency is a histogram observed on the loop
(prometheus_client's metrics are thread-safe).

Consumer lag is the high watermark of faust's last fetch minus the last offset handed to a stage
(faust's private offsets, read through :func:`streams.faust_internals.read_offsets`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from boltstream.monitoring.metrics_server import MetricsServer

from .faust_internals import read_offsets

log = logging.getLogger(__name__)

SAVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# Stage counter -> the close reason it stands for (streams/accumulator.py counts them).
CLOSE_REASONS = {"closed": "ended", "timed_out": "timed_out"}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one scrape shows: the flat counters of :meth:`StreamApp.counters` and lag per partition."""

    counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
    lag: Mapping[tuple[str, int], int] = dataclasses.field(default_factory=dict)


def partition_lag(highwater: int | None, read_offset: int | None, committed: int | None) -> int | None:
    """Records in a partition not yet handed to a stage; None before the first fetch said where the end is.

    ``read_offset`` is the last offset read (the next is ``read_offset + 1``); with
    nothing read yet the committed offset (the next to read) stands in, else the start.
    """
    if highwater is None:
        return None
    if read_offset is not None:
        return max(0, highwater - read_offset - 1)
    return max(0, highwater - (committed or 0))


def consumer_lag(consumer: Any, topics: Iterable[str]) -> dict[tuple[str, int], int]:
    """Lag of every partition of ``topics`` assigned to faust's ``consumer`` (see the module docstring)."""
    wanted = set(topics)
    read, committed = read_offsets(consumer)
    out: dict[tuple[str, int], int] = {}
    for tp in consumer.assignment():
        if tp.topic not in wanted:
            continue
        lag = partition_lag(consumer.highwater(tp), read.get(tp), committed.get(tp))
        if lag is not None:
            out[(tp.topic, tp.partition)] = lag
    return out


class StreamMetrics(MetricsServer):
    """The registry of one stream worker; :meth:`refresh` from the loop, :meth:`serve` once."""

    def __init__(self) -> None:
        super().__init__()
        self.save_seconds = Histogram(
            "boltstream_stream_changelog_save_seconds",
            "one batch's writes of a stage to its changelog, sent to acknowledged", ["stage"],
            buckets=SAVE_BUCKETS, registry=self.registry)
        self.snapshot = Snapshot()
        self.registry.register(_SnapshotCollector(self))

    def refresh(self, counters: Mapping[str, int], lag: Mapping[tuple[str, int], int]) -> None:
        self.snapshot = Snapshot(dict(counters), dict(lag))

    def observe_save(self, stage: str, seconds: float) -> None:
        self.save_seconds.labels(stage).observe(seconds)


class _SnapshotCollector(Collector):
    def __init__(self, metrics: StreamMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snap = self.metrics.snapshot
        c = snap.counters
        lag = GaugeMetricFamily("boltstream_stream_consumer_lag_records",
                                "records of an assigned input partition not yet processed (high watermark - "
                                "next offset)", labels=["topic", "partition"])
        for (topic, partition), n in sorted(snap.lag.items()):
            lag.add_metric([topic, str(partition)], n)
        yield lag
        yield CounterMetricFamily("boltstream_stream_spans", "span records consumed from the spans topic",
                                  value=c.get("rollout.records", 0))
        yield GaugeMetricFamily("boltstream_stream_rollouts_open", "rollouts accumulating spans",
                                value=c.get("rollout.open", 0))
        closed = CounterMetricFamily("boltstream_stream_rollouts_closed",
                                     "rollouts closed: ended (root span + grace) or timed_out (idle or abandoned)",
                                     labels=["reason"])
        for key, reason in CLOSE_REASONS.items():
            closed.add_metric([reason], c.get(f"rollout.{key}", 0))
        yield closed
        yield CounterMetricFamily("boltstream_stream_trajectories", "trajectories consumed by the group stage",
                                  value=c.get("group.records", 0))
        yield GaugeMetricFamily("boltstream_stream_groups_open", "GRPO groups waiting for attempts",
                                value=c.get("group.open", 0))
        groups = CounterMetricFamily("boltstream_stream_groups_emitted",
                                     "GRPO groups emitted: complete (group_size attempts) or not (timed out)",
                                     labels=["complete"])
        groups.add_metric(["true"], c.get("group.closed", 0))
        groups.add_metric(["false"], c.get("group.timed_out", 0))
        yield groups
        yield CounterMetricFamily("boltstream_stream_samples", "training samples emitted",
                                  value=c.get("group.samples", 0))
        dlq = CounterMetricFamily("boltstream_stream_dead_letters", "records dead-lettered, by category",
                                  labels=["category"])
        for key, n in sorted(c.items()):
            if key.startswith("dlq."):
                dlq.add_metric([key[4:]], n)
        yield dlq
