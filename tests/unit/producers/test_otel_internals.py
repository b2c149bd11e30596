"""The OpenTelemetry internals the producers use (producers/otel_internals.py): the installed versions
are the ones the contract was checked with, and the contract holds on them."""

from __future__ import annotations

import pytest
from opentelemetry import propagate
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider

from boltstream.producers import otel_internals
from tests.fences import assert_checked


@pytest.mark.parametrize("dist", sorted(otel_internals.CHECKED_WITH))
def test_the_installed_version_is_one_the_contract_was_checked_with(dist: str) -> None:
    assert_checked(otel_internals, dist)


def test_the_private_paths_are_taken_on_this_version() -> None:
    # Falling back to the public API would be correct but slower: on the checked versions it must not happen.
    span = TracerProvider().get_tracer("t").start_span("s", attributes={"a": 1})
    assert isinstance(span._attributes._dict, dict) and span._attributes._immutable is False
    assert otel_internals.start_attributes(span) is span._attributes._dict
    assert isinstance(CompositePropagator([])._propagators, list)


def test_suppressing_instrumentation_marks_the_context_the_instrumentations_read() -> None:
    from opentelemetry import context

    token = otel_internals.suppress_instrumentation()
    try:
        assert context.get_value(context._SUPPRESS_INSTRUMENTATION_KEY) is True
    finally:
        context.detach(token)
    assert not context.get_value(context._SUPPRESS_INSTRUMENTATION_KEY)


class _Stamp(SpanProcessor):
    def on_start(self, span, parent_context=None):  # type: ignore[no-untyped-def]
        otel_internals.set_start_attributes(span, {"boltstream.rollout_id": "r", "boltstream.attempt_id": "a"})


@pytest.mark.parametrize("max_attributes", [None, 2, 3])
def test_attributes_set_at_start_read_back_through_the_public_api(max_attributes: int | None) -> None:
    provider = TracerProvider(span_limits=SpanLimits(max_span_attributes=max_attributes))
    provider.add_span_processor(_Stamp())
    span = provider.get_tracer("t").start_span("s", attributes={"x": "1"})
    span.end()
    public = dict(span.attributes)
    assert otel_internals.span_attribute_dict(span) == public
    assert public["boltstream.rollout_id"] == "r" and public["boltstream.attempt_id"] == "a"
    # no room: through set_attributes, whose limit drops the oldest attribute
    assert list(public) == (["boltstream.rollout_id", "boltstream.attempt_id"] if max_attributes == 2
                            else ["x", "boltstream.rollout_id", "boltstream.attempt_id"])


def test_event_and_plain_mappings_copy_alike() -> None:
    span = TracerProvider().get_tracer("t").start_span("s")
    span.add_event("e", {"k": "v"})
    span.end()
    assert otel_internals.attribute_dict(span.events[0].attributes) == {"k": "v"}
    assert otel_internals.attribute_dict({"k": 1}) == {"k": 1} and otel_internals.attribute_dict(None) == {}


def test_propagator_members_sees_inside_a_composite() -> None:
    inner = propagate.get_global_textmap()
    assert otel_internals.propagator_members(CompositePropagator([inner]))[1:] == [inner]
    assert otel_internals.propagator_members(inner)[0] is inner
