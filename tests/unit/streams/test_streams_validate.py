"""Poison values a rollout must not carry into training (streams/validate.py), hand-built cases."""

from __future__ import annotations

import math
from typing import Any

import pytest

from boltstream.streams.assembly import InvalidRollout, assemble_trajectory
from boltstream.streams.validate import logprob_problem, span_problems, summarise, trajectory_problems
from tests.unit.streams.factory import llm_span, reward_span, root_span

NAN, INF = float("nan"), float("inf")


def spans(final: float = 1.0, step: float = -0.5, logprobs: list[float] | None = None,
          call: tuple[int, int] = (10, 20), root: tuple[int, int] = (0, 100)) -> list[dict[str, Any]]:
    ids = {"rollout_id": "r1", "attempt_id": "t1:0", "task_id": "t1"}
    return [
        root_span(start=root[0], end=root[1]),
        llm_span("a1", [1, 2], [3, 4], start=call[0], end=call[1], logprobs=logprobs or [-0.5, 0.0], **ids),
        reward_span("st", step, at=25),  # intermediate: AIR's reward_span rule attaches it to a1
        reward_span("rw", final, at=60, final=True, primary=True),
    ]


def test_a_clean_rollout_passes_and_zero_logprobs_are_allowed() -> None:
    trajectory = assemble_trajectory(spans())
    assert trajectory["final_reward"] == 1.0 and trajectory["turns"][0]["response_logprobs"].tolist() == [-0.5, 0.0]
    assert trajectory["turns"][0]["rewards"][0]["value"] == -0.5
    assert trajectory_problems(trajectory) == [] and span_problems(spans()) == []


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"final": NAN}, "span rw: reward 'reward' is nan"),
        ({"final": -INF}, "span rw: reward 'reward' is -inf"),
        ({"step": NAN}, "span st: reward 'reward' is nan"),
        ({"logprobs": [-0.1, NAN]}, "turn 0 (span a1): response_logprobs[1] = nan (must be finite and <= 0)"),
        ({"logprobs": [-INF, -0.1]}, "response_logprobs[0] = -inf"),
        ({"logprobs": [-0.1, 1e-9]}, "response_logprobs[1] = 9.99999971718"),  # as float32, as recorded
        ({"call": (30, 20)}, "span a1: ends before it starts (start 30, end 20)"),
        ({"call": (-5, 20)}, "span a1: negative time (start -5, end 20)"),
        ({"root": (100, 0)}, "span root: ends before it starts (start 100, end 0)"),
    ],
)
def test_a_poisoned_rollout_is_rejected_with_the_reason(kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidRollout, match="rollout r1: ") as info:
        assemble_trajectory(spans(**kwargs))
    assert reason in str(info.value)


def test_trajectory_problems_name_every_bad_value() -> None:
    turn = {"call_index": 2, "span_id": "s", "response_logprobs": [-1.0, 0.5],
            "rewards": [{"name": "air", "value": INF, "source": "x"}]}
    trajectory = {"final_reward": NAN, "rewards": [{"name": "judge", "value": NAN, "source": "j"}],
                  "turns": [turn], "start_time_ns": 5, "end_time_ns": 4}
    assert trajectory_problems(trajectory) == [
        "final_reward is nan",
        "final reward 'judge' from j is nan",
        "turn 2 (span s): reward 'air' is inf",
        "turn 2 (span s): response_logprobs[1] = 0.5 (must be finite and <= 0)",
        "rollout times start 5, end 4 (must be >= 0, end >= start)",
    ]
    assert trajectory_problems({"final_reward": None, "turns": []}) == []


def test_logprob_problem_and_summary() -> None:
    assert logprob_problem([]) is None and logprob_problem([0.0, -math.pi, -1e30]) is None
    assert logprob_problem([-1.0, float("nan")]) == "response_logprobs[1] = nan (must be finite and <= 0)"
    assert summarise([str(i) for i in range(7)]) == "0; 1; 2; 3; 4; and 2 more"
