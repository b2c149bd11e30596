"""GenAI evaluation results read as rewards: hand-built spans, values checked by hand."""

from __future__ import annotations

from typing import Any

import pytest

from boltstream.streams.assembly import InvalidRollout, assemble_trajectory, assemble_trajectory_with_stats
from boltstream.streams.evaluations import evaluation_rewards, evaluations_of
from tests.unit.streams.factory import llm_span, reward_span, root_span, span


def result(name: str | None, score: Any, at: int, **extra: Any) -> dict[str, Any]:
    """A ``gen_ai.evaluation.result`` event."""
    attrs = {"gen_ai.evaluation.score.value": score, **extra}
    if name is not None:
        attrs["gen_ai.evaluation.name"] = name
    return {"name": "gen_ai.evaluation.result", "time_ns": at, "attributes": attrs}


def rollout(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    call1 = llm_span("c1", [1, 2], [3], start=10, end=20, attrs={"gen_ai.response.id": "chatcmpl-1"})
    call2 = llm_span("c2", [1, 2, 3, 4], [5], start=30, end=40, attrs={"gen_ai.response.id": "chatcmpl-2"})
    return [root_span(start=0, end=100), call1, call2, *extra]


def test_an_event_on_a_call_is_an_intermediate_reward_on_that_call() -> None:
    spans = rollout()
    spans[1]["events"] = [result("Relevance", 4.0, 25), result(None, 0.5, 26)]
    trajectory, stats = assemble_trajectory_with_stats(spans)
    assert trajectory["turns"][0]["rewards"] == [
        {"name": "Relevance", "value": 4.0, "source": "evaluation:c1#0"},
        {"name": "evaluation", "value": 0.5, "source": "evaluation:c1#1"},
    ]
    assert trajectory["turns"][1]["rewards"] == []
    assert trajectory["final_reward"] is None and stats.evaluation_rewards == 2


def test_a_result_naming_the_response_id_lands_on_that_call() -> None:
    # the agent's own span for call 2 (no token ids) carries the evaluator's result naming the response id
    agent_side = span("agent", start=29, end=41, events=[result("correct", 1, 45, **{"gen_ai.response.id": "chatcmpl-2"})])
    trajectory = assemble_trajectory(rollout(agent_side))
    assert trajectory["turns"][1]["rewards"] == [{"name": "correct", "value": 1.0, "source": "evaluation:agent#0"}]
    assert trajectory["final_reward"] is None


def test_a_result_on_the_rollout_is_its_final_reward_the_earliest_when_several() -> None:
    root = root_span(start=0, end=100)
    root["events"] = [result("helpfulness", 0.75, 95)]
    judge = span("judge", name="gen_ai.evaluation.result", parent="root", start=90, end=90,
                 attrs={"gen_ai.evaluation.name": "judge", "gen_ai.evaluation.score.value": 0.25})
    trajectory = assemble_trajectory([root, *rollout()[1:], judge])
    assert trajectory["rewards"] == [
        {"name": "judge", "value": 0.25, "source": "evaluation:judge"},
        {"name": "helpfulness", "value": 0.75, "source": "evaluation:root#0"},
    ]
    assert trajectory["final_reward"] == 0.25
    assert all(t["rewards"] == [] for t in trajectory["turns"])


def test_an_evaluation_span_parented_to_a_call_evaluates_that_call() -> None:
    judge = span("judge", name="gen_ai.evaluation.result", parent="c2", start=50, end=50,
                 attrs={"gen_ai.evaluation.name": "judge", "gen_ai.evaluation.score.value": -1})
    trajectory = assemble_trajectory(rollout(judge))
    assert trajectory["turns"][1]["rewards"] == [{"name": "judge", "value": -1.0, "source": "evaluation:judge"}]


def test_a_primary_reward_such_as_feedback_overrides_an_evaluation() -> None:
    root = root_span(start=0, end=100)
    root["events"] = [result("helpfulness", 0.75, 95)]
    trajectory = assemble_trajectory([root, *rollout()[1:], reward_span("fb", 1.0, at=50, final=True, primary=True)])
    assert trajectory["final_reward"] == 1.0
    assert [r["value"] for r in trajectory["rewards"]] == [1.0, 0.75]


def test_labels_failed_evaluations_and_other_events_are_not_rewards() -> None:
    s = span("x", events=[
        result("tone", "friendly", 1),                                    # a label, no number
        result("tone", None, 2, **{"gen_ai.evaluation.score.label": "pass"}),
        result("tone", 1.0, 3, **{"error.type": "TimeoutError"}),          # the evaluation itself failed
        result("tone", True, 4),                                          # a bool is not a score
        {"name": "exception", "time_ns": 5, "attributes": {"gen_ai.evaluation.score.value": 1.0}},
    ])
    assert evaluations_of(s) == []
    assert evaluation_rewards([s], []) == ({}, [])


def test_a_non_finite_score_refuses_the_rollout_like_any_reward() -> None:
    spans = rollout()
    spans[0]["events"] = [result("judge", float("nan"), 95)]
    with pytest.raises(InvalidRollout, match="nan"):
        assemble_trajectory(spans)


def test_the_result_does_not_depend_on_arrival_order() -> None:
    spans = rollout()
    spans[1]["events"] = [result("a", 1.0, 27)]
    spans[2]["events"] = [result("b", 2.0, 45)]
    spans[0]["events"] = [result("c", 3.0, 99)]
    assert assemble_trajectory(spans) == assemble_trajectory(list(reversed(spans)))
