"""boltstream.streams.spans: attribute access, classification, agent names."""

from __future__ import annotations

import json

import pytest

from boltstream.schemas import Codec
from boltstream.streams.spans import (
    attr,
    attributes,
    has_token_ids,
    inherited_agent_names,
    is_llm_span,
    is_reward_span,
    is_rollout_root,
    is_tool_span,
    own_agent_name,
    reward_of,
    span_flags,
    span_ids,
)
from tests.unit.streams.factory import llm_span, reward_span, root_span, span, tool_span


def test_factory_spans_are_valid_span_records() -> None:
    codec = Codec()
    for record in (
        root_span(),
        llm_span("l1", [1, 2], [3], start=1, end=2),
        tool_span("t", start=1, end=2, error=True, message="boom", arguments="{"),
        reward_span("w", 0.5, at=3),
        span("x", attrs={"a": [1, 2], "b": ["x"], "c": [0.5], "d": [True]}),
    ):
        assert codec.decode(codec.encode("Span", record), expect="Span")["span_id"] == record["span_id"]


def test_attr_unwraps_arrays_and_defaults() -> None:
    s = span("x", attrs={"ids": [1, 2], "names": ["a", "b"], "f": [0.5, 1.5], "flags": [True], "n": 3, "z": None})
    assert attr(s, "ids") == [1, 2]
    assert attr(s, "names") == ["a", "b"]
    assert attr(s, "f") == [0.5, 1.5]
    assert attr(s, "flags") == [True]
    assert attr(s, "n") == 3
    assert attr(s, "z", "dflt") == "dflt"
    assert attr(s, "missing") is None
    assert attributes(s)["ids"] == [1, 2]


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"gen_ai.operation.name": "chat"}, True),
        ({"gen_ai.operation.name": "text_completion"}, True),
        ({"openinference.span.kind": "LLM"}, True),
        ({"openinference.span.kind": "llm"}, True),
        ({"llm.request.type": "chat"}, True),
        ({"boltstream.span.kind": "llm"}, True),
        ({"gen_ai.operation.name": "execute_tool"}, False),
        ({"gen_ai.system": "autogen"}, False),
        ({}, False),
    ],
)
def test_is_llm_span_by_attributes(attrs: dict, expected: bool) -> None:
    assert is_llm_span(span("x", attrs=attrs)) is expected


def test_llm_block_makes_an_llm_span_and_token_ids_are_separate() -> None:
    with_ids = llm_span("l", [1], [2], start=0, end=1)
    assert is_llm_span(with_ids) and has_token_ids(with_ids)
    empty = span("e", llm={**with_ids["llm"], "response_token_ids": []})
    assert is_llm_span(empty) and not has_token_ids(empty)
    assert not has_token_ids(span("n", attrs={"gen_ai.operation.name": "chat"}))


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"gen_ai.operation.name": "execute_tool"}, True),
        ({"openinference.span.kind": "TOOL"}, True),
        ({"traceloop.span.kind": "tool"}, True),
        ({"boltstream.span.kind": "tool"}, True),
        ({"openinference.span.kind": "AGENT"}, False),
        ({"gen_ai.operation.name": "chat", "gen_ai.tool.name": "x"}, False),
    ],
)
def test_is_tool_span(attrs: dict, expected: bool) -> None:
    assert is_tool_span(span("x", attrs=attrs)) is expected


def test_span_flags_agree_with_the_single_predicates() -> None:
    samples = [
        llm_span("l", [1], [2], start=0, end=1), tool_span("t", start=0, end=1, error=True),
        reward_span("w", 1.0, at=0), root_span(), span("x"), span("e", attrs={"openinference.span.kind": "TOOL"}),
        span("b", attrs={"gen_ai.operation.name": " chat", "traceloop.span.kind": "TOOL"}),
        span("r", name="x", attrs={"boltstream.span.kind": "reward", "gen_ai.operation.name": "execute_tool"}),
    ]
    for s in samples:
        assert tuple(span_flags(s)) == (is_llm_span(s), is_tool_span(s), is_reward_span(s)), s["span_id"]


def test_reward_and_root_classification() -> None:
    assert is_reward_span(reward_span("w", 1.0, at=0))
    assert is_reward_span(span("agl", name="agentlightning.annotation", attrs={"boltstream.span.kind": "reward"}))
    assert not is_reward_span(span("x"))
    assert is_rollout_root(root_span())
    assert not is_rollout_root(span("x"))


def test_reward_of_reads_name_value_flags() -> None:
    info = reward_of(reward_span("w", 0.25, at=7, name="accuracy", final=True, primary=True))
    assert (info.name, info.value, info.final, info.primary, info.span_id, info.time_ns) == (
        "accuracy", 0.25, True, True, "w", 7,
    )
    assert reward_of(span("x")) is None
    bad = span("b", name="boltstream.reward", attrs={"boltstream.reward.value": "high"})
    assert reward_of(bad) is None


def test_reward_primary_without_final_flag_is_final() -> None:
    agl = span(
        "agl",
        name="agentlightning.annotation",
        attrs={"boltstream.span.kind": "reward", "boltstream.reward.value": 1.0, "boltstream.reward.primary": True},
    )
    assert reward_of(agl).final is True
    plain = span("p", name="boltstream.reward", attrs={"boltstream.reward.value": 1})
    info = reward_of(plain)
    assert (info.final, info.value, info.name) == (False, 1.0, "reward")


def test_span_ids_prefer_boltstream_attributes_then_promoted_fields() -> None:
    assert span_ids(root_span(rollout_id="R", attempt_id="A", task_id="T")) == ("R", "A", "T")
    assert span_ids(span("x", rollout_id="r9", attempt_id=None, task_id="t9")) == ("r9", None, "t9")


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"boltstream.agent_name": "ours", "gen_ai.agent.name": "genai"}, "ours"),
        ({"gen_ai.agent.name": "writer", "agent.name": "oi"}, "writer"),
        ({"agent.name": "oi-agent"}, "oi-agent"),
        ({"openinference.span.kind": "AGENT", "graph.node.id": "Triage Agent"}, "Triage Agent"),
        ({"openinference.span.kind": "CHAIN", "graph.node.id": "not-an-agent"}, None),
        ({"recipient_agent_type": "coder_abc", "messaging.operation": "process"}, "coder_abc"),
        ({"recipient_agent_type": "coder_abc"}, "coder_abc"),
        ({"recipient_agent_type": "coder_abc", "messaging.operation": "publish"}, None),
        ({"metadata": json.dumps({"langgraph_node": "researcher", "thread_id": "1"})}, "researcher"),
        ({"metadata": json.dumps({"langgraph_node": "model", "lc_agent_name": "researcher"})}, "researcher"),
        ({"metadata": "{not json lang"}, None),
        ({"langsmith.metadata.langgraph_node": "planner"}, "planner"),
        ({"traceloop.association.properties.langgraph_node": "critic"}, "critic"),
        ({"langgraph.node": "summarise"}, "summarise"),
        ({"gen_ai.agent.name": "  "}, None),
        ({}, None),
    ],
)
def test_own_agent_name(attrs: dict, expected: str | None) -> None:
    assert own_agent_name(span("x", attrs=attrs)) == expected


def test_agent_name_inherited_from_nearest_named_ancestor() -> None:
    spans = {
        "root": span("root", parent=None, attrs={"gen_ai.agent.name": "team"}),
        "a": span("a", parent="root", attrs={"gen_ai.agent.name": "coder"}),
        "a1": span("a1", parent="a"),
        "a11": span("a11", parent="a1"),
        "b": span("b", parent="root"),
        "o": span("o", parent="virtual-root"),
    }
    parent_of = {"root": None, "a": "root", "a1": "a", "a11": "a1", "b": "root", "o": "virtual-root"}
    names = inherited_agent_names(spans, parent_of)
    assert names == {"root": "team", "a": "coder", "a1": "coder", "a11": "coder", "b": "team", "o": None}
