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
* With a spool (``BOLTSTREAM_EXPORTER_SPOOL_DIR``, :mod:`.spool`) every encoded span is
  written to disk before it is sent: an outage longer than the buffer, or a
  restart of the process, loses nothing; what ``shutdown()`` cannot deliver
  stays on disk and is sent first by the next process using the directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from boltstream.config import Settings, load, opt
from boltstream.errors import ConfigError
from boltstream.schemas import records

from . import exporter_metrics, otel_internals
from .normalise import SpanNormaliser
from .propagation import install_rollout_propagator
from .rollout_processor import install_rollout_processor
from .sender import Counters, Encoded, KafkaSender, SpanBuffer
from .span_encoder import SpanRecordEncoder
from .spool import Spool, SpoolError, spool_directory
from .truncate import DEFAULT_MAX_ATTRIBUTE_BYTES

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
    buffer_size: int = opt(50_000, "spans held in memory until the broker acks them; what does not fit is "
                                   "dropped and counted (a spool keeps them instead)")
    batch_size: int = opt(2_000, "most spans encoded and produced together by the sender thread")
    export_timeout_ms: int = opt(100, "longest export() waits for the buffer's lock before dropping (counted)")
    flush_timeout_ms: int = opt(10_000, "longest force_flush()/shutdown() waits for the broker's acks")
    request_timeout_ms: int = opt(15_000, "the producer's wait for one broker request")
    retry_backoff_ms: int = opt(100, "first pause before producing again after a failed batch")
    retry_backoff_max_ms: int = opt(5_000, "longest pause between retries (the pause doubles up to it)")
    linger_ms: int = opt(2, "how long the producer waits to fill a batch")
    install_rollout_processor: bool = opt(True, "stamp rollout/attempt/task ids from the context on every span "
                                                "and propagate them to the inference worker")
    max_attribute_bytes: int = opt(DEFAULT_MAX_ATTRIBUTE_BYTES, "longest attribute value kept whole, in bytes; "
                                   "longer ones are cut and marked boltstream.truncated (0: no limit)")
    spool_dir: str | None = opt(None, "directory of the on-disk spool that keeps spans through broker outages "
                                      "and restarts ('auto': $XDG_STATE_HOME/boltstream/spool/<topic>; "
                                      "unset or 'off': no spool)")
    spool_max_bytes: int = opt(1 << 30, "spool size bound; when full the oldest segment is dropped (counted)")
    spool_segment_bytes: int = opt(16 << 20, "spool segment file size (a segment is deleted once all acked)")
    spool_fsync: bool = opt(False, "fsync every spool write: survives a machine crash, not only a process "
                                   "crash, at the cost of a disk flush per batch")

    def __post_init__(self) -> None:
        for name in ("buffer_size", "batch_size", "export_timeout_ms", "request_timeout_ms", "retry_backoff_ms",
                     "spool_segment_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.env_prefix}{name.upper()}", getattr(self, name), "must be >= 1")
        if self.spool_max_bytes < 2 * self.spool_segment_bytes:
            raise ConfigError(f"{self.env_prefix}SPOOL_MAX_BYTES", self.spool_max_bytes,
                              f"must be >= 2 x SPOOL_SEGMENT_BYTES ({self.spool_segment_bytes})")

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
    spooled: int = 0  # spans written to the spool (every span, when it is on)
    replayed: int = 0  # spooled spans read back from disk and sent (after an outage or a restart)
    spool_pending: int = 0  # spans in the spool not yet acked (this run's and earlier runs')
    spool_bytes: int = 0
    dropped_spool_full: int = 0
    dropped_spool_error: int = 0

    @property
    def dropped(self) -> int:
        return (self.dropped_buffer_full + self.dropped_encode_error + self.dropped_rejected
                + self.dropped_shutdown + self.dropped_spool_full + self.dropped_spool_error)


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
        self._spool: Spool | None = None
        if config.install_rollout_processor:  # and the propagator: the worker must see the same ids
            install_rollout_processor()
            install_rollout_propagator(config.defaults.ids)
        # OTel metric instruments in the host's own MeterProvider (no-op without one).
        self.instruments = exporter_metrics.install(self)
        if spool_directory(config.spool_dir, self.topic) is not None:
            self._ensure_thread()  # a previous run's spool is delivered now, not at the first span
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
        self._spool = None  # the parent's; the child claims a lane of its own

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
        otel_internals.suppress_instrumentation()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._spool = self._open_spool()
            self._sender = KafkaSender(
                self._buffer, self.topic, self._encode_batch, self._make_producer,
                batch_size=self.config.batch_size,
                backoff_s=self.config.retry_backoff_ms / 1000,
                backoff_max_s=max(self.config.retry_backoff_max_ms, self.config.retry_backoff_ms) / 1000,
                spool=self._spool,
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

    def _open_spool(self) -> Spool | None:
        directory = spool_directory(self.config.spool_dir, self.topic)
        if directory is None:
            return None
        try:
            spool = Spool(directory, self._counters, max_bytes=self.config.spool_max_bytes,
                          segment_bytes=self.config.spool_segment_bytes, fsync=self.config.spool_fsync)
        except SpoolError as exc:
            log.error("boltstream exporter: %s; running without a spool (an outage longer than the "
                      "buffer loses spans)", exc)
            return None
        log.info("boltstream exporter: spooling to %s", spool.dir)
        return spool

    def _make_producer(self) -> Any:
        from aiokafka import AIOKafkaProducer

        from boltstream.broker.kafka import producer_kwargs

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
            self._encoder = (normaliser, SpanRecordEncoder(self.settings, self._codec,
                                                                     self.config.max_attribute_bytes))
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
            spool = self._spool
            if self._thread is None or self._stopped:
                return self._buffer.unacked == 0 and (spool is None or spool.pending == 0)
            loop, sender = self._loop, self._sender
            if loop is not None and sender is not None and not loop.is_closed():
                loop.call_soon_threadsafe(sender.wake)
            return self._wait_delivered(max(0, timeout_millis) / 1000)
        except Exception:
            log.exception("boltstream exporter: force_flush failed")
            return False

    def _wait_delivered(self, timeout: float) -> bool:
        """Everything accepted before the call acked (in spool mode: spilled to disk, then acked)."""
        deadline = time.monotonic() + timeout
        if not self._buffer.wait_empty(timeout):
            return False
        spool = self._spool
        return spool is None or spool.wait_settled(max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        """End the process's rollout (env ids), flush (bounded by ``flush_timeout_ms``), stop the loop,
        count what was left as dropped."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self._end_rollout()
        except Exception:  # the flush below must still happen
            log.exception("boltstream exporter: could not mark the rollout ended")
        try:
            if self._thread is not None:
                self._wait_delivered(self.config.flush_timeout_ms / 1000)
                loop, sender = self._loop, self._sender
                if loop is not None and sender is not None and not loop.is_closed():
                    try:
                        loop.call_soon_threadsafe(sender.request_stop)
                    except RuntimeError:  # the loop closed in between
                        pass
                self._thread.join(timeout=5.0)
                if self._thread.is_alive():
                    log.warning("boltstream exporter: sender thread did not stop within 5 s")
                elif self._spool is not None:
                    self._close_spool(self._spool)
            left = self._buffer.drain_all()
            if left:
                with self._counters.lock:
                    self._counters.dropped_shutdown += left
                log.warning("boltstream exporter: shut down with %d spans undelivered (broker unreachable?)",
                            left)
        except Exception:
            log.exception("boltstream exporter: shutdown failed")

    def _end_rollout(self) -> None:
        """A process given ``BOLTSTREAM_ROLLOUT_ID`` is one rollout: its exit ends it (:mod:`.rollout_end`).
        Only after spans of its own were exported (a process that traced nothing has no rollout)."""
        ids = self.config.defaults.ids
        if records.ROLLOUT_ID not in ids or self._thread is None or self._counters.received == 0:
            return
        from .rollout_end import end_marker

        if self._buffer.offer([end_marker(ids)], self.config.export_timeout_ms / 1000):
            log.warning("boltstream exporter: buffer full; rollout %s not marked ended (it closes after the "
                        "stream app's session_idle_s)", ids[records.ROLLOUT_ID])
            return
        loop, sender = self._loop, self._sender
        if loop is not None and sender is not None and not loop.is_closed():
            loop.call_soon_threadsafe(sender.wake)
        log.info("boltstream exporter: rollout %s ended with the process: end marker sent",
                 ids[records.ROLLOUT_ID])

    def _close_spool(self, spool: Spool) -> None:
        """The sender has stopped: spans still in memory go to disk too, for the next start."""
        while self._buffer.has_raw():
            raw = self._buffer.take(self.config.batch_size)
            try:
                spool.append(self._encode_batch(raw))
            except OSError as exc:
                log.error("boltstream exporter: cannot write to the spool %s: %s", spool.dir, exc)
                break
            self._buffer.done(len(raw))
        if spool.pending:
            log.warning("boltstream exporter: shut down with %d spans in the spool %s; the next start "
                        "using it delivers them", spool.pending, spool.dir)
        spool.close()

    @property
    def metrics(self) -> ExporterMetrics:
        c = self._counters
        spool = self._spool
        with c.lock:
            return ExporterMetrics(
                received=c.received, acked=c.acked, buffered=self._buffer.unacked,
                dropped_buffer_full=c.dropped_buffer_full, dropped_encode_error=c.dropped_encode_error,
                dropped_rejected=c.dropped_rejected, dropped_shutdown=c.dropped_shutdown,
                truncated=c.truncated, send_failures=c.send_failures, retried=c.retried,
                broker_up=c.broker_up, last_error=c.last_error, spooled=c.spooled, replayed=c.replayed,
                spool_pending=spool.pending if spool is not None else 0,
                spool_bytes=spool.size_bytes if spool is not None else 0,
                dropped_spool_full=c.dropped_spool_full, dropped_spool_error=c.dropped_spool_error)

    def metrics_dict(self) -> Mapping[str, Any]:
        """The snapshot as a plain dict (for logs/JSON), including the ``dropped`` total."""
        m = self.metrics
        return {**dataclasses.asdict(m), "dropped": m.dropped}
