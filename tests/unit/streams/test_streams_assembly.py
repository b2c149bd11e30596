"""boltstream.streams.assembly: spans of one attempt -> Trajectory."""

from __future__ import annotations

from array import array

import pytest

from boltstream.schemas import Codec
from boltstream.streams import (
    VIRTUAL_ROOT_ID,
    AssemblyConfig,
    AssemblyError,
    assemble_trajectory,
    assemble_trajectory_with_stats,
    build_span_tree,
)
from tests.unit.streams.factory import agent_span, llm_span, reward_span, root_span, span, tool_span

NO_AIR = AssemblyConfig(air_rules=())


def _basic() -> list[dict]:
    return [
        llm_span("l2", [1, 2, 3, 4, 5], [6], start=300, end=400, logprobs=[-0.3]),
        root_span(),
        llm_span("l1", [1, 2], [3, 4], start=100, end=200, logprobs=[-0.1, -0.2], temperature=0.7),
        reward_span("fin", 1.0, at=900, final=True, primary=True),
    ]


def test_basic_trajectory_orders_calls_and_reads_root() -> None:
    traj = assemble_trajectory(_basic(), NO_AIR)
    assert traj["rollout_id"] == "r1"
    assert traj["attempt_id"] == "t1:0"
    assert traj["task_id"] == "t1"
    assert [t["span_id"] for t in traj["turns"]] == ["l1", "l2"]
    assert [t["call_index"] for t in traj["turns"]] == [0, 1]
    first = traj["turns"][0]
    assert first["prompt_token_ids"] == array("i", [1, 2])  # arrays, as decoded spans hold them
    assert first["response_token_ids"] == array("i", [3, 4])
    assert first["response_logprobs"] == array("f", [-0.1, -0.2])
    assert first["policy_version"] == 3
    assert first["model"] == "m"
    assert first["start_time_ns"] == 100
    assert first["rewards"] == []
    assert first["temperature"] == 0.7  # the span's llm.temperature, as recorded
    assert traj["turns"][1]["temperature"] is None  # not recorded stays unknown (the learner scores at 1)
    assert traj["final_reward"] == 1.0
    assert traj["rewards"] == [{"name": "reward", "value": 1.0, "source": "fin"}]
    assert traj["status"] == "ok"
    assert traj["error"] is None
    assert (traj["start_time_ns"], traj["end_time_ns"]) == (0, 1000)
    assert traj["span_count"] == 4
    assert traj["dropped_calls"] == []


def test_trajectory_is_a_valid_avro_record() -> None:
    spans = _basic() + [span("x", attrs={"gen_ai.operation.name": "chat"}, start=500, end=600)]
    traj = assemble_trajectory(spans)
    codec = Codec()
    decoded = codec.decode(codec.encode("Trajectory", traj), expect="Trajectory")
    for got, want in zip(decoded["turns"], traj["turns"], strict=True):  # logprobs are Avro floats (32 bit)
        assert got.pop("response_logprobs") == pytest.approx(want["response_logprobs"], abs=1e-6)
    assert decoded["turns"] == [{k: v for k, v in t.items() if k != "response_logprobs"} for t in traj["turns"]]
    assert {k: v for k, v in decoded.items() if k != "turns"} == {k: v for k, v in traj.items() if k != "turns"}
    assert traj["dropped_calls"] == [{"span_id": "x", "reason": "no llm block: token ids not recorded"}]


def test_duplicate_spans_kept_once() -> None:
    spans = _basic()
    traj, stats = assemble_trajectory_with_stats(spans + [dict(spans[0]), dict(spans[2]), dict(spans[1])], NO_AIR)
    assert [t["span_id"] for t in traj["turns"]] == ["l1", "l2"]
    assert traj["span_count"] == 4
    assert stats.duplicate_spans == 3


def test_duplicate_responses_same_ids_same_start_kept_once() -> None:
    spans = [
        root_span(),
        llm_span("a", [1, 2], [3], start=100, end=200),
        llm_span("b", [1, 2], [3], start=100, end=210),  # same call recorded twice
        llm_span("c", [1, 2], [3], start=300, end=400),  # same tokens, later: a real second call
    ]
    traj, stats = assemble_trajectory_with_stats(spans, NO_AIR)
    assert [t["span_id"] for t in traj["turns"]] == ["a", "c"]
    assert stats.duplicate_responses == 1


def test_missing_parent_and_multiple_roots_get_a_virtual_root() -> None:
    spans = [
        span("a", parent=None, start=0, end=100),
        span("b", parent="ghost", start=10, end=50),
        span("c", parent="a", start=20, end=30),
    ]
    tree = build_span_tree(spans)
    assert tree.root_id == VIRTUAL_ROOT_ID
    assert tree.parent_of == {"a": VIRTUAL_ROOT_ID, "b": VIRTUAL_ROOT_ID, "c": "a"}
    assert tree.children(VIRTUAL_ROOT_ID) == ["a", "b"]
    assert tree.ancestors("c") == ["a", VIRTUAL_ROOT_ID]


def test_single_root_with_missing_outer_parent_is_the_root() -> None:
    spans = [span("root", parent="runner-span", start=0, end=100), span("c", parent="root", start=1, end=2)]
    tree = build_span_tree(spans)
    assert tree.root_id == "root"
    assert tree.parent_of == {"root": None, "c": "root"}


def test_parent_cycle_is_cut() -> None:
    tree = build_span_tree([span("a", parent="b"), span("b", parent="a")])
    assert tree.root_id in {"a", "b"}
    assert sorted(tree.parent_of.values(), key=str) == sorted([None, tree.root_id], key=str)


def test_floating_llm_span_reparented_by_time_containment() -> None:
    spans = [
        root_span(),
        agent_span("coder", "coder", start=100, end=400),
        agent_span("rev", "reviewer", start=500, end=900),
        span("rev-step", parent="rev", start=550, end=800),
        llm_span("f1", [1], [2], start=150, end=300, parent=None),  # inside coder only
        llm_span("f2", [5], [6], start=600, end=700, parent="lost"),  # inside rev and rev-step
    ]
    tree = build_span_tree(spans)
    assert tree.root_id == "root"
    assert tree.parent_of["f1"] == "coder"
    assert tree.parent_of["f2"] == "rev-step"  # the tightest container
    assert sorted(tree.reparented) == ["f1", "f2"]
    traj = assemble_trajectory(spans, NO_AIR)
    assert [(t["span_id"], t["agent_name"]) for t in traj["turns"]] == [("f1", "coder"), ("f2", "reviewer")]
    only_rev = assemble_trajectory(spans, AssemblyConfig(agent_match="^reviewer$", air_rules=()))
    assert [t["span_id"] for t in only_rev["turns"]] == ["f2"]


def test_floating_llm_span_outside_every_span_goes_under_the_only_root() -> None:
    spans = [root_span(start=0, end=100), llm_span("late", [1], [2], start=150, end=160, parent=None)]
    tree = build_span_tree(spans)
    assert tree.root_id == "root"
    assert tree.parent_of["late"] == "root"


def test_reparenting_can_be_switched_off() -> None:
    spans = [root_span(), llm_span("f", [1], [2], start=10, end=20, parent=None)]
    tree = build_span_tree(spans, reparent_floating_llm=False)
    assert tree.root_id == VIRTUAL_ROOT_ID
    assert tree.parent_of["f"] == VIRTUAL_ROOT_ID


def test_agent_match_keeps_only_matching_agents_and_renumbers() -> None:
    spans = [
        root_span(),
        agent_span("c", "coder", start=100, end=300),
        agent_span("r", "reviewer", start=400, end=600),
        llm_span("c1", [1], [2], start=110, end=150, parent="c"),
        llm_span("r1", [3], [4], start=410, end=450, parent="r"),
        llm_span("c2", [5], [6], start=200, end=250, parent="c"),
        llm_span("anon", [7], [8], start=700, end=750),  # no agent name anywhere above it
    ]
    traj, stats = assemble_trajectory_with_stats(spans, AssemblyConfig(agent_match="cod", air_rules=()))
    assert [(t["call_index"], t["span_id"], t["agent_name"]) for t in traj["turns"]] == [
        (0, "c1", "coder"),
        (1, "c2", "coder"),
    ]
    assert stats.filtered_by_agent == 2
    assert traj["dropped_calls"] == []
    everything = assemble_trajectory(spans, NO_AIR)
    assert [t["span_id"] for t in everything["turns"]] == ["c1", "c2", "r1", "anon"]
    assert everything["turns"][3]["agent_name"] is None


def test_calls_without_token_ids_are_reported_not_guessed() -> None:
    base = llm_span("x", [1], [2], start=0, end=1)["llm"]
    spans = [
        root_span(),
        span("noblock", attrs={"gen_ai.operation.name": "chat"}, start=100, end=200),
        span("noprompt", llm={**base, "prompt_token_ids": []}, start=210, end=220),
        span("noresp", llm={**base, "response_token_ids": [], "response_logprobs": []}, start=230, end=240),
        span("nolp", llm={**base, "response_logprobs": []}, start=250, end=260),
        span("badlp", llm={**base, "response_logprobs": [-0.1, -0.2]}, start=270, end=280),
        llm_span("ok", [1], [2], start=300, end=310),
    ]
    traj = assemble_trajectory(spans, NO_AIR)
    assert [t["span_id"] for t in traj["turns"]] == ["ok"]
    assert traj["turns"][0]["call_index"] == 0
    assert traj["dropped_calls"] == [
        {"span_id": "noblock", "reason": "no llm block: token ids not recorded"},
        {"span_id": "noprompt", "reason": "empty prompt_token_ids"},
        {"span_id": "noresp", "reason": "empty response_token_ids"},
        {"span_id": "nolp", "reason": "no response_logprobs"},
        {"span_id": "badlp", "reason": "response_logprobs length 2 != response tokens 1"},
    ]
    lenient = assemble_trajectory(spans, AssemblyConfig(air_rules=(), require_logprobs=False))
    assert [t["span_id"] for t in lenient["turns"]] == ["nolp", "ok"]
    assert lenient["turns"][0]["response_logprobs"] == array("f")


def test_dropped_calls_only_for_wanted_agents() -> None:
    spans = [
        root_span(),
        agent_span("r", "reviewer", start=100, end=300),
        span("noblock", parent="r", attrs={"gen_ai.operation.name": "chat"}, start=110, end=120),
    ]
    traj = assemble_trajectory(spans, AssemblyConfig(agent_match="coder", air_rules=()))
    assert traj["dropped_calls"] == []


def test_client_wrapper_llm_span_is_not_a_second_call() -> None:
    spans = [
        root_span(),
        span("client", attrs={"openinference.span.kind": "LLM"}, start=100, end=300),
        llm_span("worker", [1], [2], start=120, end=280, parent=None),  # floating, inside the client span
    ]
    traj, stats = assemble_trajectory_with_stats(spans, NO_AIR)
    assert [t["span_id"] for t in traj["turns"]] == ["worker"]
    assert traj["dropped_calls"] == []
    assert stats.wrapper_spans == 1


def test_status_and_error_from_root() -> None:
    failed = assemble_trajectory(
        [root_span(status="failed", error="ValueError: x", code="ERROR"), llm_span("l", [1], [2], start=1, end=2)]
    )
    assert (failed["status"], failed["error"], failed["final_reward"]) == ("failed", "ValueError: x", None)
    errored = root_span(status=None, code="ERROR")
    errored["status"]["message"] = "boom"
    assert assemble_trajectory([errored])["status"] == "failed"
    assert assemble_trajectory([errored])["error"] == "boom"
    assert assemble_trajectory([root_span(status="timeout")])["status"] == "timeout"


def test_no_root_span_means_abandoned_with_span_timings() -> None:
    spans = [llm_span("l", [1], [2], start=50, end=70), span("s", parent="l", start=40, end=90)]
    traj = assemble_trajectory(spans, NO_AIR)
    assert traj["status"] == "abandoned"
    assert (traj["start_time_ns"], traj["end_time_ns"]) == (40, 90)
    assert (traj["rollout_id"], traj["attempt_id"], traj["task_id"]) == ("r1", "t1:0", "t1")
    explicit = assemble_trajectory(spans, NO_AIR, status="timeout", error="closed by timeout")
    assert (explicit["status"], explicit["error"]) == ("timeout", "closed by timeout")


def test_primary_final_reward_selected_among_dimensions() -> None:
    spans = [
        root_span(),
        reward_span("f1", 0.2, at=800, name="style", final=True),
        reward_span("f2", 0.9, at=810, name="accuracy", final=True, primary=True),
        reward_span("i1", 0.1, at=500, name="progress"),
    ]
    traj = assemble_trajectory(spans, NO_AIR)
    assert traj["final_reward"] == 0.9
    assert traj["rewards"] == [
        {"name": "style", "value": 0.2, "source": "f1"},
        {"name": "accuracy", "value": 0.9, "source": "f2"},
    ]
    no_primary = assemble_trajectory([root_span(), reward_span("f1", 0.4, at=800, final=True)], NO_AIR)
    assert no_primary["final_reward"] == 0.4


def test_intermediate_reward_span_attaches_to_latest_call_before_it() -> None:
    spans = _basic() + [reward_span("i", 0.5, at=250, name="progress"), reward_span("j", -1.0, at=450)]
    traj = assemble_trajectory(spans)  # default AIR rules
    assert traj["turns"][0]["rewards"] == [{"name": "progress", "value": 0.5, "source": "emitted_reward:i"}]
    assert traj["turns"][1]["rewards"] == [{"name": "reward", "value": -1.0, "source": "emitted_reward:j"}]


def test_air_reward_caused_by_an_untrained_call_is_not_moved() -> None:
    spans = [
        root_span(),
        agent_span("c", "coder", start=100, end=300),
        agent_span("r", "reviewer", start=400, end=600),
        llm_span("c1", [1], [2], start=110, end=150, parent="c"),
        llm_span("r1", [3], [4], start=410, end=450, parent="r"),
        tool_span("t", start=460, end=470, parent="r", error=True),  # caused by the reviewer's call
    ]
    traj, stats = assemble_trajectory_with_stats(spans, AssemblyConfig(agent_match="coder"))
    assert traj["turns"][0]["rewards"] == []
    assert stats.air_rewards == 0


def test_ids_explicit_and_attempt_filter() -> None:
    spans = _basic() + [llm_span("other", [9], [9], start=150, end=160, attempt_id="t1:1")]
    traj = assemble_trajectory(spans, NO_AIR, attempt_id="t1:0")
    assert [t["span_id"] for t in traj["turns"]] == ["l1", "l2"]
    relabelled = assemble_trajectory(_basic(), NO_AIR, rollout_id="R", task_id="T")
    assert (relabelled["rollout_id"], relabelled["task_id"], relabelled["attempt_id"]) == ("R", "T", "t1:0")


def test_ids_fall_back_to_promoted_fields_and_attempt_to_rollout() -> None:
    spans = [llm_span("l", [1], [2], start=1, end=2, attempt_id=None)]
    traj = assemble_trajectory(spans, NO_AIR)
    assert (traj["rollout_id"], traj["attempt_id"], traj["task_id"]) == ("r1", "r1", "t1")


def test_rollout_without_task_id_is_valid_with_an_empty_task() -> None:
    traj = assemble_trajectory([span("x", task_id=None, attempt_id=None)])
    assert (traj["rollout_id"], traj["attempt_id"], traj["task_id"]) == ("r1", "r1", "")


def test_assembly_errors() -> None:
    with pytest.raises(AssemblyError, match="no spans"):
        assemble_trajectory([])
    with pytest.raises(AssemblyError, match="rollout_id"):
        assemble_trajectory([span("x", rollout_id=None)])
    with pytest.raises(AssemblyError, match="span_id"):
        assemble_trajectory([span("")])


def _in_trace(trace: str, s: dict) -> dict:
    return {**s, "trace_id": trace * 32}


def test_a_rerun_attempt_leaves_out_the_dead_runs_calls() -> None:
    """Runner SIGKILLed mid-attempt, the attempt re-run with the same ids: the dead run's calls (answered
    by the worker, in the dead run's trace, before the re-run's root) are not this run's."""
    dead = [_in_trace("a", llm_span("d1", [1], [2], start=100, end=200, parent="x")),
            _in_trace("a", llm_span("d2", [1, 2, 3], [4], start=300, end=400, parent="x"))]
    rerun = [_in_trace("b", root_span(start=1000, end=2000)),
             _in_trace("b", llm_span("n1", [1], [5], start=1100, end=1200)),
             _in_trace("b", reward_span("fin", 1.0, at=1900, final=True, primary=True))]
    traj, stats = assemble_trajectory_with_stats([*dead, *rerun], NO_AIR)
    assert [t["span_id"] for t in traj["turns"]] == ["n1"]
    assert [t["call_index"] for t in traj["turns"]] == [0]
    assert stats.other_run_spans == 2 and traj["final_reward"] == 1.0


def test_of_two_runs_with_roots_the_first_is_the_rollout() -> None:
    """The dead run got its root out (spooled) before it died; the re-run's spans come after it."""
    first = [_in_trace("a", root_span(start=0, end=1000)), _in_trace("a", llm_span("a1", [1], [2], start=100, end=200)),
             _in_trace("a", reward_span("ra", 0.0, at=900, final=True, primary=True))]
    second = [_in_trace("b", root_span("root2", start=3000, end=4000)),
              _in_trace("b", llm_span("b1", [1], [3], start=3100, end=3200, parent="root2")),
              _in_trace("b", reward_span("rb", 1.0, at=3900, final=True, primary=True))]
    traj, stats = assemble_trajectory_with_stats([*second, *first], NO_AIR)
    assert [t["span_id"] for t in traj["turns"]] == ["a1"]
    assert traj["final_reward"] == 0.0 and stats.other_run_spans == 3


def test_spans_of_another_trace_inside_the_root_and_late_spans_of_its_trace_are_kept() -> None:
    """A worker span without traceparent (its own trace) inside the rollout's time is this run's; a
    timed-out run's late span in the root's trace too; and nothing is split without a root."""
    spans = [_in_trace("a", root_span(start=0, end=1000)),
             _in_trace("c", llm_span("w1", [1], [2], start=100, end=200, parent=None)),
             _in_trace("a", llm_span("late", [1, 2, 3], [4], start=1500, end=1600))]
    traj, stats = assemble_trajectory_with_stats(spans, NO_AIR)
    assert [t["span_id"] for t in traj["turns"]] == ["w1", "late"] and stats.other_run_spans == 0
    rootless = [_in_trace("a", llm_span("x1", [1], [2], start=100, end=200)),
                _in_trace("b", llm_span("x2", [1], [3], start=5000, end=5100))]
    traj, stats = assemble_trajectory_with_stats(rootless, NO_AIR)
    assert len(traj["turns"]) == 2 and stats.other_run_spans == 0


def test_delayed_feedback_in_a_trace_of_its_own_after_the_run_is_kept() -> None:
    """``boltstream feedback`` sends its reward span in a new trace, after the rollout ended: not another run."""
    late = reward_span("fb", 1.0, at=5000, final=True, primary=True, parent=None)
    late = _in_trace("f", {**late, "attributes": {**late["attributes"], "boltstream.feedback": True}})
    spans = [_in_trace("a", root_span(start=0, end=1000)),
             _in_trace("a", llm_span("a1", [1], [2], start=100, end=200)), late]
    traj, stats = assemble_trajectory_with_stats(spans, NO_AIR)
    assert traj["final_reward"] == 1.0 and stats.other_run_spans == 0
