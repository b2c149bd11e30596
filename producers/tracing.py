"""``setup_tracing``: make sure an agent's spans reach the spans topic, whatever provider the app has.

The rollout id stamping itself is :mod:`.rollout_processor`.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .exporter import KafkaSpanExporter
from .rollout_processor import install_rollout_processor

log = logging.getLogger(__name__)
# BatchSpanProcessor settings for KafkaSpanExporter (the SDK's: queue 2,048, batches of 512, 5 s).
# Its export() only appends to a buffer, so big batches cost the agent nothing, and its sender
# works in rounds of 2,000 anyway; a 2,048-span queue drops spans ("Queue full") in any burst the
# processor's thread does not drain in time. Zero-code equivalent: OTEL_BSP_SCHEDULE_DELAY=500
# OTEL_BSP_MAX_QUEUE_SIZE=65536 OTEL_BSP_MAX_EXPORT_BATCH_SIZE=2048.
BSP_DEFAULTS: dict[str, int] = {"schedule_delay_millis": 500, "max_queue_size": 65_536,
                                "max_export_batch_size": 2_048}


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
