"""Table tests for the pure normaliser: attribute conversion, the four GenAI dialects, promoted ids."""

from __future__ import annotations

import json
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from boltstream.producers import genai
from boltstream.producers.attributes import attr_value, convert_attributes, float_array, int_array
from boltstream.producers.normalise import SpanInput, SpanNormaliser, normalise, normalise_span
from boltstream.schemas import Codec
from boltstream.schemas.packed import as_lists


class Odd:
    def __str__(self) -> str:
        return "odd!"


class Hostile:
    def __str__(self) -> str:
        raise RuntimeError("no")


ATTR_CASES: list[tuple[Any, Any]] = [
    (None, None),
    ("s", "s"),
    (True, True),
    (3, 3),
    (2**70, str(2**70)),
    (1.5, 1.5),
    ([True, False], {"bools": [True, False]}),
    ((1, 2), {"longs": [1, 2]}),
    ([1, 2.5], {"doubles": [1.0, 2.5]}),
    (["a"], {"strings": ["a"]}),
    ([], {"strings": []}),
    (["a", 1, None], {"strings": ["a", "1", "null"]}),
    ({"k": 1}, '{"k": 1}'),
    (b"bytes", "bytes"),
    (b"\xff\x00", "base64:/wA="),
    (Decimal("1.25"), "1.25"),             # not a numbers.Real: unsupported -> str()
    (Fraction(5, 4), 1.25),
    (Odd(), "odd!"),
    (Hostile(), "<unrepresentable Hostile>"),
]


@pytest.mark.parametrize(("value", "expected"), ATTR_CASES)
def test_attr_value(value: Any, expected: Any) -> None:
    assert attr_value(value) == expected


@pytest.mark.parametrize(("value", "expected"), [
    ([1, 2, 3], [1, 2, 3]),
    ((1, 2), [1, 2]),
    ("[1, 2, 3]", [1, 2, 3]),              # JSON string (Agent Lightning's proxy)
    ("[[4, 5]]", [4, 5]),                  # str(list of lists): vLLM, one list per choice
    ([[4, 5], [6]], [4, 5]),
    ({"longs": [7, 8]}, [7, 8]),           # already wrapped (OTLP round trip)
    ([1.0, 2.0], [1, 2]),
    (["1", "2"], [1, 2]),
    ("not json", None),
    ([1.5], None),
    ([True], None),
    ([2**40], None),                        # beyond Avro int
    (5, None),
])
def test_int_array(value: Any, expected: Any) -> None:
    got = int_array(value)
    assert (got if got is None else got.tolist()) == expected


def test_float_array() -> None:
    assert float_array("[-0.5, -1]").tolist() == [-0.5, -1.0]
    assert float_array(["-0.5"]).tolist() == [-0.5]
    assert float_array((-0.5, -1)).tolist() == [-0.5, -1.0]
    assert float_array([True]) is None


# (dialect, attributes, expected llm fields, expected input messages, expected output messages)
DIALECTS: list[tuple[str, dict[str, Any], dict[str, Any], list[dict[str, Any]] | None, list[dict[str, Any]] | None]] = [
    (
        "genai-current",
        {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m-req", "gen_ai.response.model": "m-resp",
         "gen_ai.usage.input_tokens": 11, "gen_ai.usage.output_tokens": 3, "gen_ai.request.temperature": 0.7,
         "gen_ai.request.top_p": 0.9, "gen_ai.request.max_tokens": 64, "gen_ai.request.seed": 5,
         "gen_ai.response.finish_reasons": ("stop",),
         "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
         "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "yo"}],
                                                "finish_reason": "stop"}])},
        {"model": "m-resp", "input_tokens": 11, "output_tokens": 3, "temperature": 0.7, "top_p": 0.9,
         "max_tokens": 64, "seed": 5, "finish_reason": "stop"},
        None, None,  # already canonical: left as they are
    ),
    (
        "genai-legacy (OpenLLMetry)",
        {"llm.request.type": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "gpt",
         "gen_ai.usage.prompt_tokens": 7, "gen_ai.usage.completion_tokens": 2,
         "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "be brief",
         "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "2+2?",
         "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "4",
         "gen_ai.completion.0.finish_reason": "stop",
         "gen_ai.completion.0.tool_calls.0.id": "c1", "gen_ai.completion.0.tool_calls.0.name": "calc",
         "gen_ai.completion.0.tool_calls.0.arguments": '{"x": 1}',
         "traceloop.span.kind": "llm", "traceloop.entity.name": "agent"},
        {"model": "gpt", "input_tokens": 7, "output_tokens": 2, "finish_reason": "stop"},
        [{"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
         {"role": "user", "parts": [{"type": "text", "content": "2+2?"}]}],
        [{"role": "assistant", "parts": [{"type": "text", "content": "4"},
                                         {"type": "tool_call", "id": "c1", "name": "calc", "arguments": {"x": 1}}],
          "finish_reason": "stop"}],
    ),
    (
        "openinference",
        {"openinference.span.kind": "LLM", "llm.model_name": "qwen", "llm.token_count.prompt": 20,
         "llm.token_count.completion": 4, "llm.invocation_parameters": '{"temperature": 0.2, "max_tokens": 9}',
         "llm.input_messages.0.message.role": "user",
         "llm.input_messages.0.message.contents.0.message_content.type": "text",
         "llm.input_messages.0.message.contents.0.message_content.text": "hello",
         "llm.input_messages.1.message.role": "tool", "llm.input_messages.1.message.content": "42",
         "llm.input_messages.1.message.tool_call_id": "t9",
         "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "hi",
         "llm.output_messages.0.message.tool_calls.0.tool_call.id": "t10",
         "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "f",
         "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": "{}"},
        {"model": "qwen", "input_tokens": 20, "output_tokens": 4, "temperature": 0.2, "max_tokens": 9},
        [{"role": "user", "parts": [{"type": "text", "content": "hello"}]},
         {"role": "tool", "parts": [{"type": "tool_call_response", "id": "t9", "response": "42"}]}],
        [{"role": "assistant", "parts": [{"type": "text", "content": "hi"},
                                         {"type": "tool_call", "id": "t10", "name": "f", "arguments": {}}]}],
    ),
    (
        "agent-lightning proxy (token ids as JSON / python repr)",
        {"gen_ai.operation.name": "chat", "prompt_token_ids": "[1, 2, 3]", "response_token_ids": [4, 5],
         "llm.hosted_vllm.model": "local"},
        {"prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5], "model": "local"},
        None, None,
    ),
    (
        "agent-lightning vLLM raw span",
        {"llm.hosted_vllm.prompt_token_ids": "[9, 8]", "llm.hosted_vllm.choices": "[{'token_ids': [7, 6]}]"},
        {"prompt_token_ids": [9, 8], "response_token_ids": [7, 6]},
        None, None,
    ),
    (
        "boltstream inference worker",
        {"gen_ai.operation.name": "chat", "boltstream.llm.prompt_token_ids": (1, 2),
         "boltstream.llm.response_token_ids": (3,), "boltstream.llm.response_logprobs": (-0.25,),
         "boltstream.llm.policy_version": 12, "boltstream.llm.model": "policy"},
        {"prompt_token_ids": [1, 2], "response_token_ids": [3], "response_logprobs": [-0.25],
         "policy_version": 12, "model": "policy"},
        None, None,
    ),
]


@pytest.mark.parametrize(("dialect", "attrs", "llm", "msgs_in", "msgs_out"), DIALECTS, ids=[d[0] for d in DIALECTS])
def test_dialects(dialect: str, attrs: dict[str, Any], llm: dict[str, Any], msgs_in: Any, msgs_out: Any) -> None:
    added, block, consumed = genai.derived_attributes("chat", attrs)
    assert added["boltstream.span.kind"] == "llm"
    assert block is not None
    for field, value in llm.items():
        assert as_lists(block[field]) == value, field
    if msgs_in is not None:
        assert json.loads(added["gen_ai.input.messages"]) == msgs_in
    else:
        assert "gen_ai.input.messages" not in added
    if msgs_out is not None:
        assert json.loads(added["gen_ai.output.messages"]) == msgs_out
    for key in consumed:  # every attribute declared redundant really was a message field we mapped
        assert key.startswith(("llm.input_messages.", "llm.output_messages.", "gen_ai.prompt.", "gen_ai.completion."))
    if msgs_in is not None:
        assert any(k.endswith("role") for k in consumed)


@pytest.mark.parametrize(("name", "attrs", "kind"), [
    ("boltstream.rollout", {}, "rollout"),
    ("boltstream.reward", {}, "reward"),
    ("x", {"openinference.span.kind": "TOOL"}, "tool"),
    ("x", {"gen_ai.operation.name": "execute_tool"}, "tool"),
    ("x", {"gen_ai.operation.name": "invoke_agent"}, "agent"),
    ("x", {"traceloop.span.kind": "workflow"}, "workflow"),
    ("x", {"response_token_ids": [1]}, "llm"),
    ("agentlightning.annotation", {"agentlightning.reward.0.value": "0.5"}, "reward"),
    ("x", {"http.method": "GET"}, None),
])
def test_raw_span_kind(name: str, attrs: dict[str, Any], kind: str | None) -> None:
    assert genai.raw_span_kind(name, attrs) == kind


@pytest.mark.parametrize(("attrs", "expected"), [
    ({"agentlightning.reward.0.name": "final_score", "agentlightning.reward.0.value": "0.933"}, ("final_score", 0.933)),
    ({"agentlightning.reward.0.value": 1.0, "agentlightning.reward.1.value": 0.2}, ("reward", 1.0)),
    ({"agentlightning.reward.primary": 2}, ("reward", 2.0)),
    ({"agentops.task.output": json.dumps({"type": "reward", "value": 0.25})}, ("reward", 0.25)),
])
def test_agent_lightning_rewards(attrs: dict[str, Any], expected: tuple[str, float]) -> None:
    added, llm, _ = genai.derived_attributes("agentlightning.annotation", attrs)
    assert llm is None
    assert (added["boltstream.reward.name"], added["boltstream.reward.value"]) == expected
    assert added["boltstream.reward.primary"] is True


def _inp(attrs: dict[str, Any], resource: dict[str, Any] | None = None) -> SpanInput:
    return SpanInput(trace_id=0xABC, span_id=0x1, name="s", start_time_ns=1, end_time_ns=2, attributes=attrs,
                     resource=resource or {})


@pytest.mark.parametrize(("attrs", "resource", "defaults", "expected"), [
    ({"boltstream.rollout_id": "r", "boltstream.attempt_id": "a", "boltstream.task_id": "t"}, {}, None, ("r", "a", "t")),
    ({"agentlightning.rollout_id": "ro-1", "agentlightning.attempt_id": "at-1"}, {}, None, ("ro-1", "at-1", None)),
    ({}, {"boltstream.rollout_id": "res"}, None, ("res", None, None)),
    ({}, {}, {"rollout_id": "env", "task_id": "tt"}, ("env", None, "tt")),
    ({"boltstream.rollout_id": "attr"}, {"boltstream.rollout_id": "res"}, {"rollout_id": "env"}, ("attr", None, None)),
    ({"boltstream.task_id": 42}, {}, None, (None, None, "42")),
])
def test_promoted_ids(attrs: dict[str, Any], resource: dict[str, Any], defaults: Any, expected: tuple[Any, ...]) -> None:
    rec = normalise(_inp(attrs, resource), defaults)
    assert (rec["rollout_id"], rec["attempt_id"], rec["task_id"]) == expected
    if expected[0]:
        assert rec["attributes"]["boltstream.rollout_id"] == expected[0]


def test_ids_are_padded_hex_and_record_encodes() -> None:
    rec = normalise(_inp({"odd": Odd(), "list": [1, "a"], "nested": {"a": [1]}, "toks": [1]}))
    assert rec["trace_id"] == "0" * 29 + "abc" and rec["span_id"] == "0" * 15 + "1"
    assert rec["attributes"]["odd"] == "odd!"
    assert rec["attributes"]["nested"] == '{"a": [1]}'
    back = Codec().decode(Codec().encode("Span", rec), expect="Span")
    assert back["attributes"]["list"] == {"strings": ["1", "a"]}


def test_token_arrays_move_to_llm_block() -> None:
    rec = normalise(_inp({"gen_ai.operation.name": "chat", "prompt_token_ids": "[1, 2]", "response_token_ids": [3]}))
    assert rec["llm"]["prompt_token_ids"].tolist() == [1, 2] and rec["llm"]["response_token_ids"].tolist() == [3]
    assert "prompt_token_ids" not in rec["attributes"] and "response_token_ids" not in rec["attributes"]


def test_sdk_span_fast_path_matches_generic_path() -> None:
    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("t", "1.0")
    with tracer.start_as_current_span("parent"):
        with tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat",
                                                              "boltstream.rollout_id": "r"}) as sp:
            sp.add_event("ev", {"k": "v"})
            sp.set_status(Status(StatusCode.ERROR, "bad"))
    child, parent = mem.get_finished_spans()
    fast = SpanNormaliser()(child)
    generic = normalise_span(child)
    assert fast == generic
    assert fast["parent_span_id"] == format(parent.context.span_id, "016x")
    assert fast["status"] == {"code": "ERROR", "message": "bad"}
    assert fast["events"][0]["name"] == "ev" and fast["events"][0]["attributes"] == {"k": "v"}
    assert fast["scope"] == {"name": "t", "version": "1.0"}
    assert fast["resource"]["service.name"] == "svc"
    assert convert_attributes({1: "x"}) == {"1": "x"}


def test_mapped_message_fields_are_replaced_by_canonical_json_and_unknown_ones_kept() -> None:
    rec = normalise(_inp({
        "openinference.span.kind": "LLM",
        "llm.input_messages.0.message.role": "user",
        "llm.input_messages.0.message.contents.0.message_content.type": "text",
        "llm.input_messages.0.message.contents.0.message_content.text": "look:",
        "llm.input_messages.0.message.contents.1.message_content.type": "image",
        "llm.input_messages.0.message.contents.1.message_content.image.image.url": "http://x/cat.png",
        "llm.input_messages.0.message.name": "alice",
        "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.content": "a cat",
    }))
    attrs = rec["attributes"]
    assert json.loads(attrs["gen_ai.input.messages"]) == [{"role": "user", "parts": [{"type": "text", "content": "look:"}]}]
    assert "llm.input_messages.0.message.role" not in attrs
    assert "llm.input_messages.0.message.contents.0.message_content.text" not in attrs
    assert "llm.output_messages.0.message.content" not in attrs
    assert attrs["llm.input_messages.0.message.contents.1.message_content.image.image.url"] == "http://x/cat.png"
    assert attrs["llm.input_messages.0.message.contents.1.message_content.type"] == "image"
    assert attrs["llm.input_messages.0.message.name"] == "alice"


def test_per_process_caches_never_carry_one_span_into_another() -> None:
    """Attribute names are classified, invocation parameters parsed and ids formatted once per
    process; every value in a record must still be the span's own."""
    for i in range(3):
        for text, params in (("a", '{"temperature": 0.1}'), ("b", '{"temperature": 0.9, "max_tokens": 5}')):
            rec = normalise(_inp({"openinference.span.kind": "LLM", "llm.input_messages.0.message.role": "user",
                                  "llm.input_messages.0.message.content": f"{text}{i}",
                                  "llm.invocation_parameters": params}))
            assert json.loads(rec["attributes"]["gen_ai.input.messages"]) == [
                {"role": "user", "parts": [{"type": "text", "content": f"{text}{i}"}]}]
            assert (rec["llm"]["temperature"], rec["llm"]["max_tokens"]) == (
                json.loads(params)["temperature"], json.loads(params).get("max_tokens"))
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("t")
    for _ in range(2):
        with tracer.start_as_current_span("root"):
            tracer.start_span("child").end()
    normaliser = SpanNormaliser()
    for span in mem.get_finished_spans():
        rec = normaliser(span)
        assert rec["trace_id"] == format(span.context.trace_id, "032x")
        assert rec["parent_span_id"] == (format(span.parent.span_id, "016x") if span.parent else None)
