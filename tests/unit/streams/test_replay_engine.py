"""The replay engine without a broker: event-time closes, the group stage fed directly, repeatable output.

The aiokafka producer under :class:`OutputProducer` is a recorder here (every record acked at
once); the integration tests (tests/integration/streams/test_replay.py) run the real one.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import pytest
from aiokafka.partitioner import DefaultPartitioner

from boltstream.config import Settings, load
from boltstream.schemas import Codec
from boltstream.streams.config import StreamConfig
from boltstream.streams.replay import EventClock, OutputProducer, ReplayEngine, grid_ceil, steps
from tests.unit.streams.factory import llm_span, reward_span, root_span, span, tool_span

CODEC = Codec()
LIVE = "live.spans"
T0_MS = 1_000_000  # event time of the first span: 1000 s


class Record(NamedTuple):
    """The attributes of a consumed record the stages read."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: int  # ms


class RecordingProducer:
    """aiokafka's ``send``/``flush``: records kept in order, each acked at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int | None, bytes | None, bytes]] = []

    async def send(self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None) -> Any:
        self.sent.append((topic, partition, key, value))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def flush(self) -> None:
        return None

    def to(self, topic: str) -> list[tuple[str, int | None, bytes | None, bytes]]:
        return [s for s in self.sent if s[0] == topic]


def rollout(rollout_id: str, task: str, attempt: int) -> list[dict[str, Any]]:
    ids = {"rollout_id": rollout_id, "attempt_id": f"{task}:{attempt}", "task_id": task}
    return [
        llm_span("a1", [1, 2], [3, 4], start=10, end=20, **ids),
        tool_span("tl", start=25, end=30, error=True, **ids),
        {**reward_span("rw", 0.5 + attempt, at=60, final=True, primary=True), **ids},
        root_span(start=0, end=100, **ids),
    ]


def records() -> list[Record]:
    """Three rollouts (task t1 twice, t2 once) and one undecodable record, 1 ms apart from 1000 s on."""
    spans = rollout("r1", "t1", 0) + rollout("r2", "t1", 1) + rollout("r3", "t2", 0)
    out = [Record(LIVE, 0, i, s["rollout_id"].encode(), CODEC.encode("Span", s, topic=LIVE), T0_MS + i)
           for i, s in enumerate(spans)]
    return [*out, Record(LIVE, 0, len(out), b"junk", b"not avro", T0_MS + len(out))]


def config(**knobs: Any) -> StreamConfig:
    return load(StreamConfig, {"settings": Settings(namespace="r."), "grace_s": 2.0, "group_size": 2,
                               "group_timeout_s": 30.0, **knobs}, env={})


async def replay(cuts: list[list[Record]], **knobs: Any) -> tuple[RecordingProducer, ReplayEngine]:
    producer = RecordingProducer()
    output = OutputProducer(producer, "r.trajectories", range(4), {})
    engine = ReplayEngine(config(**knobs), LIVE, [0], output, CODEC)
    for step in cuts:
        await engine.feed(step)
    await engine.finish()
    await output.settle()
    return producer, engine


def test_steps_cut_where_the_timestamps_enter_another_tick() -> None:
    stamped = [Record(LIVE, 0, i, None, b"", ms) for i, ms in enumerate([0, 100, 499, 500, 999, 1000, 2600])]
    assert [[r.timestamp for r in s] for s in steps(stamped, 0.5)] == [[0, 100, 499], [500, 999], [1000], [2600]]
    assert list(steps([], 0.5)) == []


def test_the_timer_grid_and_the_clock_never_run_back() -> None:
    assert grid_ceil(1002.004, 0.5) == 1002.5
    assert grid_ceil(1002.5, 0.5) == 1002.5
    assert grid_ceil(7.01, 2.0) == 8.0
    clock = EventClock()
    assert clock.advance(5.25) == 5.25 and clock.advance(3.0) == 5.25 and clock.ns() == 5_250_000_000


async def test_closes_happen_in_event_time_and_the_group_stage_is_fed_directly() -> None:
    producer, engine = await replay(list(steps(records(), 0.5)))
    trajectories = producer.to("r.trajectories")
    assert [CODEC.decode(v, expect="Trajectory")["attempt_id"] for *_, v in trajectories] == ["t1:0", "t1:1", "t2:0"]
    for _, partition, key, _ in trajectories:  # the partition the producer's own partitioner gives the key
        assert partition == DefaultPartitioner()(key, [0, 1, 2, 3], [0, 1, 2, 3])
    batches = {b["task_id"]: b for b in (CODEC.decode(v, expect="TrainingBatch") for *_, v in producer.to("r.batches"))}
    # Roots at 1000.003 s (+ grace 2 s) close on the next tick of the 0.5 s grid: 1002.5 s; t1's group is
    # then full. t2's has one attempt: it times out group_timeout_s (30 s) after its first trajectory.
    assert batches["t1"]["created_ns"] == 1_002_500_000_000 and batches["t1"]["complete"]
    assert batches["t2"]["created_ns"] == 1_032_500_000_000 and not batches["t2"]["complete"]
    assert {s["sample_id"] for b in batches.values() for s in b["samples"]} == {"t1:0:0", "t1:1:0", "t2:0:0"}
    (letter,) = [CODEC.decode(v, expect="DeadLetter") for *_, v in producer.to("r.dlq")]
    assert (letter["topic"], letter["offset"], letter["component"]) == (LIVE, 12, "replay")
    assert letter["timestamp_ns"] == 1_000_012_000_000  # the event time of its step, not the wall clock
    counters = engine.counters()
    assert (counters["spans"], counters["rollouts"], counters["trajectories"], counters["groups"],
            counters["batches"], counters["samples"], counters["dead_letters"]) == (13, 3, 3, 2, 2, 3, 1)
    assert not engine.rollouts.open and not engine.groups.open


async def test_the_same_records_give_byte_identical_output_however_they_are_stepped() -> None:
    first, _ = await replay(list(steps(records(), 0.5)))
    again, _ = await replay(list(steps(records(), 0.5)))
    one_by_one, _ = await replay([[r] for r in records()])
    assert first.sent == again.sent == one_by_one.sent


async def test_a_gap_in_event_time_fires_the_timer_before_later_records() -> None:
    """A trace held for its reward is emitted when the hold ends, before a span stamped later arrives."""
    ids = {"rollout_id": None, "attempt_id": None, "task_id": None}
    root = span("c0", name="agent", parent=None, start=0, end=100, **ids)  # the trace's local root
    calls = [{**llm_span(f"c{i}", [1] * i, [2], start=10 * i, end=10 * i + 5, parent="c0"), **ids} for i in (1, 2)]

    def stamped(at_ms: list[int]) -> list[Record]:
        return [Record(LIVE, 0, i, None, CODEC.encode("Span", s, topic=LIVE), T0_MS + ms)
                for i, (s, ms) in enumerate(zip([calls[0], root, calls[1]], at_ms, strict=True))]

    # The root at 1000.001 s is due after grace (1002 s), then held 5 s for a reward (to 1007 s).
    for second_call_ms, turns, late in ((4_000, 2, 0), (60_000, 1, 1)):
        producer, engine = await replay([[r] for r in stamped([0, 1, second_call_ms])], reward_timeout_s=5.0)
        (trajectory,) = [CODEC.decode(v, expect="Trajectory") for *_, v in producer.to("r.trajectories")]
        assert len(trajectory["turns"]) == turns, second_call_ms  # at 1060 s it is late, as it would be live
        assert engine.rollouts.stats["late"] == late and engine.rollouts.stats["held_for_reward"] == 1


def test_next_deadline_is_the_due_time_else_the_expiry() -> None:
    async def go() -> None:
        producer = RecordingProducer()
        engine = ReplayEngine(config(rollout_timeout_s=30.0), LIVE, [0], OutputProducer(producer, "r.trajectories",
                                                                                        range(4), {}), CODEC)
        stage = engine.rollouts
        first = [r for r in records()[:3]]  # r1 without its root: waits for the parent, rollout_timeout_s
        await stage.on_batch(first, 1000.0)
        assert stage.next_deadline() == pytest.approx(1030.0)
        await stage.on_batch(records()[3:4], 1001.0)  # the root: due after grace
        assert stage.next_deadline() == pytest.approx(1003.0)

    asyncio.run(go())
