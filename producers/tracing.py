"""Tracing wiring: the span processor that stamps rollout ids, and ``setup_tracing``.

Why a processor and not only baggage: baggage is context, and context does
not follow every span into Kafka. The processor copies the ids into the
attributes of every span at start, where the exporter (and every other
exporter the app uses) sees them. Lookup order per span:

1. baggage in the parent context (same thread, asyncio tasks, and a remote
   caller that propagated W3C ``baggage``);
2. the active rollout owning the span's trace (a span whose thread lost the
   baggage but kept the trace, e.g. a remote parent without baggage);
3. the only rollout active in the process (a plain ``threading.Thread`` or
   executor started inside the rollout, which copies no context). With
   several concurrent rollouts and no context, nothing is guessed.

``install_rollout_processor`` is idempotent and is called by ``rollout()``
and by the exporter, so ``opentelemetry-instrument`` setups get it without code.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from opentelemetry import baggage, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from . import context as rctx

log = logging.getLogger(__name__)
_MARK = "_boltstream_rollout_processor"
# BatchSpanProcessor settings for KafkaSpanExporter (the SDK's: queue 2,048, batches of 512, 5 s).
# Its export() only appends to a buffer, so big batches cost the agent nothing, and its sender
# works in rounds of 2,000 anyway; a 2,048-span queue drops spans ("Queue full") in any burst the
# processor's thread does not drain in time. Zero-code equivalent: OTEL_BSP_SCHEDULE_DELAY=500
# OTEL_BSP_MAX_QUEUE_SIZE=65536 OTEL_BSP_MAX_EXPORT_BATCH_SIZE=2048.
BSP_DEFAULTS: dict[str, int] = {"schedule_delay_millis": 500, "max_queue_size": 65_536,
                                "max_export_batch_size": 2_048}
_INSTALL_LOCK = threading.Lock()


class RolloutSpanProcessor(SpanProcessor):
    """Copies ``boltstream.rollout_id`` / ``attempt_id`` / ``task_id`` onto every span at start."""

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        try:
            bounded = getattr(span, "_attributes", None)
            inner = getattr(bounded, "_dict", None)  # the SDK's storage, skipping its locked proxy
            if rctx.ROLLOUT_ID in (inner if inner is not None else (span.attributes or ())):
                return  # set explicitly by whoever started the span: theirs wins
            ids: dict[str, str] | None = None
            if parent_context is None:  # the current context: our context variable says it all, cheaply
                owner = rctx._CURRENT.get()
                ids = owner.ids if owner is not None else None
            if ids is None:
                bag = baggage.get_all(parent_context)
                if rctx.ROLLOUT_ID in bag:
                    ids = {k: str(bag[k]) for k in rctx.ID_KEYS if bag.get(k) is not None}
                else:
                    owner = rctx.rollout_for_trace(span.get_span_context().trace_id)
                    if owner is None:
                        active = rctx.active_rollouts()
                        owner = active[0] if len(active) == 1 else None
                    ids = owner.ids if owner is not None else None
            if ids:
                self._stamp(span, bounded, inner, ids)
        except Exception:  # a processor must never break the app's span
            log.debug("RolloutSpanProcessor.on_start failed", exc_info=True)

    @staticmethod
    def _stamp(span: Any, bounded: Any, inner: Any, ids: dict[str, str]) -> None:
        """Write the ids. Straight into the SDK's attribute dict when there is room (they are plain
        strings, and the span is not yet visible to other threads): ~3x cheaper than set_attributes,
        which re-validates every value under two locks. The public API otherwise."""
        max_len = getattr(bounded, "maxlen", None)
        if isinstance(inner, dict) and not getattr(bounded, "_immutable", True) and (
                max_len is None or len(inner) + len(ids) <= max_len):
            inner.update(ids)
        else:
            span.set_attributes(ids)

    def on_end(self, span: Any) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def install_rollout_processor(provider: Any = None) -> bool:
    """Add :class:`RolloutSpanProcessor` to ``provider`` (default: the global one) once.

    Returns False when the provider is not an SDK ``TracerProvider`` (no SDK
    configured yet: nothing to install into).
    """
    provider = provider if provider is not None else trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return False
    if getattr(provider, _MARK, False):
        return True
    with _INSTALL_LOCK:
        if not getattr(provider, _MARK, False):
            provider.add_span_processor(RolloutSpanProcessor())
            setattr(provider, _MARK, True)
    return True


def setup_tracing(settings: Any = None, *, service_name: str | None = None, exporter: Any = None,
                  schedule_delay_ms: int = BSP_DEFAULTS["schedule_delay_millis"],
                  max_queue_size: int = BSP_DEFAULTS["max_queue_size"],
                  max_export_batch_size: int = BSP_DEFAULTS["max_export_batch_size"]) -> TracerProvider:
    """Make sure spans reach the spans topic; returns the SDK provider in use.

    With no SDK provider installed, installs one with ``RolloutSpanProcessor`` +
    ``BatchSpanProcessor(KafkaSpanExporter)`` and makes it global. With one
    already installed (``opentelemetry-instrument``, the app's own), only the
    rollout processor is added, plus our exporter when ``exporter`` is passed,
    so spans are not exported twice.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        install_rollout_processor(current)
        if exporter is not None:
            current.add_span_processor(BatchSpanProcessor(
                exporter, max_queue_size=max_queue_size, schedule_delay_millis=schedule_delay_ms,
                max_export_batch_size=max_export_batch_size))
        return current
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    from .exporter import KafkaSpanExporter

    if exporter is None:
        exporter = KafkaSpanExporter(settings=settings, install_rollout_processor=False)
    resource = Resource.create({SERVICE_NAME: service_name} if service_name else {})
    provider = TracerProvider(resource=resource)
    install_rollout_processor(provider)
    provider.add_span_processor(BatchSpanProcessor(
        exporter, max_queue_size=max_queue_size, schedule_delay_millis=schedule_delay_ms,
        max_export_batch_size=max_export_batch_size))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:  # another thread won the race
        provider.shutdown()
        winner = trace.get_tracer_provider()
        install_rollout_processor(winner)
        return winner  # type: ignore[return-value]
    return provider
