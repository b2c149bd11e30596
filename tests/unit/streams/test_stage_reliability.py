"""Never ack what was not kept, never train on poison: the stages' side, without a broker.

The fake producer of test_app_stages refuses chosen writes the way aiokafka does
(``MessageSizeTooLargeError`` raised by ``send``) or fails their ack, so each
test shows what is dead-lettered, what is kept, and when ``on_batch`` returns.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from boltstream.config import Settings
from boltstream.schemas.records import RECORD_HEADROOM
from boltstream.streams.stages import GroupStage, RolloutStage
from boltstream.streams.tables import split_key, unpack_items
from tests.unit.streams.factory import llm_span
from tests.unit.streams.test_app_stages import CODEC, Msg, enc, make, rollout_spans, settle, trajectory_bytes

ITEMS = "app-rollout-items-changelog"
MAX = 20_000  # max_message_bytes of these tests: small records, quick tests


def letters(app: Any) -> list[dict[str, Any]]:
    return [CODEC.decode(s[2], expect="DeadLetter") for s in app.producer.to("u.dlq")]


def big_llm_span(span_id: str, tokens: int, rollout_id: str) -> dict[str, Any]:
    ids = {"rollout_id": rollout_id, "attempt_id": "t1:0", "task_id": "t1"}
    return llm_span(span_id, [1] * tokens, [2], start=1, end=2, **ids)


def batch(spans: list[dict[str, Any]], first_offset: int = 0) -> list[Msg]:
    return [Msg(enc(s), 0, first_offset + i, s["rollout_id"].encode()) for i, s in enumerate(spans)]


async def test_an_oversize_span_is_dead_lettered_whole_and_its_batch_neighbours_are_kept() -> None:
    stage, app = make(RolloutStage, settings=Settings(namespace="u.", max_message_bytes=MAX))
    huge = big_llm_span("huge", 4_500, "r-big")  # packed: 4 bytes per id
    assert MAX - RECORD_HEADROOM < len(enc(huge)) < MAX, "fits the broker but not the stream's state"
    others = rollout_spans("ra", "t1:0", with_root=False) + rollout_spans("rb", "t1:1", with_root=False)
    await stage.on_batch(batch([huge, *others]), 1.0)
    [letter] = letters(app)
    assert letter["value"] == enc(huge) and letter["offset"] == 0 and letter["key"] == b"r-big"
    assert "over the 15904-byte limit" in letter["reason"] and stage.dlq.counts == {"oversize": 1}
    chunks = [split_key(s[1])[1][0] for s in app.producer.to(ITEMS)]
    assert chunks == ["ra", "rb"] and set(stage.open) == {(0, "ra"), (0, "rb")}


async def test_items_that_do_not_fit_one_chunk_are_split_and_all_kept() -> None:
    stage, app = make(RolloutStage, settings=Settings(namespace="u.", max_message_bytes=MAX))
    spans = [big_llm_span(f"s{i}", 1_750, "r1") for i in range(4)]  # ~7 kB each, 28 kB together
    await stage.on_batch(batch(spans, 40), 1.0)
    writes = app.producer.to(ITEMS)
    assert [split_key(s[1])[1][1] for s in writes] == ["@40", "@42"]
    assert [len(unpack_items(s[2])) for s in writes] == [2, 2] and all(len(s[2]) < MAX for s in writes)
    assert not letters(app) and len(stage.open[(0, "r1")].items) == 4


async def test_a_refused_chunk_dead_letters_its_spans_and_the_rest_of_the_batch_is_saved() -> None:
    stage, app = make(RolloutStage)
    bad = rollout_spans("r-bad", "t1:0")
    good = rollout_spans("r-good", "t1:1", with_root=False)
    app.producer.refuse = lambda topic, value: (
        MessageSizeTooLargeError("too big") if topic == ITEMS and b"r-bad" in (value or b"") else None)
    await stage.on_batch(batch(bad + good), 1.0)  # r-bad first: the old save stopped at it
    await settle()
    dead = letters(app)
    assert sorted(x["value"] for x in dead) == sorted(map(enc, bad)), "every span of the refused chunk, whole"
    assert [x["offset"] for x in dead] == list(range(len(bad)))
    assert all("cannot keep it in the stream state: MessageSizeTooLargeError" in x["reason"] for x in dead)
    assert [split_key(s[1])[1][0] for s in app.producer.to(ITEMS)] == ["r-good"]
    assert set(stage.open) == {(0, "r-good")} and not app.producer.to("u.trajectories"), "r-bad is not emitted"
    assert stage.stats["not_kept"] == len(bad) and stage.dlq.counts == {"not_kept": len(bad)}


async def test_the_batch_is_not_done_before_its_chunks_are_acked_and_a_failed_ack_is_dead_lettered() -> None:
    stage, app = make(RolloutStage, auto_ack=False)
    app.producer.ack_topics.add("u.dlq")
    handling = asyncio.ensure_future(stage.on_batch(batch(rollout_spans("ra", "t1:0", with_root=False)
                                                          + rollout_spans("rb", "t1:1", with_root=False)), 1.0))
    await settle()
    first, second = app.producer.to(ITEMS)
    assert not handling.done(), "the batch must not count as processed before the broker has its state"
    first[4].set_result(None)
    second[4].set_exception(KafkaTimeoutError("gave up"))
    await asyncio.wait_for(handling, 5)
    dead = letters(app)
    assert len(dead) == 4 and all("KafkaTimeoutError" in x["reason"] for x in dead)
    assert {x["key"] for x in dead} == {b"rb"} and set(stage.open) == {(0, "ra")}
    assert split_key(second[1])[1][1] not in {k.decode() for k in stage.items.store}


async def test_a_trajectory_too_large_to_send_dead_letters_every_span_whole() -> None:
    stage, app = make(RolloutStage)
    app.producer.refuse = lambda topic, value: MessageSizeTooLargeError("trajectory") if topic == "u.trajectories" else None
    spans = rollout_spans()
    await stage.on_batch(batch(spans), 1.0)
    await settle()
    dead = letters(app)
    assert sorted(x["value"] for x in dead) == sorted(map(enc, spans))
    assert all("cannot send to u.trajectories: [Error 10] MessageSizeTooLargeError: trajectory" in x["reason"] for x in dead)


async def test_a_nan_final_reward_rejects_its_rollout_whole_not_its_group() -> None:
    stage, app = make(RolloutStage)
    spans = rollout_spans()
    spans[3]["attributes"]["boltstream.reward.value"] = math.nan
    await stage.on_batch(batch(spans), 1.0)
    await settle()
    dead = letters(app)
    assert not app.producer.to("u.trajectories") and len(dead) == len(spans)
    assert all("rejected: rollout r1: span rw: reward 'reward' is nan" in x["reason"] for x in dead)
    assert stage.dlq.counts == {"invalid_rollout": 1} and stage.stats["invalid"] == 1


async def test_a_poisoned_trajectory_is_dead_lettered_alone_and_its_group_trains_without_it() -> None:
    stage, app = make(GroupStage, group_size=4, group_timeout_s=10)
    poisoned = trajectory_bytes(3, math.nan)
    messages = [Msg(trajectory_bytes(a, r), 0, a) for a, r in enumerate([1.0, 0.0, 0.5])] + [Msg(poisoned, 0, 3)]
    await stage.on_batch(messages, 100.0)
    [letter] = letters(app)
    assert letter["value"] == poisoned and "trajectory t1:3 rejected: final_reward is nan" in letter["reason"]
    await stage.tick(110.0)  # the existing incomplete-group rule: closed at group_timeout_s
    out = CODEC.decode(app.producer.to("u.batches")[0][2], expect="TrainingBatch")
    assert not out["complete"] and out["num_rollouts"] == 3
    assert [s["advantage"] for s in out["samples"]] == [0.5, -0.5, 0.0]  # mean 0.5, all finite
