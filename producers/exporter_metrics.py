"""The span exporter's OpenTelemetry metric instruments (in the host agent's own metrics pipeline).

Why OTel metrics and not Prometheus: the exporter lives inside someone else's
process. It must not open a port there; it reports through whatever
``MeterProvider`` the application set up (OTLP, Prometheus, console ...). With
none, :func:`opentelemetry.metrics.get_meter` hands out no-op instruments and the
callbacks are never called.

The instruments are asynchronous (observable): each collection reads one
consistent :attr:`KafkaSpanExporter.metrics` snapshot, so the send path counts
nothing twice and pays nothing. A callback never raises into the host's SDK: a
failure is logged once and the collection reports nothing for it. The exporter
is held weakly: the meter keeps the callbacks, not the exporter.

Instruments (OTel names; a Prometheus exporter shows them with ``_`` for ``.``, ``_total``
on counters and its unit suffix, e.g. ``boltstream_exporter_spans_received_total`` and
``boltstream_exporter_spool_size_bytes``): ``boltstream.exporter.spans.received``,
``.acked``, ``.dropped`` (attribute ``cause``), ``boltstream.exporter.spool.size``
(bytes) and ``boltstream.exporter.spool.pending`` (spans), each with attribute ``topic``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics

log = logging.getLogger(__name__)

METER_NAME = "boltstream.exporter"
# ExporterMetrics field -> the ``cause`` label of the dropped counter.
DROP_CAUSES = {
    "dropped_buffer_full": "buffer_full",
    "dropped_encode_error": "encode_error",
    "dropped_rejected": "rejected",
    "dropped_shutdown": "shutdown",
    "dropped_spool_full": "spool_full",
    "dropped_spool_error": "spool_error",
}


def observations(snapshot: Any, topic: str) -> dict[str, list[tuple[int, dict[str, str]]]]:
    """Instrument name -> (value, attributes) of one snapshot (pure: the callbacks' whole logic)."""
    attrs = {"topic": topic}
    return {
        "received": [(snapshot.received, attrs)],
        "acked": [(snapshot.acked, attrs)],
        "dropped": [(getattr(snapshot, field), {**attrs, "cause": cause}) for field, cause in DROP_CAUSES.items()],
        "spool_bytes": [(snapshot.spool_bytes, attrs)],
        "spool_pending": [(snapshot.spool_pending, attrs)],
    }


class ExporterInstruments:
    """Registers the observable instruments for one exporter; :meth:`observe` is every callback's body."""

    def __init__(self, exporter: Any, meter_provider: Any = None) -> None:
        self._exporter = weakref.ref(exporter)
        self._topic = str(getattr(exporter, "topic", ""))
        self._warned = False
        meter = metrics.get_meter(METER_NAME, meter_provider=meter_provider)
        self.instruments = [
            meter.create_observable_counter("boltstream.exporter.spans.received", [self._callback("received")],
                                            unit="{span}", description="spans handed to the exporter"),
            meter.create_observable_counter("boltstream.exporter.spans.acked", [self._callback("acked")],
                                            unit="{span}", description="spans acknowledged by the broker"),
            meter.create_observable_counter("boltstream.exporter.spans.dropped", [self._callback("dropped")],
                                            unit="{span}", description="spans lost, by cause"),
            meter.create_observable_up_down_counter(
                "boltstream.exporter.spool.size", [self._callback("spool_bytes")], unit="By",
                description="bytes in the on-disk spool"),
            meter.create_observable_up_down_counter(
                "boltstream.exporter.spool.pending", [self._callback("spool_pending")], unit="{span}",
                description="spans in the spool not yet acknowledged"),
        ]

    def _callback(self, name: str) -> Callable[[Any], Iterable[metrics.Observation]]:
        def callback(options: Any) -> Iterable[metrics.Observation]:
            return self.observe(name)
        return callback

    def observe(self, name: str) -> list[metrics.Observation]:
        exporter = self._exporter()
        if exporter is None:
            return []
        try:
            values = observations(exporter.metrics, self._topic)[name]
        except Exception:  # never into the host's metrics pipeline
            if not self._warned:
                self._warned = True
                log.exception("boltstream exporter: cannot read its metrics for OpenTelemetry")
            return []
        return [metrics.Observation(value, attributes) for value, attributes in values]


def install(exporter: Any, meter_provider: Any = None) -> ExporterInstruments | None:
    """Create the instruments for ``exporter``; None (logged) if the metrics API itself fails."""
    try:
        return ExporterInstruments(exporter, meter_provider)
    except Exception:
        log.exception("boltstream exporter: cannot create its OpenTelemetry metric instruments")
        return None
