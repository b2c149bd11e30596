"""Ranges of a retained topic: ``--from`` / ``--to`` parsed, resolved to offsets, and read back.

Why one module: ``boltstream replay``, ``boltstream export`` and ``boltstream
learn --offline`` all take "this stretch of that topic", and must agree on what
it means. A position is ``earliest``, ``now`` (the log end when the command
starts, so a range never chases new records), an ISO-8601 time (the first
record at or after it, by the records' timestamps; a time without a zone is
UTC) or explicit ``partition:offset,...``. A range is half-open,
``[start, end)`` per partition, resolved once before reading, so the same
arguments over the same retained log read the same records.

Reading uses a consumer with no group (``assign``): it commits nothing and
joins no group, so the live pipeline's groups and offsets are never touched.
:func:`read_merged` hands records over in one total order, (timestamp,
partition, offset), so a consumer of the whole range (the replay's clock)
sees the same sequence on every run whatever the fetch sizes.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from boltstream.broker.kafka import consumer_kwargs, log_end_offsets
from boltstream.config import Settings
from boltstream.errors import BoltstreamError

log = logging.getLogger(__name__)

EARLIEST, NOW, TIME, OFFSETS = "earliest", "now", "time", "offsets"


class LogRangeError(BoltstreamError, ValueError):
    """A range option is malformed, names what the topic does not hold, or selects nothing."""


@dataclasses.dataclass(frozen=True)
class Position:
    """One end of a range, as the user wrote it (``text``) and as parsed."""

    kind: str
    text: str
    time_ms: int | None = None
    offsets: Mapping[int, int] | None = None


def parse_time_ms(text: str) -> int:
    """Epoch milliseconds of an ISO-8601 time (``Z`` or an offset; none means UTC)."""
    value = text.strip()
    if value.endswith(("Z", "z")):
        value = value[:-1] + "+00:00"
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def parse_position(text: str, option: str = "--from") -> Position:
    """``earliest`` | ``now`` | ISO time | ``partition:offset[,partition:offset...]``."""
    value = text.strip()
    lowered = value.lower()
    if lowered in ("earliest", "beginning"):
        if option == "--to":
            raise LogRangeError(f"{option} {text!r}: a range cannot end at the beginning of the log")
        return Position(EARLIEST, value)
    if lowered in ("now", "latest", "end"):
        if option == "--from":
            raise LogRangeError(f"{option} {text!r}: a range starting at the log end holds nothing "
                                "(use earliest, a time or offsets)")
        return Position(NOW, value)
    if ":" in value and all(part.strip().partition(":")[0].strip().isdigit() for part in value.split(",")):
        offsets: dict[int, int] = {}
        for part in value.split(","):
            p, _, o = part.strip().partition(":")
            try:
                partition, offset = int(p), int(o)
            except ValueError:
                raise LogRangeError(f"{option} {text!r}: {part.strip()!r} is not partition:offset") from None
            if partition < 0 or offset < 0:
                raise LogRangeError(f"{option} {text!r}: partitions and offsets are >= 0")
            if partition in offsets:
                raise LogRangeError(f"{option} {text!r}: partition {partition} given twice")
            offsets[partition] = offset
        return Position(OFFSETS, value, offsets=offsets)
    try:
        return Position(TIME, value, time_ms=parse_time_ms(value))
    except ValueError:
        raise LogRangeError(
            f"{option} {text!r}: expected earliest, now, an ISO time (2026-11-24T10:00:00Z) "
            "or partition:offset[,partition:offset...]"
        ) from None


@dataclasses.dataclass(frozen=True)
class PartitionRange:
    partition: int
    start: int  # first offset read
    end: int  # one past the last offset read

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)


@dataclasses.dataclass(frozen=True)
class LogRange:
    """A resolved range: per partition, the offsets ``[start, end)`` to read."""

    topic: str
    partitions: tuple[PartitionRange, ...]
    start_text: str = EARLIEST
    end_text: str = NOW

    @property
    def size(self) -> int:
        """Offsets covered (an upper bound of the records: compaction and control records leave gaps)."""
        return sum(p.size for p in self.partitions)

    def describe(self) -> dict[str, Any]:
        """JSON-able description (file metadata, logs, a replay's manifest)."""
        return {
            "topic": self.topic,
            "from": self.start_text,
            "to": self.end_text,
            "offsets": {str(p.partition): [p.start, p.end] for p in self.partitions},
        }


async def resolve(
    settings: Settings, topic: str, start: Position, end: Position, *, allow_empty: bool = False,
    timeout: float = 30.0,
) -> LogRange:
    """Turn two positions into offsets, checked against what the broker holds now."""
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None, request_timeout_ms=int(timeout * 1000)))
    await consumer.start()
    try:
        await consumer.topics()  # a full metadata fetch, so partitions_for_topic answers
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise LogRangeError(f"topic {topic!r} does not exist on {settings.bootstrap_servers}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        first = await consumer.beginning_offsets(tps)
        last = await log_end_offsets(settings, tps, timeout=timeout)
        bounds = {tp.partition: (first[tp], max(first[tp], last[tp])) for tp in tps}
        starts = await _offsets(consumer, topic, start, bounds, "--from")
        ends = await _offsets(consumer, topic, end, bounds, "--to")
    finally:
        await consumer.stop()
    ranges = []
    for p in sorted(bounds):
        s, e = starts[p], ends[p]
        if e < s:
            raise LogRangeError(f"--from {start.text!r} / --to {end.text!r}: partition {p} would end at {e}, "
                                f"before its start {s}")
        ranges.append(PartitionRange(p, s, e))
    result = LogRange(topic, tuple(ranges), start.text, end.text)
    if result.size == 0 and not allow_empty:
        held = ", ".join(f"{p}:{lo}..{hi}" for p, (lo, hi) in sorted(bounds.items()))
        raise LogRangeError(f"no records of {topic!r} between {start.text!r} and {end.text!r} "
                            f"(the topic holds offsets {held})")
    return result


async def _offsets(
    consumer: AIOKafkaConsumer, topic: str, position: Position, bounds: Mapping[int, tuple[int, int]], option: str
) -> dict[int, int]:
    if position.kind == EARLIEST:
        return {p: lo for p, (lo, _) in bounds.items()}
    if position.kind == NOW:
        return {p: hi for p, (_, hi) in bounds.items()}
    if position.kind == TIME:
        assert position.time_ms is not None
        return {p: await _offset_for_time(consumer, TopicPartition(topic, p), position.time_ms, lo, hi)
                for p, (lo, hi) in bounds.items()}
    assert position.offsets is not None
    unknown = sorted(set(position.offsets) - set(bounds))
    if unknown:
        raise LogRangeError(f"{option} {position.text!r}: {topic!r} has no partition {unknown[0]} "
                            f"(partitions 0..{max(bounds)})")
    out = {}
    for p, (lo, hi) in bounds.items():
        offset = position.offsets.get(p, lo if option == "--from" else hi)
        if not lo <= offset <= hi:
            raise LogRangeError(f"{option} {position.text!r}: offset {offset} is out of range for partition {p} "
                                f"of {topic!r}, which holds offsets {lo}..{hi}")
        out[p] = offset
    return out


async def _timestamp_at(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> tuple[int, int]:
    """(offset, timestamp) of the first record at or after ``offset``."""
    consumer.assign([tp])
    consumer.seek(tp, offset)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        records = (await consumer.getmany(tp, timeout_ms=500, max_records=1)).get(tp)
        if records:
            return records[0].offset, records[0].timestamp
    raise LogRangeError(f"could not read {tp.topic}[{tp.partition}] at offset {offset}")


async def _offset_for_time(consumer: AIOKafkaConsumer, tp: TopicPartition, time_ms: int, lo: int, hi: int) -> int:
    """First offset in ``[lo, hi)`` whose record is stamped at or after ``time_ms`` (``hi`` if none).

    A binary search over the records themselves, because ListOffsets by time is
    not trustworthy on every broker (Tansu 0.6 answers offset 0 whatever the
    time). Exact when a partition's timestamps only grow, as they do with one
    producer clock; with several skewed clocks it is as approximate as Kafka's own.
    """
    best = hi  # invariant: the answer is ``best`` or lies in [lo, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        found, stamp = await _timestamp_at(consumer, tp, mid)
        if found >= hi:  # no record in [mid, hi)
            hi = mid
        elif stamp >= time_ms:
            best, hi = found, mid
        else:
            lo = found + 1
    return best


async def read_range(
    settings: Settings, log_range: LogRange, *, max_records: int = 1000, stall_timeout: float = 30.0
) -> AsyncIterator[list[Any]]:
    """Fetches of the range's records (each list in offset order per partition), in bounded memory.

    Raises LogRangeError when a partition makes no progress for ``stall_timeout``
    seconds (records deleted by retention while reading, a broker gone).
    """
    todo = {TopicPartition(log_range.topic, p.partition): p for p in log_range.partitions if p.size}
    if not todo:
        return
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None, max_poll_records=max_records))
    await consumer.start()
    try:
        consumer.assign(list(todo))
        for tp, pr in todo.items():
            consumer.seek(tp, pr.start)
        progress = time.monotonic()
        while todo:
            fetched = await consumer.getmany(*todo, timeout_ms=500, max_records=max_records)
            out = []
            for tp, records in fetched.items():
                end = todo[tp].end
                out.extend(r for r in records if r.offset < end)
            for tp in list(todo):
                if await consumer.position(tp) >= todo[tp].end:
                    del todo[tp]
            if out:
                progress = time.monotonic()
                yield out
            elif todo and time.monotonic() - progress > stall_timeout:
                raise LogRangeError(
                    f"reading {log_range.topic!r}: no progress for {stall_timeout:.0f}s on partitions "
                    f"{sorted(tp.partition for tp in todo)} (records removed by retention? broker down?)"
                )
    finally:
        await consumer.stop()


class TimeOrder:
    """Pure k-way merge of per-partition record streams into (timestamp, partition, offset) order.

    A record is released only while every partition that is not finished has
    one buffered, so the order never depends on how the fetches were cut.
    """

    def __init__(self, partitions: Iterable[int]) -> None:
        self.buffers: dict[int, deque[Any]] = {p: deque() for p in partitions}
        self.finished: set[int] = set()

    def add(self, records: Iterable[Any]) -> None:
        for record in records:
            self.buffers[record.partition].append(record)

    def finish(self, partition: int) -> None:
        self.finished.add(partition)

    def ready(self) -> list[Any]:
        """Every record that can be released now, in order."""
        buffers, out = self.buffers, []
        heap = [(b[0].timestamp, p, b[0].offset) for p, b in buffers.items() if b]
        heapq.heapify(heap)
        waiting = {p for p, b in buffers.items() if not b and p not in self.finished}
        while heap and not waiting:
            _, p, _ = heapq.heappop(heap)
            out.append(buffers[p].popleft())
            if buffers[p]:
                heapq.heappush(heap, (buffers[p][0].timestamp, p, buffers[p][0].offset))
            elif p not in self.finished:
                waiting.add(p)
        return out


async def read_merged(
    settings: Settings, log_range: LogRange, *, max_records: int = 1000, stall_timeout: float = 30.0
) -> AsyncIterator[list[Any]]:
    """The range's records in one total order, (timestamp, partition, offset), in lists of ``max_records``.

    Lists are cut by count from that one sequence, so they too are the same on
    every run. Memory: what the fetches buffer ahead, bounded by the partitions' skew.
    """
    ends = {p.partition: p.end for p in log_range.partitions if p.size}
    order = TimeOrder(ends)
    pending: list[Any] = []
    async for fetched in read_range(settings, log_range, max_records=max_records, stall_timeout=stall_timeout):
        order.add(fetched)
        for record in fetched:
            if record.offset + 1 >= ends[record.partition]:
                order.finish(record.partition)
        pending.extend(order.ready())
        while len(pending) >= max_records:
            yield pending[:max_records]
            del pending[:max_records]
    for p in ends:  # the reader finished every partition (a gap at a partition's end included)
        order.finish(p)
    pending.extend(order.ready())
    for i in range(0, len(pending), max_records):
        yield pending[i : i + max_records]
