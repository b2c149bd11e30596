"""Replay: the live stream app's stages over a retained range of spans, in event time, into topics of its own.

Why the same stages (streams/stages.py) and not a re-implementation: a replay answers "what
would the pipeline have trained on with this configuration", so it must close rollouts, hold
them for rewards, form and time out groups exactly as a worker does. Only what is around the
stages differs:

* No faust, no consumer group, no changelog. The range is read with
  :func:`boltstream.broker.log_range.read_merged` (assigned partitions, nothing committed), the
  stages' tables are :class:`MemoryMap` dicts, and a replay that dies is simply run again.
* Event time. ``now`` is the records' timestamps, in the one total order ``read_merged``
  gives (timestamp, partition, offset). The stages' clock hook (``clock_ns``: markers, a
  batch's ``created_ns``) and the dead-letter writer's read the same :class:`EventClock`.
  The timer fires on the ``tick_s`` grid of event time wherever something is due
  (``Accumulator.next_deadline``), before the records stamped after it; at the end of the
  range the clock runs on until every open rollout and group has closed by its own rule
  (grace, timeouts, the reward hold). So the output depends on the range and the
  configuration only: not on when the replay ran, how fast, or how the fetches were cut.
* Steps. The records go to the rollout stage in steps (:func:`steps`): consecutive records
  within one tick interval, at most :data:`MAX_STEP_RECORDS` (the worker's fetch size);
  a step's ``now`` is its last record's timestamp, as a worker's is the time it got the fetch.
* The group stage is fed directly: each trajectory the rollout stage emits is written to
  ``<replay namespace>trajectories`` and handed to the group stage in the same step, with
  the partition the producer is told to use and the offset the topic will give it (counted
  on from the topic's end when the replay started: exact while the replay is its only writer).
* Outputs go to a real aiokafka producer. The stages see every send acknowledged at once
  (their retry-later path is for a worker that runs for weeks); the replay awaits every real
  ack before it reports success, and fails as a whole if any write failed.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

from aiokafka.partitioner import DefaultPartitioner

from boltstream.broker.dlq import DeadLetterWriter
from boltstream.errors import BoltstreamError
from boltstream.schemas import Codec

from .accumulator import Accumulator
from .config import StreamConfig
from .stages import GroupStage, RolloutStage
from .tables import ChangelogMap

log = logging.getLogger(__name__)

COMPONENT = "replay"  # the DeadLetter's ``component``
MAX_STEP_RECORDS = 1000  # records per step at most: the live worker's fetch size (streams/app.py)
SETTLE_TIMEOUT_S = 30.0


class ReplayError(BoltstreamError):
    """A replay cannot run here, or its output could not be written (re-run it)."""


class EventClock:
    """The replay's ``now`` in seconds: record timestamps and timer ticks, never the wall clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, to: float) -> float:
        """Move to ``to`` unless that is earlier (time never runs back); returns ``now``."""
        self.now = max(self.now, to)
        return self.now

    def ns(self) -> int:
        return round(self.now * 1e9)


def grid_ceil(t: float, tick_s: float) -> float:
    """The first tick of the ``tick_s`` grid at or after ``t``: when a live worker's timer would act."""
    return math.ceil(t / tick_s) * tick_s


def steps(records: Sequence[Any], tick_s: float) -> Iterator[list[Any]]:
    """``records`` (in time order) cut wherever their timestamps (ms) enter another tick interval."""
    step: list[Any] = []
    interval = None
    for record in records:
        current = math.floor(record.timestamp / 1000 / tick_s)
        if step and current != interval:
            yield step
            step = []
        step.append(record)
        interval = current
    if step:
        yield step


def _acked() -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class MemoryMap(ChangelogMap):
    """A stage table in memory only: no faust table, no changelog topic (a replay recovers by re-running)."""

    def __init__(self, name: str) -> None:  # deliberately not ChangelogMap.__init__: it declares a faust table
        self.name = name
        self.data: dict[bytes, bytes] = {}

    @property
    def store(self) -> dict[bytes, bytes]:
        return self.data

    async def put(self, partition: int, key: bytes, value: bytes) -> asyncio.Future[Any]:
        self.data[key] = value
        return _acked()

    async def delete(self, partition: int, key: bytes) -> asyncio.Future[Any]:
        self.data.pop(key, None)
        return _acked()


class Handed(NamedTuple):
    """A trajectory as the group stage would have consumed it from the trajectories topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


class OutputProducer:
    """The ``app.producer`` the stages send through (faust's ``send`` signature), over an aiokafka producer."""

    def __init__(self, producer: Any, trajectories_topic: str, partitions: Iterable[int],
                 end_offsets: Mapping[int, int]) -> None:
        self.producer = producer
        self.trajectories_topic = trajectories_topic
        self.partitions = sorted(partitions)
        self.next_offset = {p: end_offsets.get(p, 0) for p in self.partitions}
        self.partitioner = DefaultPartitioner()
        self.written: collections.Counter[str] = collections.Counter()  # acked records by topic
        self.errors: list[str] = []
        self._handed: list[Handed] = []
        self._inflight: set[asyncio.Future[Any]] = set()

    async def send(self, topic: str, key: bytes | None, value: bytes, partition: int | None = None,
                   timestamp: Any = None, headers: Any = None) -> asyncio.Future[Any]:
        """Queue one record on the real producer; the stage gets an acknowledged future (see the module docstring)."""
        handing = topic == self.trajectories_topic
        if handing:
            partition = self.partitioner(key, self.partitions, self.partitions)
        future = await self.producer.send(topic, value, key=key, partition=partition)
        self._inflight.add(future)
        future.add_done_callback(functools.partial(self._on_ack, topic))
        if handing:
            assert partition is not None
            offset = self.next_offset[partition]
            self.next_offset[partition] = offset + 1
            self._handed.append(Handed(topic, partition, offset, key, value))
        return _acked()

    def _on_ack(self, topic: str, future: asyncio.Future[Any]) -> None:
        self._inflight.discard(future)
        if future.cancelled():
            self.errors.append(f"{topic}: send cancelled")
        elif (exc := future.exception()) is not None:
            self.errors.append(f"{topic}: {type(exc).__name__}: {exc}")
        else:
            self.written[topic] += 1

    def take_trajectories(self) -> list[Handed]:
        """The trajectories sent since the last call, in the order they were sent."""
        handed, self._handed = self._handed, []
        return handed

    def check(self) -> None:
        if self.errors:
            raise ReplayError(f"{len(self.errors)} output record(s) not written (first: {self.errors[0]}); "
                              "the replay's output is incomplete: run it again with --overwrite")

    async def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """Wait for every record's ack; raise ReplayError when one failed or did not come in ``timeout``."""
        await self.producer.flush()
        if self._inflight:
            _, pending = await asyncio.wait(list(self._inflight), timeout=timeout)
            if pending:
                raise ReplayError(f"{len(pending)} output record(s) not acknowledged within {timeout:.0f}s")
        self.check()


class ReplayEngine:
    """The rollout and group stages on an :class:`EventClock` (see the module docstring).

    ``config`` is the stages' configuration with the REPLAY namespace in its settings (outputs
    and dead letters go there); ``spans_topic`` and ``spans_partitions`` name the live input.
    """

    def __init__(self, config: StreamConfig, spans_topic: str, spans_partitions: Iterable[int],
                 output: OutputProducer, codec: Codec) -> None:
        self.clock = EventClock()
        self.tick_s = config.tick_s
        self.output = output
        app = SimpleNamespace(producer=output)
        self.dlq = DeadLetterWriter(config.settings, codec, COMPONENT, send=output.send)
        self.dlq.clock_ns = self.clock.ns
        self.rollouts = RolloutStage(app, MemoryMap("rollout-spans"), MemoryMap("rollouts-emitted"), config,
                                     codec, self.dlq)
        self.rollouts.in_topic = spans_topic  # the live topic the spans come from: dead letters name it
        self.groups = GroupStage(app, MemoryMap("group-trajectories"), MemoryMap("groups-emitted"), config,
                                 codec, self.dlq)
        for stage, partitions in ((self.rollouts, spans_partitions), (self.groups, output.partitions)):
            stage.clock_ns = self.clock.ns
            stage.active = set(partitions)
            stage.ready = True
        self.ticks = 0

    async def feed(self, step: Sequence[Any]) -> None:
        """One step of consumed span records (see :func:`steps`): the timer first, then the records."""
        await self.advance(step[0].timestamp / 1000)
        now = self.clock.advance(step[-1].timestamp / 1000)
        await self.rollouts.on_batch(step, now)
        await self._settle(self.rollouts)
        await self._hand_over(now)

    async def advance(self, until: float, forget: bool = True) -> None:
        """Fire the timer at each tick up to ``until`` where a rollout or group (or, with ``forget``, a marker) is due."""
        last = None
        while True:
            due = [d for d in (self.rollouts.next_deadline(forget), self.groups.next_deadline(forget)) if d is not None]
            if not due:
                return
            if last is not None and min(due) <= last:
                raise ReplayError(f"something due at {min(due):.3f} is still open after the tick at {last:.3f}")
            at = max(self.clock.now, grid_ceil(min(due), self.tick_s))
            if at > until:
                return
            await self._tick(at)
            last = at

    async def finish(self) -> None:
        """The range is done: run the clock on until every open rollout and group closed by its own rule."""
        await self.advance(math.inf, forget=False)

    async def _tick(self, at: float) -> None:
        now = self.clock.advance(at)
        await self.rollouts.tick(now)
        await self._settle(self.rollouts)
        await self.groups.tick(now)
        await self._settle(self.groups)
        await self._hand_over(now)
        self.ticks += 1

    async def _hand_over(self, now: float) -> None:
        handed = self.output.take_trajectories()
        if handed:
            await self.groups.on_batch(handed, now)
            await self._settle(self.groups)

    async def _settle(self, stage: Accumulator) -> None:
        """Let the stage's closes finish at this ``now``, before the clock moves (their markers read it)."""
        if not await stage.drain(SETTLE_TIMEOUT_S):
            raise ReplayError(f"the {stage.kind} stage's closes did not finish within {SETTLE_TIMEOUT_S:.0f}s")
        self.output.check()

    def counters(self) -> dict[str, int]:
        """What the replay did, as the summary reports it (records written: once the output settled)."""
        r, g, written = self.rollouts.stats, self.groups.stats, self.output.written
        return {
            "spans": r["records"],
            "rollouts": r["closed"] + r["timed_out"],
            "trajectories": written[self.rollouts.out_topic],
            "groups": g["closed"] + g["timed_out"],
            "batches": written[self.groups.out_topic],
            "samples": g["samples"],
            "dead_letters": written[self.dlq.topic],
            "late": r["late"] + g["late"],
            "duplicates": r["duplicate"] + g["duplicate"],
            "ticks": self.ticks,
        }
