"""boltstream.streams.baselines: prompt fingerprints and the per-agent running mean, computed by hand."""

from __future__ import annotations

import math

import pytest

from boltstream.streams.baselines import (
    AgentBaselines,
    agent_of,
    partition_key,
    prompt_fingerprint,
    window_baseline,
)


def traj(prompt: list[int] | None, task_id: str = "", agent: str | None = "a") -> dict:
    turns = [] if prompt is None else [{"prompt_token_ids": prompt, "agent_name": agent}]
    return {"task_id": task_id, "turns": turns}


def test_fingerprint_is_the_first_prompt_only() -> None:
    assert prompt_fingerprint(traj([1, 2])) == prompt_fingerprint({"turns": [{"prompt_token_ids": [1, 2]},
                                                                              {"prompt_token_ids": [9]}]})
    assert prompt_fingerprint(traj([1, 2])) != prompt_fingerprint(traj([12]))  # "1,2" vs "12": separators count
    assert prompt_fingerprint(traj(None)) is None
    assert len(prompt_fingerprint(traj([1])) or "") == 16


def test_partition_key_is_the_task_else_the_fingerprint() -> None:
    assert partition_key(traj([1], task_id="t7")) == "t7"
    assert partition_key(traj([1])) == "prompt:" + (prompt_fingerprint(traj([1])) or "")
    assert partition_key(traj(None)) == "prompt:"


def test_agent_of_first_turn() -> None:
    assert agent_of(traj([1], agent="writer")) == "writer"
    assert agent_of(traj([1], agent=None)) == "" and agent_of(traj(None)) == ""


def test_window_baseline_by_hand() -> None:
    assert window_baseline([], 0.7) == (0.7, 0.0)  # no history: advantage 0
    assert window_baseline([1.0], 0.0) == (1.0, 0.0)
    mean, std = window_baseline([1.0, 0.0, 0.5], 0.0)  # mean 0.5; sample var (0.25 + 0.25 + 0) / 2
    assert mean == pytest.approx(0.5) and std == pytest.approx(math.sqrt(0.25))


def test_agent_baselines_keep_a_bounded_window_per_agent() -> None:
    b = AgentBaselines(window=2)
    for value in (1.0, 0.0, 0.5):
        b.add("a", value)
    b.add("other", 10.0)
    assert b.baseline("a", 9.0) == pytest.approx((0.25, math.sqrt(0.125)))  # only [0.0, 0.5] remain
    assert b.baseline("new", 3.0) == (3.0, 0.0)
    with pytest.raises(ValueError, match="window"):
        AgentBaselines(0)
