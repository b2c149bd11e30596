"""The rollout-end marker: how a process that IS one rollout says it is over.

An agent run with ``BOLTSTREAM_ROLLOUT_ID`` in its environment (docs/zero-code.md) has no
runner and hence no ``boltstream.rollout`` root span to close its rollout; the stream app
would wait ``session_idle_s`` (60 s) of silence. When the process's exporter shuts down (the
SDK does it at exit), :class:`~boltstream.producers.exporter.KafkaSpanExporter` sends one more
span, named ``boltstream.rollout.end``, with the rollout's ids, after every other span of the
process on the same key (so the same partition, in order). The stream app closes a rollout
``grace_s`` after that span arrives (streams/stages.py).

It is an ordinary zero-length span in a trace of its own: no parent, no status of its own,
so it changes nothing else a trajectory holds (its end time is the process's exit).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from boltstream.schemas import records

_IDS = RandomIdGenerator()


def end_marker(ids: Mapping[str, str], resource: Resource | None = None) -> ReadableSpan:
    """The ``boltstream.rollout.end`` span for the rollout ``ids`` (span attribute name -> value)."""
    now = time.time_ns()
    context = SpanContext(_IDS.generate_trace_id(), _IDS.generate_span_id(), is_remote=False,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(name=records.ROLLOUT_END_SPAN, context=context, parent=None,
                        resource=resource or process_resource(), attributes=dict(ids),
                        kind=trace.SpanKind.INTERNAL, start_time=now, end_time=now,
                        instrumentation_scope=InstrumentationScope("boltstream"))


def process_resource() -> Resource:
    """The process's tracer-provider resource (service name and all), or the SDK's default one."""
    resource: Any = getattr(trace.get_tracer_provider(), "resource", None)
    return resource if isinstance(resource, Resource) else Resource.create()
