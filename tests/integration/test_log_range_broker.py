"""Ranges resolved and read against the real broker: offsets, times, the log end, and what is refused."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from boltstream.broker.kafka import producer_kwargs
from boltstream.broker.log_range import LogRangeError, parse_position, read_merged, read_range, resolve
from boltstream.config import Settings
from boltstream.stack import run_sync

T0 = 1_795_514_400_000  # 2026-11-24T10:00:00Z


async def _produce(settings: Settings, topic: str) -> None:
    """Partition p gets 10 records stamped T0 + 1000*i + p (i = 0..9)."""
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    try:
        futures = [await producer.send(topic, f"{p}-{i}".encode(), partition=p, timestamp_ms=T0 + 1000 * i + p)
                   for i in range(10) for p in range(settings.partitions)]
        for f in futures:
            await f
    finally:
        await producer.stop()


def _resolve(settings: Settings, topic: str, start: str, end: str = "now", **kw: object):
    return run_sync(resolve(settings, topic, parse_position(start, "--from"), parse_position(end, "--to"), **kw))


def _read(settings: Settings, log_range, merged: bool = False) -> list[bytes]:
    async def go() -> list[bytes]:
        reader = read_merged if merged else read_range
        return [r.value async for batch in reader(settings, log_range, max_records=7) for r in batch]

    return run_sync(go())


def test_ranges_by_offset_time_and_end(settings: Settings) -> None:
    topic = settings.topic("spans")
    run_sync(_produce(settings, topic))
    n = settings.partitions

    everything = _resolve(settings, topic, "earliest")
    assert everything.size == 10 * n and [(p.start, p.end) for p in everything.partitions] == [(0, 10)] * n
    # merged: time order across partitions, whatever the fetch sizes
    assert _read(settings, everything, merged=True) == [f"{p}-{i}".encode() for i in range(10) for p in range(n)]
    assert sorted(_read(settings, everything)) == sorted(f"{p}-{i}".encode() for i in range(10) for p in range(n))

    # by time: [T0+3s, T0+5s) -> records i=3,4 of every partition (partition p is stamped +p ms)
    window = _resolve(settings, topic, "2026-11-24T10:00:03Z", "2026-11-24T10:00:05Z")
    assert [(p.start, p.end) for p in window.partitions] == [(3, 5)] * n
    assert _read(settings, window, merged=True) == [f"{p}-{i}".encode() for i in (3, 4) for p in range(n)]

    # by offsets: partition 0 from 8, the others from their start; to now
    tail = _resolve(settings, topic, "0:8", "now")
    assert tail.partitions[0].start == 8 and tail.size == 2 + 10 * (n - 1)

    # a time after every record: nothing in range -> a clear error, unless allowed
    try:
        _resolve(settings, topic, "2030-01-01T00:00:00Z")
        raise AssertionError("an empty range was accepted")
    except LogRangeError as exc:
        assert "no records of" in str(exc) and "holds offsets 0:0..10" in str(exc)
    assert _resolve(settings, topic, "2030-01-01T00:00:00Z", allow_empty=True).size == 0


def test_refusals_name_what_is_wrong(settings: Settings) -> None:
    topic = settings.topic("spans")
    run_sync(_produce(settings, topic))
    cases = [
        (settings.topic("no-such-topic"), "earliest", "now", "does not exist"),
        (topic, "0:11", "now", "offset 11 is out of range for partition 0"),
        (topic, "99:0", "now", "has no partition 99"),
        (topic, "0:5", "0:2", "before its start 5"),
    ]
    for name, start, end, needle in cases:
        try:
            _resolve(settings, name, start, end)
        except LogRangeError as exc:
            assert needle in str(exc), (start, end, str(exc))
        else:
            raise AssertionError(f"{start}..{end} on {name} was accepted")
