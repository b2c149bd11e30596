"""The OpenTelemetry internals the producers rely on, all of them, with the versions they were checked with.

Why any: two of the producers' paths run on every span an agent makes, and there the public
API costs more than the rest of the work. Each helper below uses one private attribute when it
is there and falls back to the public API otherwise, so another SDK version makes the producers
slower, never wrong; ``tests/unit/producers/test_otel_internals.py`` fails, naming the versions,
when the installed ones are not those in :data:`CHECKED_WITH` (re-check the contract below, then
add the version).

The contract (opentelemetry-sdk / opentelemetry-api, as of the versions in :data:`CHECKED_WITH`):

* ``BoundedAttributes`` (``opentelemetry.attributes``) keeps its items in a plain dict ``_dict``,
  is read-only once ``_immutable`` is true, and holds at most ``maxlen`` items. The public way to
  read a span's attributes (``ReadableSpan.attributes``, a ``MappingProxyType`` over it) calls a
  Python ``__getitem__`` per key; copying ``_dict`` is one C call (:func:`attribute_dict`).
* ``Span._attributes`` is that ``BoundedAttributes``, mutable until the span ends. At span start,
  before the span is visible to another thread, :func:`set_start_attributes` writes plain string
  ids into ``_dict`` (~3x cheaper than ``Span.set_attributes``, which validates every value under
  two locks); with no room or no such dict it calls ``set_attributes``.
* ``CompositePropagator`` (opentelemetry-api) keeps its members in ``_propagators``: the only way
  to see whether ours is already installed inside the global one (:func:`propagator_members`).
* ``opentelemetry.context._SUPPRESS_INSTRUMENTATION_KEY`` set to true in the current context makes the
  instrumentations (httpx, aiokafka, ...) record nothing: the exporter's own Kafka traffic must never
  become spans (:func:`suppress_instrumentation`). The public helper of that name lives in
  ``opentelemetry-instrumentation``, which an agent process need not have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import context

# distribution -> versions this module's contract was checked against (read by the test).
CHECKED_WITH: dict[str, tuple[str, ...]] = {
    "opentelemetry-sdk": ("1.45.2",),
    "opentelemetry-api": ("1.45.2",),
}


def attribute_dict(attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain dict copy of an attribute mapping (a span's, an event's, or any mapping)."""
    if not attrs:
        return {}
    inner = getattr(attrs, "_dict", None)
    return dict(inner) if isinstance(inner, dict) else dict(attrs)


def span_attribute_dict(span: Any) -> dict[str, Any]:
    """A plain dict copy of a ``ReadableSpan``'s attributes, skipping the read-only proxy."""
    bounded = getattr(span, "_attributes", None)
    return attribute_dict(bounded if bounded is not None else span.attributes)


def start_attributes(span: Any) -> Mapping[str, Any]:
    """The attributes of a span being started, for reading (no copy)."""
    inner = getattr(getattr(span, "_attributes", None), "_dict", None)
    return inner if isinstance(inner, dict) else (span.attributes or {})


def set_start_attributes(span: Any, values: Mapping[str, str]) -> None:
    """Set string attributes on a span at start (``SpanProcessor.on_start``), straight into the SDK's
    dict when the span can take them all, through ``set_attributes`` otherwise."""
    bounded = getattr(span, "_attributes", None)
    inner = getattr(bounded, "_dict", None)
    max_len = getattr(bounded, "maxlen", None)
    if isinstance(inner, dict) and getattr(bounded, "_immutable", True) is False and (
            max_len is None or len(inner) + len(values) <= max_len):
        inner.update(values)
    else:
        span.set_attributes(values)


def propagator_members(propagator: Any) -> list[Any]:
    """``propagator`` and, when it is a composite, the propagators inside it."""
    return [propagator, *getattr(propagator, "_propagators", ())]


def suppress_instrumentation() -> object:
    """Mark the calling thread's context so that no instrumentation records a span in it (for the rest
    of the thread); returns the token :func:`opentelemetry.context.detach` takes."""
    return context.attach(context.set_value(context._SUPPRESS_INSTRUMENTATION_KEY, True))
