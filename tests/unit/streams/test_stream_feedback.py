"""Delayed feedback in the rollout stage (fake broker): counted once, late ones and unknown rollouts dead-lettered."""

from __future__ import annotations

from typing import Any

from boltstream.producers.feedback import completion_id, feedback_span, parse_feedback
from boltstream.streams.stages import RolloutStage
from tests.unit.streams.test_app_stages import CODEC, enc, feed, make, rollout_spans, settle


def feedback(rollout_id: str, reward: float, at: int, key: str | None = None) -> dict[str, Any]:
    body = {"completion_id": completion_id("chatcmpl", rollout_id, "00000000000000a2"), "reward": reward}
    if key is not None:
        body["idempotency_key"] = key
    return feedback_span(parse_feedback(body), now_ns=at)


def _trajectories(app: Any) -> list[dict[str, Any]]:
    return [CODEC.decode(s[2], expect="Trajectory") for s in app.producer.to("u.trajectories")]


def _letters(app: Any) -> list[dict[str, Any]]:
    return [CODEC.decode(s[2], expect="DeadLetter") for s in app.producer.to("u.dlq")]


async def test_feedback_is_the_final_reward_and_the_same_feedback_twice_counts_once() -> None:
    stage, app = make(RolloutStage)
    spans = [s for s in rollout_spans() if s["name"] != "boltstream.reward"]  # no reward of its own
    first = feedback("r1", 0.25, at=70)
    again = feedback("r1", 0.25, at=80)  # sent again later: same idempotency key, same span id
    await feed(stage, [*spans[:-1], first, again, spans[-1]])
    await settle()
    (trajectory,) = _trajectories(app)
    assert trajectory["final_reward"] == 0.25
    assert [(r["name"], r["value"], r["source"]) for r in trajectory["rewards"]] == [
        ("reward", 0.25, first["span_id"])]
    assert stage.stats["duplicate"] == 1 and not _letters(app)


async def test_the_latest_feedback_wins_over_an_earlier_one() -> None:
    stage, app = make(RolloutStage)
    spans = [s for s in rollout_spans() if s["name"] != "boltstream.reward"]
    await feed(stage, [*spans[:-1], feedback("r1", 1.0, at=70, key="a"), feedback("r1", -1.0, at=90, key="b"),
                       spans[-1]])
    await settle()
    (trajectory,) = _trajectories(app)
    assert trajectory["final_reward"] == -1.0 and len(trajectory["rewards"]) == 2


async def test_feedback_after_the_rollout_was_trained_is_dead_lettered_with_the_reason() -> None:
    stage, app = make(RolloutStage)
    await feed(stage, rollout_spans())
    await settle()
    late = feedback("r1", 1.0, at=500)
    await feed(stage, [late])
    await settle()
    assert len(_trajectories(app)) == 1
    (letter,) = _letters(app)
    assert letter["reason"] == "feedback for rollout r1 arrived after it was trained: its reward 1.0 was not used"
    assert letter["value"] == enc(late) and letter["key"] == b"k"
    assert stage.dlq.counts["feedback_after_trained"] == 1
    assert stage.stats["late"] == 0  # not merely counted as a late span


async def test_feedback_for_a_rollout_that_never_shows_up_is_dead_lettered_when_it_expires() -> None:
    stage, app = make(RolloutStage, rollout_timeout_s=30)
    orphan = feedback("nobody", 1.0, at=10)
    await feed(stage, [orphan], now=1000.0)
    await stage.tick(1029.0)
    assert not _letters(app)
    await stage.tick(1030.0)
    await settle()
    (letter,) = _letters(app)
    assert letter["reason"].startswith("rollout nobody: unknown rollout: feedback arrived for it")
    assert letter["value"] == enc(orphan)
    assert not _trajectories(app) and stage.dlq.counts["feedback_unknown_rollout"] == 1
