"""What closes a rollout no runner manages, the hold for a late reward, and task-less groups (stages, no broker)."""

from __future__ import annotations

from typing import Any

import pytest

from boltstream.streams.baselines import prompt_fingerprint
from boltstream.streams.stages import GroupStage, RolloutStage
from tests.unit.streams.factory import TRACE, llm_span, reward_span, span
from tests.unit.streams.test_app_stages import CODEC, Msg, feed, make, settle

NO_IDS = {"rollout_id": None, "attempt_id": None, "task_id": None}


def trace_spans() -> list[dict[str, Any]]:
    """A plain agent's trace: the worker's call (joined by traceparent) and the agent's root span, no ids."""
    return [llm_span("w1", [1, 2], [3], start=10, end=20, parent="a0", **NO_IDS),
            span("a0", name="chat", parent=None, start=0, end=30, **NO_IDS)]


def trajectories(stage: Any) -> list[dict[str, Any]]:
    return [CODEC.decode(s[2], expect="Trajectory") for s in stage.app.producer.to("u.trajectories")]


def staged(knobs: dict[str, Any]) -> Any:
    stage, app = make(RolloutStage, **knobs)
    stage.app = app
    return stage


async def test_a_trace_closes_when_its_local_root_ends_and_is_keyed_by_its_trace_id() -> None:
    stage = staged({"reward_timeout_s": 0})
    await feed(stage, trace_spans()[:1])
    assert not trajectories(stage), "the worker's span alone never closes a trace"
    await feed(stage, trace_spans()[1:])
    await settle()
    (traj,) = trajectories(stage)
    assert (traj["rollout_id"], traj["task_id"], traj["status"]) == (TRACE, "", "ok")
    assert [t["span_id"] for t in traj["turns"]] == ["w1"]
    assert stage.app.producer.to("u.trajectories")[0][1] == f"prompt:{prompt_fingerprint(traj)}".encode()


async def test_the_workers_span_without_traceparent_never_closes_a_trace() -> None:
    stage = staged({"reward_timeout_s": 0})
    floating = {**trace_spans()[0], "parent_span_id": None}
    await feed(stage, [floating])
    await settle()
    assert not trajectories(stage) and stage.open


async def test_a_feedback_arriving_first_never_closes_the_trace_it_rewards() -> None:
    """Feedback has no parent, and may reach the log before the trace's own spans (another process)."""
    stage = staged({"reward_timeout_s": 0})
    feedback = reward_span("f1", 1.0, at=40, final=True, parent=None)
    feedback.update(NO_IDS, attributes={**feedback["attributes"], "boltstream.feedback": True})
    await feed(stage, [feedback])
    await settle()
    assert not trajectories(stage) and stage.open
    await feed(stage, trace_spans())
    await settle()
    (traj,) = trajectories(stage)
    assert (traj["final_reward"], [t["span_id"] for t in traj["turns"]]) == (1.0, ["w1"])


async def test_env_ids_without_a_runner_close_after_session_idle_s_as_ok() -> None:
    stage = staged({"session_idle_s": 5, "reward_timeout_s": 0})
    ids = {"rollout_id": "ro-env", "attempt_id": "q7:0", "task_id": "q7"}
    await feed(stage, [{**s, **ids} for s in trace_spans()], now=1000.0)  # two complete traces of one rollout
    second = [{**s, **ids, "trace_id": "e" * 32, "span_id": "2" + s["span_id"],
               "start_time_ns": s["start_time_ns"] + 100, "end_time_ns": s["end_time_ns"] + 100,
               "parent_span_id": s["parent_span_id"] and "2" + s["parent_span_id"]} for s in trace_spans()]
    await feed(stage, second, now=1001.0)
    await stage.tick(1005.9)
    assert not trajectories(stage)
    await stage.tick(1006.0)
    (traj,) = trajectories(stage)
    assert (traj["rollout_id"], traj["task_id"], traj["status"], len(traj["turns"])) == ("ro-env", "q7", "ok", 2)


async def test_env_ids_close_grace_s_after_the_processs_end_marker() -> None:
    """The exporter of a process that was one rollout sends ``boltstream.rollout.end`` at exit: the rollout
    closes ``grace_s`` later, not after ``session_idle_s``; the marker is one more span of it."""
    stage = staged({"session_idle_s": 60, "grace_s": 3, "reward_timeout_s": 0})
    ids = {"rollout_id": "ro-env", "attempt_id": "q7:0", "task_id": "q7"}
    await feed(stage, [{**s, **ids} for s in trace_spans()], now=1000.0)
    end = span("end", name="boltstream.rollout.end", parent=None, start=40, end=40, **ids)
    await feed(stage, [{**end, "trace_id": "f" * 32}], now=1001.0)
    await stage.tick(1003.9)
    assert not trajectories(stage)
    await stage.tick(1004.0)
    (traj,) = trajectories(stage)
    assert (traj["rollout_id"], traj["status"], traj["span_count"]) == ("ro-env", "ok", 3)
    assert [t["span_id"] for t in traj["turns"]] == ["w1"]


async def test_an_ended_rollout_without_a_reward_is_still_held_for_one() -> None:
    stage = staged({"session_idle_s": 60, "grace_s": 0, "reward_timeout_s": 30})
    ids = {"rollout_id": "ro-env", "attempt_id": "q7:0", "task_id": "q7"}
    end = span("end", name="boltstream.rollout.end", parent=None, start=40, end=40, **ids)
    await feed(stage, [{**s, **ids} for s in trace_spans()] + [{**end, "trace_id": "f" * 32}], now=1000.0)
    await settle()
    assert not trajectories(stage) and stage.stats["held_for_reward"] == 1
    late = {**reward_span("fb", 0.5, at=50, final=True, primary=True, parent=None), **ids}
    late["attributes"] = {**late["attributes"], "boltstream.feedback": True}
    await feed(stage, [late], now=1005.0)
    await settle()
    (traj,) = trajectories(stage)
    assert traj["final_reward"] == 0.5


async def test_without_a_reward_it_is_held_and_a_late_reward_closes_it_at_once() -> None:
    stage = staged({"reward_timeout_s": 30})
    await feed(stage, trace_spans(), now=1000.0)
    await settle()
    assert not trajectories(stage) and stage.stats["held_for_reward"] == 1
    late = {**reward_span("fb", 0.75, at=40, final=True, primary=True, parent="a0"), **NO_IDS}
    await feed(stage, [late], now=1010.0)
    await settle()
    (traj,) = trajectories(stage)
    assert traj["final_reward"] == 0.75


async def test_the_hold_ends_after_reward_timeout_s_and_emits_what_it_has() -> None:
    stage = staged({"reward_timeout_s": 30})
    await feed(stage, trace_spans(), now=1000.0)
    await stage.tick(1029.9)
    assert not trajectories(stage)
    await stage.tick(1030.0)
    (traj,) = trajectories(stage)
    assert traj["final_reward"] is None and traj["status"] == "ok"  # the group stage applies failure_reward


async def test_a_session_closes_after_session_idle_s_without_a_new_span() -> None:
    stage = staged({"session_idle_s": 5, "reward_timeout_s": 0})
    session = [{**s, "attributes": {**s["attributes"], "session.id": "conv-7"}} for s in trace_spans()]
    await feed(stage, session, now=1000.0)  # its local root does not close a session: more traces may come
    await stage.tick(1004.9)
    assert not trajectories(stage)
    await stage.tick(1005.0)
    (traj,) = trajectories(stage)
    assert (traj["rollout_id"], traj["status"]) == ("conv-7", "ok")


async def test_a_runner_rollout_is_never_held() -> None:
    stage = staged({"reward_timeout_s": 30})
    ids = {"rollout_id": "r1", "attempt_id": "t1:0", "task_id": "t1"}
    await feed(stage, [llm_span("w1", [1], [2], start=1, end=2, **ids),
                       span("root", name="boltstream.rollout", parent=None, start=0, end=3, **ids)])
    await settle()
    assert len(trajectories(stage)) == 1 and stage.stats["held_for_reward"] == 0


def taskless(attempt: str, reward: float, prompt: list[int], agent: str = "a") -> bytes:
    turn = {"call_index": 0, "span_id": attempt, "prompt_token_ids": prompt, "response_token_ids": [2],
            "response_logprobs": [-0.1], "agent_name": agent}
    record = {"rollout_id": attempt, "attempt_id": attempt, "task_id": "", "turns": [turn], "final_reward": reward}
    return CODEC.encode("Trajectory", record, topic="u.trajectories")


def batches(app: Any) -> list[dict[str, Any]]:
    return [CODEC.decode(s[2], expect="TrainingBatch") for s in app.producer.to("u.batches")]


async def test_taskless_trajectories_with_the_same_first_prompt_form_a_group() -> None:
    stage, app = make(GroupStage, group_size=2)
    await stage.on_record(Msg(taskless("x", 1.0, [5, 6])), 1.0)
    await stage.on_record(Msg(taskless("y", 0.0, [5, 6])), 1.0)
    await settle()
    (batch,) = batches(app)
    assert batch["complete"] and [s["advantage"] for s in batch["samples"]] == pytest.approx([0.5, -0.5])


async def test_a_lone_taskless_trajectory_gets_its_agents_running_mean() -> None:
    stage, app = make(GroupStage, group_size=2, prompt_window_s=10)
    for index, (reward, prompt) in enumerate([(1.0, [1]), (0.0, [2]), (0.5, [3])]):
        await stage.on_record(Msg(taskless(f"s{index}", reward, prompt)), 100.0 + index)
    await stage.tick(200.0)
    got = {b["samples"][0]["attempt_id"]: b for b in batches(app)}
    # in order: s0 has no history (advantage 0); s1 sees [1.0]: 0 - 1 = -1; s2 sees [1, 0]: 0.5 - 0.5 = 0
    assert [got[a]["samples"][0]["advantage"] for a in ("s0", "s1", "s2")] == pytest.approx([0.0, -1.0, 0.0])
    assert got["s2"]["reward_mean"] == pytest.approx(0.5) and all(b["complete"] for b in got.values())
    assert stage.stats["agent_baseline"] == 3


async def test_a_trace_without_an_llm_call_is_neither_held_nor_emitted() -> None:
    """An instrumented service's other traces (a health check) are no rollouts: no hold, no empty trajectory."""
    stage = staged({"reward_timeout_s": 60})
    health = span("h0", name="GET /health", parent=None, start=0, end=1, **NO_IDS)
    await feed(stage, [health], now=1000.0)
    await settle()
    assert not trajectories(stage) and not stage.open, "closed at once, not held 60 s for a reward"
    assert stage.stats["without_llm_calls"] == 1 and stage.stats["held_for_reward"] == 0
