"""``KafkaSpanExporter``: the OpenTelemetry exporter that feeds boltstream's ``spans`` topic.

Works with no code change: ``OTEL_TRACES_EXPORTER=boltstream opentelemetry-instrument
python agent.py`` finds it through the ``opentelemetry_traces_exporter`` entry
point and constructs it with no arguments; everything comes from
``BOLTSTREAM_*`` environment variables (or a running embedded stack's state
file) through :func:`boltstream.config.load`.

What the host application can rely on (modelled on OTel's OTLP/HTTP exporter
and aiokafka's producer/sender split):

* ``export()`` never raises and never waits on the network: it hands the spans
  to a bounded buffer and returns (the only wait is a lock held for O(1) work,
  bounded by ``export_timeout_ms``).
* One private asyncio loop in one daemon thread owns the ``AIOKafkaProducer``
  (never ``asyncio.run`` per batch). Its context suppresses instrumentation,
  so an instrumented aiokafka/socket layer does not trace our own produce calls.
* While the broker is unreachable spans stay in the buffer (``buffer_size``)
  and are retried with exponential backoff; what does not fit is dropped and
  counted exactly (:attr:`KafkaSpanExporter.metrics`, logged).
* Spans over the broker's message size are truncated with the marker
  ``boltstream.truncated=true``, never dropped silently.
* ``force_flush()`` and ``shutdown()`` are bounded and safe to call repeatedly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from boltstream.config import Settings, load
from boltstream.errors import ConfigError
from boltstream.schemas import records

from .normalise import SpanNormaliser
from .propagation import install_rollout_propagator
from .rollout_processor import install_rollout_processor
from .sender import Counters, Encoded, KafkaSender, SpanBuffer
from .span_encoder import SpanRecordEncoder

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RolloutDefaults:
    """Ids stamped on spans that carry none: for an agent process that IS one rollout, set by env only."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_"
    rollout_id: str | None = None
    attempt_id: str | None = None
    task_id: str | None = None

    @property
    def ids(self) -> dict[str, str]:
        """The ids that are set, under their span attribute names."""
        values = (self.rollout_id, self.attempt_id, self.task_id)
        return {k: v for k, v in zip(records.ID_ATTRIBUTES, values, strict=True) if v}


@dataclasses.dataclass(frozen=True)
class ExporterConfig:
    """Exporter knobs (``BOLTSTREAM_EXPORTER_*``) plus the process' :class:`Settings` (``BOLTSTREAM_*``)."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_EXPORTER_"
    settings: Settings = dataclasses.field(default_factory=Settings)
    defaults: RolloutDefaults = dataclasses.field(default_factory=RolloutDefaults)
    buffer_size: int = 50_000
    batch_size: int = 2_000
    export_timeout_ms: int = 100
    flush_timeout_ms: int = 10_000
    request_timeout_ms: int = 15_000
    retry_backoff_ms: int = 100
    retry_backoff_max_ms: int = 5_000
    linger_ms: int = 2
    install_rollout_processor: bool = True

    def __post_init__(self) -> None:
        for name in ("buffer_size", "batch_size", "export_timeout_ms", "request_timeout_ms", "retry_backoff_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.env_prefix}{name.upper()}", getattr(self, name), "must be >= 1")

    @classmethod
    def load(cls, **explicit: Any) -> ExporterConfig:
        """Resolve by explicit > env > stack state > default (see :func:`boltstream.config.load`)."""
        return load(cls, explicit)


@dataclasses.dataclass(frozen=True)
class ExporterMetrics:
    """A consistent snapshot of the exporter's counters. ``dropped`` is the sum of every drop reason."""

    received: int
    acked: int
    buffered: int
    dropped_buffer_full: int
    dropped_encode_error: int
    dropped_rejected: int
    dropped_shutdown: int
    truncated: int
    send_failures: int
    retried: int
    broker_up: bool
    last_error: str | None

    @property
    def dropped(self) -> int:
        return (self.dropped_buffer_full + self.dropped_encode_error + self.dropped_rejected
                + self.dropped_shutdown)


class KafkaSpanExporter(SpanExporter):
    """Exports finished spans as ``Span`` Avro records to ``<namespace>spans``, keyed by rollout id."""

    def __init__(self, config: ExporterConfig | None = None, *, settings: Settings | None = None,
                 codec: Any = None, **overrides: Any) -> None:
        if config is None:
            explicit = dict(overrides)
            if settings is not None:
                explicit["settings"] = settings
            config = ExporterConfig.load(**explicit)
        self.config = config
        self.settings = config.settings
        self.topic = config.settings.topic("spans")
        self._codec = codec
        self._counters = Counters()
        self._buffer = SpanBuffer(config.buffer_size, self._counters)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: KafkaSender | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._encoder: Any = None
        if config.install_rollout_processor:  # and the propagator: the worker must see the same ids
            install_rollout_processor()
            install_rollout_propagator(config.defaults.ids)
        if hasattr(os, "register_at_fork"):  # weakly: a fork hook must not keep exporters alive
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: (exp := ref()) is not None and exp._after_fork())

    # ------------------------------------------------------------ lifecycle

    def _after_fork(self) -> None:
        """A forked child has no sender thread: start a fresh one (and buffer) on its first export."""
        self._lock = threading.Lock()
        self._counters = Counters()
        self._buffer = SpanBuffer(self.config.buffer_size, self._counters)
        self._loop = self._sender = self._thread = None

    def _ensure_thread(self) -> bool:
        if self._thread is not None:
            return True
        with self._lock:
            if self._thread is not None:
                return True
            if self._stopped:
                return False
            ready = threading.Event()
            self._thread = threading.Thread(target=self._thread_main, args=(ready,),
                                            name="boltstream-exporter", daemon=True)
            self._thread.start()
        if not ready.wait(5.0):
            log.error("boltstream exporter: sender thread did not start")
        return True

    def _thread_main(self, ready: threading.Event) -> None:
        # Our own Kafka traffic must never become spans (which would be exported, which is traffic...).
        otel_context.attach(otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True))
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._sender = KafkaSender(
                self._buffer, self.topic, self._encode_batch, self._make_producer,
                batch_size=self.config.batch_size,
                backoff_s=self.config.retry_backoff_ms / 1000,
                backoff_max_s=max(self.config.retry_backoff_max_ms, self.config.retry_backoff_ms) / 1000,
            )
            self._loop = loop
            ready.set()
            loop.run_until_complete(self._sender.run())
        except Exception:
            log.exception("boltstream exporter: sender loop crashed; spans will be counted as dropped")
        finally:
            ready.set()
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    def _make_producer(self) -> Any:
        from aiokafka import AIOKafkaProducer

        from boltstream.kafka import producer_kwargs

        return AIOKafkaProducer(**producer_kwargs(
            self.settings,
            request_timeout_ms=self.config.request_timeout_ms,
            retry_backoff_ms=self.config.retry_backoff_ms,
            linger_ms=self.config.linger_ms,
            max_batch_size=self.settings.max_message_bytes,
        ))

    # ------------------------------------------------------------ encoding (sender thread)

    def _get_encoder(self) -> Any:
        if self._encoder is None:

            d = self.config.defaults
            normaliser = SpanNormaliser({"rollout_id": d.rollout_id, "attempt_id": d.attempt_id,
                                         "task_id": d.task_id})
            self._encoder = (normaliser, SpanRecordEncoder(self.settings, self._codec))
        return self._encoder

    def _encode_batch(self, spans: Sequence[Any]) -> list[Encoded]:
        """Normalise + encode; a span that cannot be encoded is counted and logged, never raised."""
        normaliser, encoder = self._get_encoder()
        out: list[Encoded] = []
        append = out.append
        errors = truncated = 0
        for span in spans:
            try:
                key, value, removed = encoder(normaliser(span))
            except Exception as exc:
                errors += 1
                if errors == 1:
                    log.error("boltstream exporter: cannot encode span %r: %s; dropped",
                              getattr(span, "name", "?"), exc, exc_info=True)
                continue
            if removed:
                truncated += 1
                log.warning("boltstream exporter: span %r truncated to %d bytes; removed %s",
                            getattr(span, "name", "?"), len(value), ", ".join(removed[:5]))
            append((key, value))
        if errors or truncated:
            with self._counters.lock:
                self._counters.dropped_encode_error += errors
                self._counters.truncated += truncated
        return out

    # ------------------------------------------------------------ SpanExporter API

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        """Hand spans to the buffer and return at once (SUCCESS unless some had to be dropped)."""
        try:
            if self._stopped:
                with self._counters.lock:
                    self._counters.received += len(spans)
                    self._counters.dropped_shutdown += len(spans)
                return SpanExportResult.FAILURE
            if not spans:
                return SpanExportResult.SUCCESS
            self._ensure_thread()
            dropped = self._buffer.offer(spans, self.config.export_timeout_ms / 1000)
            if dropped:
                self._log_drop(dropped)
            loop, sender = self._loop, self._sender
            if loop is not None and sender is not None:
                loop.call_soon_threadsafe(sender.wake)
            return SpanExportResult.FAILURE if dropped else SpanExportResult.SUCCESS
        except Exception:  # the host application must never see our failure
            log.exception("boltstream exporter: export failed")
            return SpanExportResult.FAILURE

    def _log_drop(self, n: int) -> None:
        m = self._counters
        total = m.dropped_buffer_full
        if total == n or total // 10_000 != (total - n) // 10_000:  # first drop, then every 10k
            log.warning("boltstream exporter: buffer full (%d spans held); dropped %d spans (%d so far)",
                        self._buffer.capacity, n, total)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """True when every accepted span is acked by the broker within the timeout."""
        try:
            if self._thread is None or self._stopped:
                return self._buffer.unacked == 0
            loop, sender = self._loop, self._sender
            if loop is not None and sender is not None and not loop.is_closed():
                loop.call_soon_threadsafe(sender.wake)
            return self._buffer.wait_empty(max(0, timeout_millis) / 1000)
        except Exception:
            log.exception("boltstream exporter: force_flush failed")
            return False

    def shutdown(self) -> None:
        """Flush (bounded by ``flush_timeout_ms``), stop the loop, count what was left as dropped."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            if self._thread is not None:
                self._buffer.wait_empty(self.config.flush_timeout_ms / 1000)
                loop, sender = self._loop, self._sender
                if loop is not None and sender is not None and not loop.is_closed():
                    try:
                        loop.call_soon_threadsafe(sender.request_stop)
                    except RuntimeError:  # the loop closed in between
                        pass
                self._thread.join(timeout=5.0)
                if self._thread.is_alive():
                    log.warning("boltstream exporter: sender thread did not stop within 5 s")
            left = self._buffer.drain_all()
            if left:
                with self._counters.lock:
                    self._counters.dropped_shutdown += left
                log.warning("boltstream exporter: shut down with %d spans undelivered (broker unreachable?)",
                            left)
        except Exception:
            log.exception("boltstream exporter: shutdown failed")

    @property
    def metrics(self) -> ExporterMetrics:
        c = self._counters
        with c.lock:
            return ExporterMetrics(
                received=c.received, acked=c.acked, buffered=self._buffer.unacked,
                dropped_buffer_full=c.dropped_buffer_full, dropped_encode_error=c.dropped_encode_error,
                dropped_rejected=c.dropped_rejected, dropped_shutdown=c.dropped_shutdown,
                truncated=c.truncated, send_failures=c.send_failures, retried=c.retried,
                broker_up=c.broker_up, last_error=c.last_error)

    def metrics_dict(self) -> Mapping[str, Any]:
        """The snapshot as a plain dict (for logs/JSON), including the ``dropped`` total."""
        m = self.metrics
        return {**dataclasses.asdict(m), "dropped": m.dropped}
