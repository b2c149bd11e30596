"""Acceptance: the broker dies; the agent keeps its speed; spans within the buffer arrive after the broker
returns and the drop counter is exact beyond it. Uses a private Tansu we can SIGKILL, its log kept in the
stack's S3 endpoint so the topics survive the crash."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from boltstream.producers.exporter import ExporterConfig, KafkaSpanExporter

BUFFER = 200
PHASE1 = 50
PHASE2 = 500


def test_broker_down_then_back(private_broker: Any, helpers: Any) -> None:
    private_broker.start()
    settings = private_broker.settings
    exporter = KafkaSpanExporter(ExporterConfig(
        settings=settings, buffer_size=BUFFER, request_timeout_ms=2000, retry_backoff_ms=50,
        retry_backoff_max_ms=500, install_rollout_processor=False))
    export_times: list[float] = []
    real_export = exporter.export

    def timed_export(spans: Any) -> Any:
        started = time.perf_counter()
        try:
            return real_export(spans)
        finally:
            export_times.append(time.perf_counter() - started)

    exporter.export = timed_export  # type: ignore[method-assign]
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=10_000, schedule_delay_millis=20,
                                             max_export_batch_size=64))
    tracer = tp.get_tracer("agent")

    def agent_steps(prefix: str, n: int) -> float:
        """The agent's own work: n spans; returns seconds per span on the agent's thread."""
        started = time.perf_counter()
        for i in range(n):
            with tracer.start_as_current_span(f"{prefix}{i:04d}", attributes={"boltstream.rollout_id": "r1"}):
                pass
        return (time.perf_counter() - started) / n

    try:
        up_cost = agent_steps("up", PHASE1)
        tp.force_flush()
        assert exporter.force_flush(15_000), exporter.metrics

        private_broker.kill()
        down_cost = agent_steps("down", PHASE2)
        tp.force_flush()  # every span handed to the exporter; none can be delivered
        m = exporter.metrics
        assert (m.received, m.acked, m.buffered, m.dropped_buffer_full) == (
            PHASE1 + PHASE2, PHASE1, BUFFER, PHASE2 - BUFFER), m
        assert max(export_times) < 0.25, f"export() blocked for {max(export_times):.3f}s"
        assert down_cost < max(10 * up_cost, 0.002), f"agent slowed from {up_cost * 1e6:.0f} to {down_cost * 1e6:.0f} µs/span"
        helpers.poll(lambda: exporter.metrics.send_failures > 0, 30, "the exporter to notice the dead broker")

        private_broker.start()
        assert exporter.force_flush(60_000), exporter.metrics
        m = exporter.metrics
        assert (m.acked, m.dropped, m.dropped_buffer_full, m.buffered) == (PHASE1 + BUFFER, PHASE2 - BUFFER,
                                                                          PHASE2 - BUFFER, 0), m
        assert m.broker_up
        recs = helpers.read_topic(settings, "spans", "Span", count=PHASE1 + BUFFER + 1, timeout=5)
        names = [r["name"] for _, _, r in recs]
        assert sorted(n for n in names if n.startswith("down")) == [f"down{i:04d}" for i in range(BUFFER)], \
            "the first BUFFER spans, each once"
        assert len(names) == PHASE1 + BUFFER, "nothing lost before the crash, no duplicates"
    finally:
        tp.shutdown()
