"""A rollout with no explicit id is its session: the agent's spans, the propagated baggage and the worker agree."""

from __future__ import annotations

from opentelemetry import baggage
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from boltstream.inference.capture import CallContext
from boltstream.producers.headers import session_from_headers, session_of
from boltstream.producers.propagation import RolloutBaggagePropagator
from boltstream.producers.rollout_processor import install_rollout_processor
from boltstream.schemas.records import rollout_key, span_key


def test_rollout_key_precedence() -> None:
    span = {"trace_id": "ab" * 16, "rollout_id": None, "attributes": {}}
    assert rollout_key(span) == "ab" * 16
    span["attributes"] = {"session.id": "s-1"}
    assert rollout_key(span) == "s-1"
    span["attributes"]["gen_ai.conversation.id"] = "c-1"  # GenAI conventions before OpenInference
    assert rollout_key(span) == "c-1"
    span["attributes"]["gen_ai.conversation.id"] = "  "  # blank: not a session
    assert rollout_key(span) == "s-1"
    span["rollout_id"] = "r-1"
    assert rollout_key(span) == "r-1" and span_key(span) == b"r-1"
    assert rollout_key({"trace_id": None, "rollout_id": None}) == ""


def test_session_from_openinference_context_or_baggage() -> None:
    assert session_of(otel_context.Context()) is None
    ctx = otel_context.set_value("session.id", "oi-7")  # what openinference's using_session sets
    assert session_of(ctx) == ("session.id", "oi-7")
    ctx = baggage.set_baggage("gen_ai.conversation.id", "conv-9", ctx)
    assert session_of(ctx) == ("gen_ai.conversation.id", "conv-9")


def test_session_reaches_the_worker_span_through_baggage() -> None:
    token = otel_context.attach(otel_context.set_value("session.id", "oi-7"))
    try:
        carrier: dict[str, str] = {}
        RolloutBaggagePropagator().inject(carrier)
    finally:
        otel_context.detach(token)
    assert session_from_headers(carrier) == {"session.id": "oi-7"}
    assert CallContext.from_request(carrier, None).ids == {"session.id": "oi-7"}
    explicit = {**carrier, "X-Boltstream-Rollout-Id": "r-1", "X-Boltstream-Attempt-Id": "a"}
    assert "session.id" not in CallContext.from_request(explicit, None).ids  # an explicit rollout wins


def test_agent_spans_in_a_session_are_stamped_with_it() -> None:
    provider, exporter = TracerProvider(), InMemorySpanExporter()
    install_rollout_processor(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    token = otel_context.attach(otel_context.set_value("session.id", "oi-7"))
    try:
        with tracer.start_as_current_span("agent"), tracer.start_as_current_span("POST"):
            pass
        with tracer.start_as_current_span("own", attributes={"gen_ai.conversation.id": "c"}):
            pass
    finally:
        otel_context.detach(token)
        provider.shutdown()
    got = {s.name: dict(s.attributes or {}) for s in exporter.get_finished_spans()}
    assert got["agent"]["session.id"] == got["POST"]["session.id"] == "oi-7"
    assert "session.id" not in got["own"]  # a span naming its own conversation keeps it
