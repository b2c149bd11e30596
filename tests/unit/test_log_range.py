"""Range options parsed as the CLIs take them, and the time-ordered merge that makes a replay deterministic."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from boltstream.broker.log_range import (
    EARLIEST,
    NOW,
    OFFSETS,
    TIME,
    LogRange,
    LogRangeError,
    PartitionRange,
    TimeOrder,
    parse_position,
    parse_time_ms,
)


def test_positions() -> None:
    assert parse_position("earliest").kind == EARLIEST
    assert parse_position("now", "--to").kind == NOW
    t = parse_position("2026-11-24T10:00:00Z")
    assert t.kind == TIME and t.time_ms == 1_795_514_400_000
    # no zone: UTC; an explicit offset is honoured
    assert parse_time_ms("2026-11-24T10:00:00") == t.time_ms
    assert parse_time_ms("2026-11-24T11:00:00+01:00") == t.time_ms
    o = parse_position("0:12, 3:7", "--to")
    assert o.kind == OFFSETS and dict(o.offsets or {}) == {0: 12, 3: 7}


@pytest.mark.parametrize(
    ("text", "option", "needle"),
    [
        ("now", "--from", "holds nothing"),
        ("earliest", "--to", "cannot end at the beginning"),
        ("yesterday", "--from", "expected earliest, now, an ISO time"),
        ("0:1,0:2", "--from", "partition 0 given twice"),
        ("0:x", "--to", "is not partition:offset"),
        ("2026-13-40", "--to", "expected earliest"),
    ],
)
def test_bad_positions_name_the_option_and_value(text: str, option: str, needle: str) -> None:
    with pytest.raises(LogRangeError) as err:
        parse_position(text, option)
    assert needle in str(err.value) and option in str(err.value) and repr(text) in str(err.value)


def test_range_description() -> None:
    r = LogRange("ns.spans", (PartitionRange(0, 3, 10), PartitionRange(1, 5, 5)), "earliest", "now")
    assert r.size == 7
    assert r.describe() == {"topic": "ns.spans", "from": "earliest", "to": "now",
                            "offsets": {"0": [3, 10], "1": [5, 5]}}


def _records(n_partitions: int, per: int, seed: int) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    out = []
    for p in range(n_partitions):
        ts = 1000
        for offset in range(per):
            ts += rng.choice([0, 1, 5])  # equal timestamps across partitions too
            out.append(SimpleNamespace(partition=p, offset=offset, timestamp=ts))
    return out


def _merge(records: list[SimpleNamespace], partitions: int, cut: int, seed: int) -> list[tuple[int, int]]:
    """Feed the merge in fetches of random size per partition, as a consumer would."""
    rng = random.Random(seed)
    queues = {p: [r for r in records if r.partition == p] for p in range(partitions)}
    order, out = TimeOrder(range(partitions)), []
    while any(queues.values()):
        p = rng.choice([p for p, q in queues.items() if q])
        take = rng.randint(1, cut)
        batch, queues[p] = queues[p][:take], queues[p][take:]
        order.add(batch)
        if not queues[p]:
            order.finish(p)
        out += order.ready()
    return [(r.partition, r.offset) for r in out]


def test_merge_order_is_independent_of_fetching() -> None:
    records = _records(4, 60, seed=1)
    expected = [(r.partition, r.offset) for r in sorted(records, key=lambda r: (r.timestamp, r.partition, r.offset))]
    for seed in range(20):
        assert _merge(records, 4, cut=1 + seed % 7, seed=seed) == expected


def test_merge_waits_for_a_partition_that_has_nothing_buffered() -> None:
    order = TimeOrder([0, 1])
    order.add([SimpleNamespace(partition=0, offset=0, timestamp=5)])
    assert order.ready() == []  # partition 1 may still hold an earlier record
    order.add([SimpleNamespace(partition=1, offset=0, timestamp=3)])
    assert [(r.partition, r.offset) for r in order.ready()] == [(1, 0)]
    order.finish(1)
    assert [(r.partition, r.offset) for r in order.ready()] == [(0, 0)]
