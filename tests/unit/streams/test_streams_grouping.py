"""boltstream.streams.grouping: TrainingBatch parts, stats, size budget."""

from __future__ import annotations

import logging
import math

import pytest

from boltstream.schemas import Codec
from boltstream.streams import (
    CreditConfig,
    batch_id_for,
    build_training_batches,
    estimate_batch_overhead,
    estimate_sample_bytes,
    group_key,
    split_samples,
)
from tests.unit.streams.factory import trajectory, turn


def _big_trajectory(attempt: str, calls: int, final: float = 1.0) -> dict:
    # each call: 45 prompt + 5 response tokens = 50 tokens
    return trajectory(attempt, [turn(i, list(range(45)), [1, 2, 3, 4, 5]) for i in range(calls)], final_reward=final)


def test_estimate_sample_bytes_by_hand() -> None:
    sample = {
        "sample_id": "a1:0",  # 5 + 4
        "rollout_id": "r1",  # 5 + 2
        "attempt_id": "a1",  # 5 + 2
        "task_id": "t1",  # 5 + 2
        "agent_name": None,  # 5
        "token_ids": list(range(10)),  # 10 tokens * 10 bytes
    }
    assert estimate_sample_bytes(sample) == 73 + 100 + 9 + 7 + 7 + 7 + 5  # = 208


def test_estimate_batch_overhead_by_hand() -> None:
    # 96 fixed + "b1" (5 + 2) + "t1" (5 + 2) + "r-a" (5 + 3) + "r-b" (5 + 3)
    assert estimate_batch_overhead("b1", "t1", ["r-a", "r-b"]) == 96 + 7 + 7 + 8 + 8


def test_single_part_batch_fields() -> None:
    group = [
        trajectory("a", [turn(0, [1], [2])], final_reward=1.0),
        trajectory("b", [turn(0, [1], [3]), turn(1, [4], [5])], final_reward=0.0),
        trajectory("c", [], final_reward=0.0, status="failed"),
    ]
    (batch,) = build_training_batches("t1", group, CreditConfig(), group_size=3, created_ns=42)
    assert batch["batch_id"] == batch_id_for("t1", ["a", "b", "c"])
    assert (batch["task_id"], batch["part"], batch["num_parts"]) == ("t1", 0, 1)
    assert [s["sample_id"] for s in batch["samples"]] == ["a:0", "b:0", "b:1"]
    assert (batch["group_size"], batch["num_rollouts"], batch["complete"], batch["created_ns"]) == (3, 3, True, 42)
    # episode returns 1, 0, 0: mean 1/3; squared deviations 4/9 + 1/9 + 1/9 = 6/9; sample var 6/9 / 2 = 1/3
    assert batch["reward_mean"] == pytest.approx(1 / 3)
    assert batch["reward_std"] == pytest.approx(math.sqrt(1 / 3))
    assert batch["rollout_ids"] == ["r-a", "r-b", "r-c"]
    decoded = Codec().decode(Codec().encode("TrainingBatch", batch), expect="TrainingBatch")
    assert [s["sample_id"] for s in decoded["samples"]] == ["a:0", "b:0", "b:1"]


def test_incomplete_group_and_explicit_complete() -> None:
    group = [trajectory("a", [turn(0, [1], [2])]), trajectory("b", [turn(0, [1], [2])])]
    assert build_training_batches("t1", group, group_size=4)[0]["complete"] is False
    assert build_training_batches("t1", group, group_size=2)[0]["complete"] is True
    assert build_training_batches("t1", group, group_size=2, complete=False)[0]["complete"] is False


def test_repeated_attempt_counts_once_and_batch_id_is_order_free() -> None:
    a, b = trajectory("a", [turn(0, [1], [2])]), trajectory("b", [turn(0, [1], [2])], final_reward=0.0)
    first = build_training_batches("t1", [a, b, a], group_size=2)
    second = build_training_batches("t1", [b, a], group_size=2)
    assert first[0]["num_rollouts"] == 2
    assert len(first[0]["samples"]) == 2
    assert first[0]["batch_id"] == second[0]["batch_id"]
    assert first[0]["batch_id"].startswith("t1:") and len(first[0]["batch_id"]) == len("t1:") + 16


def test_split_into_numbered_parts_under_the_budget() -> None:
    group = [_big_trajectory("a", 3)]
    # sample: 73 + 50 tokens * 10 + "a:i" 8 + "r-a" 8 + "a" 6 + "t1" 7 + None 5 = 607 bytes
    # overhead: 96 + "b1" 7 + "t1" 7 + ["r-a"] 8 = 118 -> budget for two samples: 118 + 2 * 607 = 1332
    parts = build_training_batches("t1", group, group_size=1, batch_id="b1", max_bytes=1332)
    assert [len(p["samples"]) for p in parts] == [2, 1]
    assert [(p["part"], p["num_parts"], p["batch_id"]) for p in parts] == [(0, 2, "b1"), (1, 2, "b1")]
    assert [s["sample_id"] for p in parts for s in p["samples"]] == ["a:0", "a:1", "a:2"]
    assert parts[0]["reward_mean"] == parts[1]["reward_mean"]
    codec = Codec()
    for part in parts:
        assert len(codec.encode("TrainingBatch", part)) <= 1332
    assert len(build_training_batches("t1", group, group_size=1, batch_id="b1", max_bytes=1331)) == 3


def test_oversized_sample_gets_its_own_part(caplog: pytest.LogCaptureFixture) -> None:
    small = {"sample_id": "s", "rollout_id": "r", "attempt_id": "a", "task_id": "t", "agent_name": None}
    samples = [
        {**small, "sample_id": "s0", "token_ids": [1] * 5},  # 73 + 50 + 7 + 6 + 6 + 6 + 5 = 153
        {**small, "sample_id": "big", "token_ids": [1] * 100},  # 73 + 1000 + 8 + 23 = 1104
        {**small, "sample_id": "s2", "token_ids": [1] * 5},  # 153
        {**small, "sample_id": "s3", "token_ids": [1] * 5},  # 153
    ]
    with caplog.at_level(logging.WARNING, logger="boltstream.streams.grouping"):
        parts = split_samples(samples, max_bytes=310)
    assert [[s["sample_id"] for s in p] for p in parts] == [["s0"], ["big"], ["s2", "s3"]]
    assert "big" in caplog.text


def test_split_edge_cases() -> None:
    assert split_samples([], max_bytes=100) == [[]]
    with pytest.raises(ValueError, match="max_bytes"):
        split_samples([], max_bytes=0)


def test_group_without_samples_still_emits_one_part() -> None:
    (batch,) = build_training_batches("t1", [trajectory("a", [], final_reward=None, status="failed")], group_size=1)
    assert batch["samples"] == [] and batch["num_parts"] == 1 and batch["reward_mean"] == 0.0


def test_grouping_errors() -> None:
    with pytest.raises(ValueError, match="no trajectories"):
        build_training_batches("t1", [], group_size=1)
    with pytest.raises(ValueError, match="belongs to task"):
        build_training_batches("t1", [trajectory("a", [], task_id="t2")], group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        build_training_batches("t1", [trajectory("a", [])], group_size=0)


@pytest.mark.parametrize(("task_id", "attempt_id", "key"), [
    ("q1", "q1:0", "q1"),  # no run id: the task, as before
    ("q1", "p2/q1:3", "p2/q1"),  # attempt_ids("q1", 3, run_id="p2")
    ("sql/q1", "sql/q1:0", "sql/q1"),  # a slash in the task id is not a run
    ("sql/q1", "p2/sql/q1:0", "p2/sql/q1"),
    ("a:b", "a:b:1", "a:b"),
    ("q1", "/q1:0", "q1"),  # an empty run id is no run id
    ("q1", "free-form-attempt", "q1"),  # an env-given attempt id of any shape
])
def test_group_key(task_id: str, attempt_id: str, key: str) -> None:
    assert group_key(task_id, attempt_id) == key
