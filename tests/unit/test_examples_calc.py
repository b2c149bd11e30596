"""examples/calc: the calculator, the reward, and what AIR makes of its tool span.

No network and no model: the tool span comes from the agent's own ``calculator``
through an in-memory exporter, and goes through the example's own AIR file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from boltstream.examples.calc import agent
from boltstream.producers.normalise import normalise_span
from boltstream.streams.air import CallRef, air_rules_from_yaml, evaluate_air

AIR_FILE = Path(agent.__file__).with_name("air.yaml")


@pytest.fixture
def tool_spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The agent's tracer writing to a private provider."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(agent, "tracer", provider.get_tracer("examples.calc"))
    try:
        yield exporter
    finally:
        provider.shutdown()


@pytest.mark.parametrize(("expression", "value"), [("4 * 9", 36), ("(81 - 9) / 8", 9), ("-3 + 10", 7), ("7 / 2", 3.5)])
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert agent.evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 10", "1 / 0", "4 *"])
def test_calculator_refuses_anything_else(expression: str) -> None:
    assert agent.calculator(expression).startswith("ERROR: ")


@pytest.mark.parametrize(("answer", "expected", "value"), [("36", 36, 1.0), ("36.0", 36, 1.0), ("35", 36, 0.0),
                                                           (None, 36, 0.0), ("x", 36, 0.0)])
def test_reward_is_exact_match(answer: str | None, expected: float, value: float) -> None:
    assert agent.reward(answer, expected) == value


def _air_names(exporter: Any, expression: str) -> list[str]:
    agent.calculator(expression)
    (span,) = [normalise_span(s) for s in exporter.get_finished_spans()]
    call = CallRef(span_id="0" * 16, end_time_ns=span["start_time_ns"] - 1)  # the LLM call that wrote CALC
    rules = air_rules_from_yaml(AIR_FILE.read_text())
    rewards = evaluate_air([span], [call], rules).rewards_by_call.get(call.span_id, [])
    return sorted(f"{r['name']}={r['value']:+.1f}" for r in rewards)


def test_air_rewards_a_calculator_call_that_evaluates(tool_spans: Any) -> None:
    # the tool's arguments are JSON, so the default tool_args_invalid rule (-0.2, stop) stays quiet
    assert _air_names(tool_spans, "4 * 9") == ["calculator_used=+0.1"]


def test_air_takes_the_bonus_back_when_the_expression_fails(tool_spans: Any) -> None:
    assert _air_names(tool_spans, "4 *") == ["calculator_used=+0.1", "tool_error=-0.1"]


def test_air_pays_the_calculator_bonus_once_per_rollout(tool_spans: Any) -> None:
    # paid per call, a demo run learned to write CALC three times and never answer (3 x 0.1 > a wrong answer)
    agent.calculator("4 * 9")
    agent.calculator("36 + 1")
    first, second = sorted((normalise_span(s) for s in tool_spans.get_finished_spans()), key=lambda s: s["start_time_ns"])
    calls = [CallRef("a" * 16, first["start_time_ns"] - 1), CallRef("b" * 16, second["start_time_ns"] - 1)]
    rewards = evaluate_air([first, second], calls, air_rules_from_yaml(AIR_FILE.read_text())).rewards_by_call
    assert rewards == {"a" * 16: [{"name": "calculator_used", "value": 0.1, "source": f"calculator_used:{first['span_id']}"}]}
