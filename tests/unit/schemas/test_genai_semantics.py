"""One table of span shapes, classified through the producer path (the normaliser derives
``boltstream.span.kind``) and the stream path (what the stream app decides about the record, with
and without the derived kind): every row gets the same answer on both sides."""

from __future__ import annotations

from typing import Any

import pytest

from boltstream.producers.normalise import SpanInput, normalise
from boltstream.schemas import genai_semantics
from boltstream.schemas.records import SPAN_KIND
from boltstream.streams.spans import span_flags as stream_kind

# (span name, attributes as the agent's instrumentation writes them, kind)
SHAPES: list[tuple[str, dict[str, Any], str | None]] = [
    ("boltstream.rollout", {}, "rollout"),
    ("boltstream.reward", {"boltstream.reward.value": 1.0}, "reward"),
    ("x", {"boltstream.span.kind": "tool"}, "tool"),
    ("x", {"boltstream.span.kind": "LLM", "gen_ai.operation.name": "execute_tool"}, "llm"),
    ("x", {"openinference.span.kind": "LLM"}, "llm"),
    ("x", {"openinference.span.kind": "TOOL"}, "tool"),
    ("x", {"openinference.span.kind": "AGENT"}, "agent"),
    ("x", {"openinference.span.kind": "CHAIN", "gen_ai.operation.name": "chat"}, "chain"),
    ("x", {"gen_ai.operation.name": "chat"}, "llm"),
    ("x", {"gen_ai.operation.name": " Chat "}, "llm"),
    ("x", {"gen_ai.operation.name": "text_completion"}, "llm"),
    ("x", {"gen_ai.operation.name": "generate_content"}, "llm"),
    ("x", {"gen_ai.operation.name": "execute_tool"}, "tool"),
    ("x", {"gen_ai.operation.name": "invoke_agent"}, "agent"),
    ("x", {"gen_ai.operation.name": "embeddings"}, "embedding"),
    ("x", {"gen_ai.operation.name": "retrieve"}, "retrieve"),
    ("x", {"gen_ai.operation.name": "", "traceloop.span.kind": "tool"}, "tool"),
    ("x", {"traceloop.span.kind": "workflow"}, "workflow"),
    ("x", {"traceloop.span.kind": "TOOL", "llm.request.type": "chat"}, "tool"),
    ("x", {"agentops.span.kind": "tool"}, "tool"),
    # OpenLLMetry's LLMRequestTypeValues: chat and completion are LLM calls, the rest are not.
    ("openai.chat", {"llm.request.type": "chat", "gen_ai.system": "openai"}, "llm"),
    ("openai.completion", {"llm.request.type": "completion"}, "llm"),
    ("openai.embeddings", {"llm.request.type": "embedding"}, "embedding"),
    ("cohere.rerank", {"llm.request.type": "rerank"}, "rerank"),
    ("x", {"llm.request.type": "unknown"}, None),
    ("x", {"http.method": "GET"}, None),
    ("x", {}, None),
]


def _record(name: str, attrs: dict[str, Any]) -> dict[str, Any]:
    return normalise(SpanInput(trace_id=0xABC, span_id=0x1, name=name, start_time_ns=1, end_time_ns=2,
                               attributes=attrs))


def _triple(kind: str | None) -> tuple[bool, bool, bool]:
    return kind == "llm", kind == "tool", kind == "reward"


@pytest.mark.parametrize(("name", "attrs", "kind"), SHAPES, ids=[f"{i}-{s[2]}" for i, s in enumerate(SHAPES)])
def test_the_producer_and_the_stream_app_classify_a_span_alike(name: str, attrs: dict[str, Any],
                                                              kind: str | None) -> None:
    assert genai_semantics.span_kind(name, attrs) == kind
    record = _record(name, attrs)
    assert record["attributes"].get(SPAN_KIND, "").lower() == (kind or "")  # the producer path
    assert (record["llm"] is not None) == (kind == "llm")
    assert tuple(stream_kind(record)) == _triple(kind)  # the stream path, on what the producer wrote
    raw = {**record, "attributes": {k: v for k, v in record["attributes"].items() if k != SPAN_KIND}, "llm": None}
    if SPAN_KIND in attrs:
        raw["attributes"][SPAN_KIND] = attrs[SPAN_KIND]
    assert tuple(stream_kind(raw)) == _triple(kind)  # the stream path, on a record nobody classified


@pytest.mark.parametrize(("name", "attrs", "kind"), [
    ("agentlightning.annotation", {"agentlightning.reward.0.value": "0.5"}, "reward"),
    ("x", {"response_token_ids": [1], "prompt_token_ids": [2]}, "llm"),
    ("x", {"llm.hosted_vllm.choices": "[{'token_ids': [7]}]"}, "llm"),
])
def test_what_only_raw_attributes_show_reaches_the_stream_app_as_the_derived_kind(
        name: str, attrs: dict[str, Any], kind: str) -> None:
    assert genai_semantics.span_kind(name, attrs) is None
    record = _record(name, attrs)
    assert record["attributes"][SPAN_KIND] == kind
    assert tuple(stream_kind(record)) == _triple(kind)
