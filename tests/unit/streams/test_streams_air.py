"""boltstream.streams.air: rules, matchers, attachment, YAML."""

from __future__ import annotations

import pytest

from boltstream.streams import (
    DEFAULT_AIR_RULES,
    AirRule,
    AssemblyConfig,
    CallRef,
    air_rules_from_dicts,
    air_rules_from_yaml,
    assemble_trajectory,
    evaluate_air,
)
from tests.unit.streams.factory import llm_span, reward_span, root_span, span, tool_span

CALLS = [CallRef("c1", 200), CallRef("c2", 500)]


def _rewards(spans: list[dict], rules=DEFAULT_AIR_RULES, calls=CALLS, parent_of=None):
    return evaluate_air(spans, calls, rules, parent_of)


def test_failed_tool_penalises_the_call_before_it() -> None:
    result = _rewards([tool_span("t", start=250, end=300, error=True, message="ZeroDivisionError")])
    assert result.rewards_by_call == {"c1": [{"name": "tool_error", "value": -0.1, "source": "tool_error:t"}]}
    assert result.unattached == []


def test_successful_tool_gives_nothing() -> None:
    assert _rewards([tool_span("t", start=250, end=300)]).rewards_by_call == {}


def test_attachment_uses_end_at_or_before_start() -> None:
    at_boundary = _rewards([tool_span("t", start=500, end=510, error=True)])
    assert list(at_boundary.rewards_by_call) == ["c2"]
    overlapping = _rewards([tool_span("t", start=450, end=510, error=True)])  # c2 still running
    assert list(overlapping.rewards_by_call) == ["c1"]


def test_reward_before_any_call_is_unattached() -> None:
    result = _rewards([tool_span("t", start=50, end=60, error=True)])
    assert result.rewards_by_call == {}
    assert result.unattached == [{"name": "tool_error", "value": -0.1, "source": "tool_error:t"}]


def test_unparsable_tool_args_stop_the_tool_error_rule() -> None:
    result = _rewards([tool_span("t", start=250, end=300, error=True, arguments='{"x": 1')])
    assert result.rewards_by_call == {
        "c1": [{"name": "tool_args_invalid", "value": -0.2, "source": "tool_args_invalid:t"}]
    }


def test_valid_and_empty_args_are_fine() -> None:
    assert _rewards([tool_span("t", start=250, end=300, arguments='{"x": 1}')]).rewards_by_call == {}
    assert _rewards([tool_span("t", start=250, end=300, arguments="")]).rewards_by_call == {}


def test_openinference_tool_input_json() -> None:
    def oi_tool(span_id: str, value: str, mime: str = "application/json") -> dict:
        attrs = {"openinference.span.kind": "TOOL", "input.value": value, "input.mime_type": mime}
        return span(span_id, start=250, end=300, attrs=attrs)

    assert _rewards([oi_tool("bad", "{oops")]).rewards_by_call["c1"][0]["name"] == "tool_args_invalid"
    assert _rewards([oi_tool("good", '{"a": 2}')]).rewards_by_call == {}
    assert _rewards([oi_tool("text", "{oops", mime="text/plain")]).rewards_by_call == {}


def test_invalid_args_in_llm_output_penalise_that_call_once() -> None:
    key = "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments"
    client = span("cl", start=420, end=500, attrs={"openinference.span.kind": "LLM", key: "{broken"})
    tool = tool_span("t", start=510, end=520, arguments="{broken")
    result = _rewards([client, tool])
    assert result.rewards_by_call == {
        "c2": [{"name": "tool_args_invalid", "value": -0.2, "source": "tool_args_invalid:cl"}]
    }
    inputs_only = span("in", start=420, end=500, attrs={
        "openinference.span.kind": "LLM",
        "llm.input_messages.1.message.tool_calls.0.tool_call.function.arguments": "{old",
    })
    assert _rewards([inputs_only]).rewards_by_call == {}


@pytest.mark.parametrize(
    "timed_out",
    [
        tool_span("t", start=250, end=300, error=True, message="httpx.ReadTimeout: timed out"),
        tool_span("t", start=250, end=300, error=True, attrs={"error.type": "TimeoutError"}),
        tool_span("t", start=250, end=300, error=True, message="Deadline exceeded"),
        span("t", start=250, end=300, attrs={"http.response.status_code": 504}),
        span(
            "t",
            start=250,
            end=300,
            events=[{"name": "exception", "time_ns": 299, "attributes": {"exception.type": "asyncio.TimeoutError"}}],
        ),
    ],
)
def test_timeouts(timed_out: dict) -> None:
    result = _rewards([timed_out])
    assert result.rewards_by_call == {"c1": [{"name": "timeout", "value": -0.1, "source": "timeout:t"}]}


def test_nested_timeout_counted_once() -> None:
    outer = tool_span("t", start=250, end=300, error=True, message="Request timed out")
    inner = span("http", parent="t", start=255, end=299, status="ERROR", message="timed out")
    result = _rewards([inner, outer], parent_of={"t": "root", "http": "t"})
    assert result.rewards_by_call == {"c1": [{"name": "timeout", "value": -0.1, "source": "timeout:t"}]}
    without_tree = _rewards([inner, outer])
    assert [r["source"] for r in without_tree.rewards_by_call["c1"]] == ["timeout:t", "timeout:http"]


def test_root_and_llm_spans_are_not_timeouts() -> None:
    root = root_span(status="timeout", code="ERROR")
    root["status"]["message"] = "rollout timed out"
    llm = llm_span("c9", [1], [2], start=600, end=700)
    llm["status"] = {"code": "ERROR", "message": "timed out"}
    assert _rewards([root, llm]).rewards_by_call == {}


def test_emitted_intermediate_reward_keeps_its_name_and_value() -> None:
    result = _rewards([reward_span("w", 0.5, at=510, name="progress"), reward_span("f", 1.0, at=900, final=True)])
    assert result.rewards_by_call == {"c2": [{"name": "progress", "value": 0.5, "source": "emitted_reward:w"}]}


def test_reward_spans_only_match_reward_rule() -> None:
    errored = reward_span("w", 0.5, at=510)
    errored["status"] = {"code": "ERROR", "message": "timed out"}
    rules = (AirRule(name="err", when="span_error", value=-1.0), AirRule(name="to", when="timeout", value=-1.0))
    assert _rewards([errored], rules=rules).rewards_by_call == {}


def test_python_callable_rules_and_span_name_filter() -> None:
    def latency(s: dict) -> float | None:
        return -0.01 * (s["end_time_ns"] - s["start_time_ns"]) if s["name"].startswith("execute_tool") else None

    rules = (
        AirRule(name="slow", when=latency),
        AirRule(name="searched", when="span", span_name=r"^execute_tool calc$", value=0.05),
        AirRule(name="flag", when=lambda s: s["name"] == "nope", value=1.0),
        AirRule(name="valueless", when=lambda s: True),  # True without a value: ignored (logged)
    )
    result = _rewards([tool_span("t", start=250, end=300)], rules=rules)
    assert result.rewards_by_call == {
        "c1": [
            {"name": "slow", "value": pytest.approx(-0.5), "source": "slow:t"},
            {"name": "searched", "value": 0.05, "source": "searched:t"},
        ]
    }


def test_once_per_rollout_rewards_only_the_first_match() -> None:
    bonus = AirRule(name="used", when="span", span_name=r"^execute_tool calc$", value=0.1, once_per_rollout=True)
    spans = [tool_span("t1", start=250, end=300), tool_span("t2", start=600, end=650)]  # after c1, after c2
    assert _rewards(spans, rules=(bonus,)).rewards_by_call == {"c1": [{"name": "used", "value": 0.1, "source": "used:t1"}]}
    every = AirRule(name="used", when="span", span_name=r"^execute_tool calc$", value=0.1)
    assert set(_rewards(spans, rules=(every,)).rewards_by_call) == {"c1", "c2"}
    yaml_rule = air_rules_from_yaml("- {name: used, when: span, value: 0.1, once_per_rollout: true}")[0]
    assert yaml_rule.once_per_rollout


def test_disabled_rule_and_empty_rules() -> None:
    rule = AirRule(name="tool_error", when="tool_error", value=-1.0, enabled=False)
    assert _rewards([tool_span("t", start=250, end=300, error=True)], rules=(rule,)).rewards_by_call == {}
    assert _rewards([tool_span("t", start=250, end=300, error=True)], rules=()).rewards_by_call == {}


def test_air_in_assembly_on_a_failed_tool() -> None:
    spans = [
        root_span(),
        llm_span("c1", [1], [2], start=100, end=200),
        tool_span("t1", start=210, end=220, error=True, message="KeyError: 'x'"),
        llm_span("c2", [1, 2, 9], [3], start=230, end=300),
        tool_span("t2", start=310, end=320, arguments="not json"),
        llm_span("c3", [1, 2, 9, 3, 8], [4], start=330, end=400),
        reward_span("fin", 1.0, at=990, final=True, primary=True),
    ]
    traj = assemble_trajectory(spans)
    assert [t["rewards"] for t in traj["turns"]] == [
        [{"name": "tool_error", "value": -0.1, "source": "tool_error:t1"}],
        [{"name": "tool_args_invalid", "value": -0.2, "source": "tool_args_invalid:t2"}],
        [],
    ]
    custom = AssemblyConfig(air_rules=(AirRule(name="tool_error", when="tool_error", value=-1.0),))
    assert assemble_trajectory(spans, custom)["turns"][0]["rewards"][0]["value"] == -1.0


def test_rules_from_yaml() -> None:
    text = """
air:
  defaults: true
  rules:
    - name: searched
      when: span
      span_name: "^execute_tool"
      value: 0.05
    - name: custom
      when: "tests.unit.streams.factory:always_minus_one"
"""
    rules = air_rules_from_yaml(text)
    assert [r.name for r in rules] == [r.name for r in DEFAULT_AIR_RULES] + ["searched", "custom"]
    result = _rewards([tool_span("t", start=250, end=300)], rules=rules[-2:])
    assert [(r["name"], r["value"]) for r in result.rewards_by_call["c1"]] == [("searched", 0.05), ("custom", -1.0)]
    plain = air_rules_from_yaml("- {name: e, when: span_error, value: -0.3, stop: true}")
    assert plain == (AirRule(name="e", when="span_error", value=-0.3, stop=True),)
    assert air_rules_from_yaml("rules: []") == ()


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"name": "x", "when": "nope", "value": 1}], "unknown matcher"),
        ([{"name": "x", "when": "tool_error"}], "value: required for matcher 'tool_error'"),
        ([{"name": "x", "when": "span", "value": True}], "finite number"),
        ([{"name": "x", "when": "span", "value": 1, "span_name": "("}], "span_name: invalid regex"),
        ([{"name": "x", "when": "span", "value": 1, "colour": "red"}], "unknown keys"),
        ([{"when": "span", "value": 1}], "'name' and 'when' are required"),
        ([{"name": "x", "when": "span", "value": float("nan")}], "finite"),
        ([{"name": "x", "when": "no.such.module:f", "value": 1}], "cannot import"),
        (["tool_error"], "must be a mapping"),
    ],
)
def test_rule_validation(items: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        air_rules_from_dicts(items)


def test_yaml_must_be_a_list() -> None:
    with pytest.raises(ValueError, match="list of rules"):
        air_rules_from_yaml("rules: {name: x}")
