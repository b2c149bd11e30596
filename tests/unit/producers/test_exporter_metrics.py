"""The exporter's OTel instruments: read by the host's MeterProvider, silent without one, never raising."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from boltstream.config import Settings
from boltstream.producers import exporter_metrics
from boltstream.producers.exporter import ExporterConfig, KafkaSpanExporter


def points(reader: InMemoryMetricReader) -> dict[tuple[str, tuple[tuple[str, Any], ...]], float]:
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    out[(metric.name, tuple(sorted(p.attributes.items())))] = p.value
    return out


def exporter() -> KafkaSpanExporter:
    return KafkaSpanExporter(ExporterConfig(settings=Settings(namespace="u."), install_rollout_processor=False,
                                            spool_dir="off"))


def test_instruments_report_the_counters() -> None:
    exp = exporter()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    exporter_metrics.install(exp, provider)
    exp._counters.received, exp._counters.acked, exp._counters.dropped_buffer_full = 7, 5, 2
    p = points(reader)
    topic = ("topic", "u.spans")
    assert p[("boltstream.exporter.spans.received", (topic,))] == 7
    assert p[("boltstream.exporter.spans.acked", (topic,))] == 5
    assert p[("boltstream.exporter.spans.dropped", (("cause", "buffer_full"), topic))] == 2
    assert p[("boltstream.exporter.spans.dropped", (("cause", "spool_full"), topic))] == 0
    assert p[("boltstream.exporter.spool.size", (topic,))] == 0
    provider.shutdown()
    exp.shutdown()


def test_a_failing_snapshot_reports_nothing_and_never_raises() -> None:
    class Broken:
        topic = "x"

        @property
        def metrics(self) -> Any:
            raise RuntimeError("boom")

    broken = Broken()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    inst = exporter_metrics.install(broken, provider)
    assert inst is not None
    assert inst.observe("received") == []
    assert points(reader) == {}
    provider.shutdown()


def test_no_meter_provider_is_a_no_op() -> None:
    exp = exporter()  # the global API provider: a proxy with no SDK behind it
    assert exp.instruments is not None
    exp.shutdown()


def test_the_runner_shows_its_exporter_under_the_prometheus_names() -> None:
    from prometheus_client import generate_latest

    from boltstream.producers.runner_metrics import RunnerMetrics

    exp = exporter()
    exp._counters.received, exp._counters.dropped_rejected = 4, 1
    m = RunnerMetrics()
    m.watch_exporter(exp)
    text = generate_latest(m.registry).decode()
    assert 'boltstream_exporter_spans_received_total{topic="u.spans"} 4.0' in text
    assert 'boltstream_exporter_spans_dropped_total{cause="rejected",topic="u.spans"} 1.0' in text
    assert 'boltstream_exporter_spool_size_bytes{topic="u.spans"} 0.0' in text
    exp.shutdown()
