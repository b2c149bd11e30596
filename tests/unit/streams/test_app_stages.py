"""The stream app's stages without a broker: idempotent adds, close ordering, timeouts, rebuild, DLQ.

A fake faust app stands in: its producer records every send and hands back
futures the test resolves, so the order "output acked -> marker -> item
tombstones" can be checked step by step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from boltstream.broker.dlq import DeadLetterWriter
from boltstream.config import Settings, load
from boltstream.errors import ConfigError
from boltstream.schemas import Codec
from boltstream.streams.config import StreamConfig
from boltstream.streams.stages import GroupStage, RolloutStage
from boltstream.streams.tables import ChangelogMap, make_key, pack_items, split_key, unpack_items
from tests.unit.streams.factory import llm_span, reward_span, root_span, tool_span

CODEC = Codec()


class FakeProducer:
    def __init__(self, auto_ack: bool = True) -> None:
        self.auto_ack = auto_ack
        self.ack_topics: set[str] = set()  # acked at once even without auto_ack
        self.refuse: Callable[[str, bytes | None], Exception | None] = lambda topic, value: None
        self.sent: list[tuple[str, bytes | None, bytes | None, int | None, asyncio.Future[Any]]] = []

    async def send(self, topic: str, key: Any, value: Any, partition: Any, ts: Any, headers: Any) -> Any:
        refused = self.refuse(topic, value)
        if refused is not None:  # like aiokafka's local MessageSizeTooLargeError: raised, nothing sent
            raise refused
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.auto_ack or topic in self.ack_topics:
            fut.set_result(None)
        self.sent.append((topic, key, value, partition, fut))
        return fut

    def to(self, topic: str) -> list[tuple[Any, ...]]:
        return [s for s in self.sent if s[0] == topic]


class FakeTable:
    def __init__(self, name: str) -> None:
        self.data: dict[bytes, bytes] = {}
        self.changelog_topic = type("T", (), {"get_topic_name": staticmethod(lambda: f"app-{name}-changelog")})()


class FakeApp:
    def __init__(self, auto_ack: bool = True) -> None:
        self.producer = FakeProducer(auto_ack)

    def Table(self, name: str, **kwargs: Any) -> FakeTable:
        return FakeTable(name)


class Msg:
    def __init__(self, value: bytes, partition: int = 0, offset: int = 0, key: bytes | None = b"k", topic: str = "u.spans"):
        self.value, self.partition, self.offset, self.key, self.topic = value, partition, offset, key, topic


def make(stage_cls: type, auto_ack: bool = True, **knobs: Any) -> tuple[Any, FakeApp]:
    app = FakeApp(auto_ack)
    # Closing at the root (grace 0) unless a test says otherwise: the default grace is for outages.
    config = load(StreamConfig, {"settings": Settings(namespace="u."), "grace_s": 0.0, **knobs}, env={})
    items = ChangelogMap(app, f"{stage_cls.kind}-items", "", 4)
    markers = ChangelogMap(app, f"{stage_cls.kind}-markers", "", 4)
    dlq = DeadLetterWriter(config.settings, CODEC, "stream",
                           send=lambda topic, key, value: app.producer.send(topic, key, value, None, None, None))
    stage = stage_cls(app, items, markers, config, CODEC, dlq)
    stage.ready = True
    return stage, app


def rollout_spans(rollout_id: str = "r1", attempt_id: str = "t1:0", with_root: bool = True) -> list[dict[str, Any]]:
    ids = {"rollout_id": rollout_id, "attempt_id": attempt_id, "task_id": "t1"}
    spans = [
        llm_span("a1", [1, 2], [3, 4], start=10, end=20, **ids),
        tool_span("tl", start=25, end=30, error=True, **ids),
        llm_span("a2", [1, 2, 3, 4, 9], [5], start=40, end=50, **ids),
        {**reward_span("rw", 1.0, at=60, final=True, primary=True), **ids},
    ]
    if with_root:
        spans.append(root_span(start=0, end=100, **ids))
    return spans


def enc(span: dict[str, Any]) -> bytes:
    return CODEC.encode("Span", span, topic="u.spans")


async def feed(stage: RolloutStage, spans: list[dict[str, Any]], now: float = 1000.0, partition: int = 0) -> None:
    for offset, span in enumerate(spans):
        await stage.on_record(Msg(enc(span), partition, offset), now)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_root_closes_rollout_once_and_replays_are_skipped() -> None:
    stage, app = make(RolloutStage)
    await feed(stage, rollout_spans())
    await settle()
    out = app.producer.to("u.trajectories")
    assert len(out) == 1 and out[0][1] == b"t1"
    trajectory = CODEC.decode(out[0][2], expect="Trajectory")
    assert [t["call_index"] for t in trajectory["turns"]] == [0, 1]
    assert trajectory["turns"][0]["rewards"][0]["value"] == pytest.approx(-0.1)  # AIR on the failed tool
    assert make_key(0, "r1") in stage.markers and not stage.open
    assert not list(stage.items.keys_for([0])), "items are deleted once the marker is acked"
    await feed(stage, rollout_spans())  # at-least-once replay after a crash
    await settle()
    assert len(app.producer.to("u.trajectories")) == 1
    assert stage.stats["late"] == 5


async def test_duplicate_span_is_stored_once() -> None:
    stage, app = make(RolloutStage)
    spans = rollout_spans(with_root=False)
    await feed(stage, spans + spans[:2])
    assert stage.stats["duplicate"] == 2
    assert len(app.producer.to("app-rollout-items-changelog")) == len(spans)


async def test_marker_waits_for_output_ack_and_items_wait_for_marker_ack() -> None:
    stage, app = make(RolloutStage, auto_ack=False)
    app.producer.ack_topics.add("app-rollout-items-changelog")  # the stage waits for its items' acks
    await feed(stage, rollout_spans())
    await settle()
    markers = "app-rollout-markers-changelog"
    assert len(app.producer.to("u.trajectories")) == 1 and not app.producer.to(markers)
    for sent in app.producer.sent:
        if not sent[4].done():
            sent[4].set_result(None)  # acks for the items and the trajectory only
    await settle()
    assert len(app.producer.to(markers)) == 1
    tombstones = [s for s in app.producer.to("app-rollout-items-changelog") if s[2] is None]
    assert not tombstones, "no item is deleted before its marker is durable"
    app.producer.to(markers)[0][4].set_result(None)
    await settle()
    tombstones = [s for s in app.producer.to("app-rollout-items-changelog") if s[2] is None]
    assert len(tombstones) == 5 and all(s[3] == 0 for s in tombstones)


async def test_rollout_without_root_is_closed_abandoned_after_the_timeout() -> None:
    stage, app = make(RolloutStage, rollout_timeout_s=30)
    await feed(stage, rollout_spans(with_root=False), now=1000.0)
    await stage.tick(1029.0)
    assert not app.producer.to("u.trajectories")
    await stage.tick(1030.0)
    trajectory = CODEC.decode(app.producer.to("u.trajectories")[0][2], expect="Trajectory")
    assert trajectory["status"] == "abandoned" and "no root span" in trajectory["error"]
    assert stage.stats["timed_out"] == 1


async def test_grace_period_defers_the_close() -> None:
    stage, app = make(RolloutStage, grace_s=2.0)
    await feed(stage, rollout_spans(), now=1000.0)
    assert not app.producer.to("u.trajectories")
    await stage.tick(1001.9)
    assert not app.producer.to("u.trajectories")
    await stage.tick(1002.0)
    assert len(app.producer.to("u.trajectories")) == 1


async def test_rebuild_restores_open_rollouts_and_finishes_interrupted_cleanups() -> None:
    stage, app = make(RolloutStage)
    store = stage.items.store
    for span in rollout_spans("r-open"):
        store[make_key(1, "r-open", span["span_id"])] = enc(span)
    store[make_key(1, "r-done", "a1")] = enc(rollout_spans("r-done")[0])
    stage.markers.store[make_key(1, "r-done")] = b'{"closed_at": 5}'
    store[make_key(3, "r-foreign", "a1")] = enc(rollout_spans("r-foreign")[0])
    stage.ready = False
    await stage.rebuild({0, 1}, now=2000.0)
    assert set(stage.open) == {(1, "r-open")} and stage.open[(1, "r-open")].due == 2000.0
    assert make_key(1, "r-done", "a1") not in store and make_key(3, "r-foreign", "a1") not in store
    assert [split_key(s[1]) for s in app.producer.to("app-rollout-items-changelog")] == [(1, ["r-done", "a1"])]
    await stage.tick(2000.0)
    assert len(app.producer.to("u.trajectories")) == 1


async def test_poison_records_are_dead_lettered_with_their_origin() -> None:
    stage, app = make(RolloutStage)
    await stage.on_record(Msg(b"junk", 2, 17, b"key"), 1.0)
    await stage.on_record(Msg(enc({**rollout_spans()[0], "rollout_id": None, "trace_id": ""}), 3, 4), 1.0)
    letters = [CODEC.decode(s[2], expect="DeadLetter") for s in app.producer.to("u.dlq")]
    assert [(x["partition"], x["offset"], x["topic"]) for x in letters] == [(2, 17, "u.spans"), (3, 4, "u.spans")]
    assert letters[0]["value"] == b"junk" and letters[0]["key"] == b"key"
    assert "no rollout id, session id or trace id" in letters[1]["reason"]
    assert stage.dlq.counts == {"undecodable": 1, "no_rollout_id": 1}


def trajectory_bytes(attempt: int, reward: float, run_id: str | None = None) -> bytes:
    turn = {"call_index": 0, "span_id": "s", "prompt_token_ids": [1], "response_token_ids": [2],
            "response_logprobs": [-0.1]}
    attempt_id = f"t1:{attempt}" if run_id is None else f"{run_id}/t1:{attempt}"
    record = {"rollout_id": f"r{run_id}{attempt}", "attempt_id": attempt_id, "task_id": "t1", "turns": [turn],
              "final_reward": reward}
    return CODEC.encode("Trajectory", record, topic="u.trajectories")


async def test_group_emits_when_full_and_ignores_replays_and_late_attempts() -> None:
    stage, app = make(GroupStage, group_size=2)
    await stage.on_record(Msg(trajectory_bytes(0, 1.0)), 1.0)
    await stage.on_record(Msg(trajectory_bytes(0, 1.0)), 1.0)
    assert not app.producer.to("u.batches") and stage.stats["duplicate"] == 1
    await stage.on_record(Msg(trajectory_bytes(1, 0.0)), 1.0)
    await settle()
    batch = CODEC.decode(app.producer.to("u.batches")[0][2], expect="TrainingBatch")
    # returns 1 and 0: advantage = return - group mean (no std division by default)
    assert batch["complete"] and [s["advantage"] for s in batch["samples"]] == pytest.approx([0.5, -0.5])
    await stage.on_record(Msg(trajectory_bytes(2, 0.5)), 1.0)
    assert len(app.producer.to("u.batches")) == 1 and stage.stats["late"] == 1


async def test_a_second_run_over_the_same_task_forms_its_own_group() -> None:
    stage, app = make(GroupStage, group_size=2)
    for run_id in ("p1", "p2"):  # boltstream runner --run-id p1, then --run-id p2 over the same tasks
        await stage.on_record(Msg(trajectory_bytes(0, 1.0, run_id)), 1.0)
        await stage.on_record(Msg(trajectory_bytes(1, 0.0, run_id)), 1.0)
    await settle()
    sent = app.producer.to("u.batches")
    batches = [CODEC.decode(s[2], expect="TrainingBatch") for s in sent]
    assert stage.stats["late"] == 0 and [s[1] for s in sent] == [b"t1", b"t1"]
    assert [b["task_id"] for b in batches] == ["t1", "t1"] and all(b["complete"] for b in batches)
    assert [sorted(s["attempt_id"] for s in b["samples"]) for b in batches] == [["p1/t1:0", "p1/t1:1"],
                                                                             ["p2/t1:0", "p2/t1:1"]]
    assert batches[0]["batch_id"] != batches[1]["batch_id"]


async def test_group_timeout_emits_an_incomplete_group() -> None:
    stage, app = make(GroupStage, group_size=4, group_timeout_s=10)
    await stage.on_record(Msg(trajectory_bytes(0, 1.0)), 100.0)
    await stage.tick(109.0)
    assert not app.producer.to("u.batches")
    await stage.tick(110.0)
    batch = CODEC.decode(app.producer.to("u.batches")[0][2], expect="TrainingBatch")
    assert not batch["complete"] and batch["num_rollouts"] == 1 and batch["group_size"] == 4


@pytest.mark.parametrize(
    "knobs",
    [{"group_size": 0}, {"grace_s": -1}, {"rollout_timeout_s": 0}, {"loss_weight": "x"}, {"agent_match": "("},
     {"gamma": 2.0}, {"store": "redis://"}, {"air_rules_file": "/no/such/file.yaml"}],
)
def test_stream_config_rejects_bad_values(knobs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        load(StreamConfig, knobs, env={})


def test_stream_config_from_env() -> None:
    from boltstream.streams.config import load_stream_config

    env = {"BOLTSTREAM_STREAM_GROUP_SIZE": "8", "BOLTSTREAM_STREAM_GRACE_S": "0.5", "BOLTSTREAM_NAMESPACE": "n.",
           "BOLTSTREAM_STATE_FILE": "/nonexistent/stack.json"}
    config = load_stream_config({"app_id": "a1"}, env=env)
    assert (config.group_size, config.grace_s, config.app_name) == (8, 0.5, "a1")
    assert load_stream_config(env=env).app_name == "n.stream"
    assert config.batch_bytes == config.settings.max_message_bytes - 16_384


async def test_a_batch_writes_one_chunk_per_rollout_and_deletes_it_once() -> None:
    stage, app = make(RolloutStage)
    a, b = rollout_spans("ra", "t1:0"), rollout_spans("rb", "t1:1")
    interleaved = [span for pair in zip(a, b, strict=True) for span in pair]
    await stage.on_batch([Msg(enc(span), 0, offset) for offset, span in enumerate(interleaved)], 1000.0)
    await settle()
    assert len(app.producer.to("u.trajectories")) == 2 and not stage.open
    items = app.producer.to("app-rollout-items-changelog")
    writes, tombstones = [s for s in items if s[2] is not None], [s for s in items if s[2] is None]
    assert [split_key(s[1]) for s in writes] == [(0, ["ra", "@0"]), (0, ["rb", "@1"])]
    assert [len(unpack_items(s[2])) for s in writes] == [5, 5]
    assert sorted(s[1] for s in tombstones) == sorted(s[1] for s in writes)


async def test_rebuild_splits_a_chunk_back_into_its_items() -> None:
    stage, app = make(RolloutStage)
    spans = rollout_spans("r-chunk")
    stage.items.store[make_key(2, "r-chunk", "@40")] = pack_items([enc(span) for span in spans[:3]])
    stage.items.store[make_key(2, "r-chunk", "@90")] = pack_items([enc(span) for span in spans[2:]])  # overlaps
    stage.ready = False
    await stage.rebuild({2}, now=50.0)
    entry = stage.open[(2, "r-chunk")]
    assert set(entry.items) == {s["span_id"] for s in spans} and len(entry.chunks) == 2
    await stage.tick(50.0)
    await settle()
    trajectory = CODEC.decode(app.producer.to("u.trajectories")[0][2], expect="Trajectory")
    assert [t["call_index"] for t in trajectory["turns"]] == [0, 1]
    tombstones = [s[1] for s in app.producer.to("app-rollout-items-changelog") if s[2] is None]
    assert sorted(tombstones) == [make_key(2, "r-chunk", "@40"), make_key(2, "r-chunk", "@90")]
    assert not stage.items.store


def test_pack_items_round_trips_and_reads_a_single_record_as_one_item() -> None:
    raws = [b"\xc3\x01abc", b"", b"\x00\x00\x00\x00\x01xyz"]
    assert unpack_items(pack_items(raws)) == raws
    assert unpack_items(b"\xc3\x01single") == [b"\xc3\x01single"]
