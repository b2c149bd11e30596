"""The runner's Prometheus metrics (``GET /metrics`` on ``--metrics-port``).

A registry per :class:`RunnerMetrics`, so several runners in one process (tests)
never collide. The runner records on its event loop; prometheus_client's metrics
are thread-safe for the scrape thread. The runner's own span exporter is reported
here too (:meth:`RunnerMetrics.watch_exporter`), under the names a Prometheus
exporter gives the exporter's OTel instruments in an agent (producers/exporter_metrics.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from boltstream.monitoring.metrics_server import MetricsServer

from .exporter_metrics import observations

log = logging.getLogger(__name__)

# An attempt's end, as its root span's boltstream.status says (cancelled: the runner shut down mid-attempt).
STATUSES = ("ok", "failed", "timeout", "cancelled")


class RunnerMetrics(MetricsServer):
    """Attempts running and ended by status, tasks started, tasks retried elsewhere, undecodable tasks."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.running = Gauge("boltstream_runner_attempts_running", "agent attempts running now", registry=r)
        self.attempts = Counter("boltstream_runner_attempts_total", "agent attempts ended, by status",
                                ["status"], registry=r)
        for status in STATUSES:  # every status is a series from the start (rate() needs the zero)
            self.attempts.labels(status)
        self.tasks = Counter("boltstream_runner_tasks_total", "tasks started (each runs group_size attempts)",
                             registry=r)
        self.retried = Counter("boltstream_runner_tasks_retried_total",
                               "running tasks whose partition moved to another runner, which runs them again "
                               "(same attempt ids)", registry=r)
        self.dead_letters = Counter("boltstream_runner_dead_letters_total", "undecodable tasks dead-lettered",
                                    registry=r)

    def watch_exporter(self, exporter: Any) -> None:
        """Report ``exporter``'s counters (read at each scrape from its consistent snapshot)."""
        self.registry.register(_ExporterCollector(exporter))


class _ExporterCollector(Collector):
    def __init__(self, exporter: Any) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        obs = observations(self.exporter.metrics, str(self.exporter.topic))
        families = (
            ("received", CounterMetricFamily, "boltstream_exporter_spans_received", "spans handed to the exporter"),
            ("acked", CounterMetricFamily, "boltstream_exporter_spans_acked", "spans acknowledged by the broker"),
            ("dropped", CounterMetricFamily, "boltstream_exporter_spans_dropped", "spans lost, by cause"),
            ("spool_bytes", GaugeMetricFamily, "boltstream_exporter_spool_size_bytes", "bytes in the on-disk spool"),
            ("spool_pending", GaugeMetricFamily, "boltstream_exporter_spool_pending",
             "spans in the spool not yet acknowledged"),
        )
        for key, kind, name, doc in families:
            labels = sorted(obs[key][0][1])
            family = kind(name, doc, labels=labels)
            for value, attrs in obs[key]:
                family.add_metric([attrs[k] for k in labels], value)
            yield family
