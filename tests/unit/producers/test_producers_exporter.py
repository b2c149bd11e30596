"""KafkaSpanExporter's contract with the host app, against an in-memory stand-in for the producer.

The real broker is exercised in tests/integration/producers; here the stand-in
lets us fail and heal the "broker" at will and count exactly.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from boltstream.config import Settings
from boltstream.producers.exporter import ExporterConfig, KafkaSpanExporter, RolloutDefaults
from boltstream.producers.sender import partition_for
from boltstream.schemas import Codec


class FakeBroker:
    def __init__(self) -> None:
        self.suppressed: list[bool] = []
        self.up = True
        self.records: list[tuple[int, bytes, bytes]] = []
        self.reject_bigger_than: int | None = None
        self.lock = threading.Lock()


class FakeBatch:
    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes]] = []

    def append(self, *, key: bytes, value: bytes, timestamp: int) -> object | None:
        if len(self.records) >= 100:
            return None
        self.records.append((key, value))
        return object()

    def close(self) -> None:
        return None


class FakeProducer:
    def __init__(self, broker: FakeBroker) -> None:
        self.broker = broker

    async def start(self) -> None:
        if not self.broker.up:
            raise KafkaConnectionError("down")

    async def stop(self) -> None:
        return None

    async def partitions_for(self, topic: str) -> set[int]:
        if not self.broker.up:
            raise KafkaTimeoutError()
        return {0, 1, 2}

    def create_batch(self) -> FakeBatch:
        return FakeBatch()

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # what an aiokafka instrumentation would check before tracing this call
        self.broker.suppressed.append(bool(otel_context.get_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY)))
        limit = self.broker.reject_bigger_than
        if not self.broker.up:
            fut.set_exception(KafkaTimeoutError())
        elif limit is not None and any(len(v) > limit for _, v in batch.records):
            fut.set_exception(MessageSizeTooLargeError())
        else:
            with self.broker.lock:
                self.broker.records.extend((partition, k, v) for k, v in batch.records)
            fut.set_result(None)
        return fut


def make_exporter(broker: FakeBroker, **kw: Any) -> KafkaSpanExporter:
    cfg = ExporterConfig(settings=Settings(namespace="u."), install_rollout_processor=False,
                         retry_backoff_ms=5, retry_backoff_max_ms=20, **kw)
    exp = KafkaSpanExporter(cfg)
    exp._make_producer = lambda: FakeProducer(broker)  # type: ignore[method-assign]
    return exp


def make_spans(n: int, **attrs: Any) -> list[ReadableSpan]:
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("t")
    for i in range(n):
        with tracer.start_as_current_span(f"s{i}", attributes={"boltstream.rollout_id": f"r{i % 7}", **attrs}):
            pass
    return list(mem.get_finished_spans())


@pytest.fixture
def broker() -> FakeBroker:
    return FakeBroker()


@pytest.fixture
def exporter(broker: FakeBroker) -> Iterator[KafkaSpanExporter]:
    exp = make_exporter(broker, buffer_size=100)
    yield exp
    exp.shutdown()


def test_delivers_in_order_keyed_by_rollout(exporter: KafkaSpanExporter, broker: FakeBroker) -> None:
    spans = make_spans(50)
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert exporter.force_flush(5000)
    codec = Codec()
    names_by_key: dict[bytes, list[str]] = {}
    partition_of: dict[bytes, set[int]] = {}
    for p, key, value in broker.records:
        names_by_key.setdefault(key, []).append(codec.decode(value, expect="Span")["name"])
        partition_of.setdefault(key, set()).add(p)
    assert sum(len(v) for v in names_by_key.values()) == 50
    assert names_by_key[b"r0"] == [f"s{i}" for i in range(0, 50, 7)]
    assert all(len(p) == 1 for p in partition_of.values()), "one key, one partition"
    m = exporter.metrics
    assert (m.received, m.acked, m.dropped, m.buffered) == (50, 50, 0, 0)
    assert broker.suppressed and all(broker.suppressed), "our own produce calls must never be traced"


def test_many_rounds_and_full_batches_keep_each_rollouts_order(broker: FakeBroker) -> None:
    """More spans than one encoding chunk and than one record batch (100 here) per partition."""
    exp = make_exporter(broker, buffer_size=5_000, batch_size=700)
    try:
        spans = make_spans(1_500)
        for i in range(0, 1_500, 512):
            assert exp.export(spans[i:i + 512]) is SpanExportResult.SUCCESS
        assert exp.force_flush(10_000)
        codec = Codec()
        names_by_key: dict[bytes, list[str]] = {}
        for _, key, value in broker.records:
            names_by_key.setdefault(key, []).append(codec.decode(value, expect="Span")["name"])
        for r in range(7):
            assert names_by_key[f"r{r}".encode()] == [f"s{i}" for i in range(r, 1_500, 7)]
        m = exp.metrics
        assert (m.received, m.acked, m.dropped, m.buffered) == (1_500, 1_500, 0, 0)
    finally:
        exp.shutdown()


def test_broker_down_buffers_then_delivers_and_counts_drops_exactly(
        exporter: KafkaSpanExporter, broker: FakeBroker) -> None:
    broker.up = False
    spans = make_spans(130)
    started = time.perf_counter()
    results = [exporter.export(spans[i:i + 10]) for i in range(0, 130, 10)]
    assert time.perf_counter() - started < 0.5, "export() must not wait for the broker"
    assert results.count(SpanExportResult.FAILURE) == 3  # the calls that overflowed the buffer
    assert not exporter.force_flush(200)
    m = exporter.metrics
    assert (m.received, m.buffered, m.dropped_buffer_full, m.acked) == (130, 100, 30, 0)
    assert m.send_failures >= 1 and not m.broker_up
    broker.up = True
    assert exporter.force_flush(5000)
    m = exporter.metrics
    assert (m.acked, m.dropped, m.buffered) == (100, 30, 0) and m.broker_up
    delivered = sorted(Codec().decode(v, expect="Span")["name"] for _, _, v in broker.records)
    assert delivered == sorted(f"s{i}" for i in range(100)), "the oldest spans are kept, the newest dropped"


def test_failed_rounds_are_retried_not_lost(exporter: KafkaSpanExporter, broker: FakeBroker) -> None:
    exporter.export(make_spans(20))
    assert exporter.force_flush(5000)
    broker.up = False
    exporter.export(make_spans(20))
    deadline = time.monotonic() + 5
    while exporter.metrics.send_failures == 0 and time.monotonic() < deadline:
        exporter.force_flush(20)
    broker.up = True
    assert exporter.force_flush(5000)
    assert exporter.metrics.acked == 40 and len(broker.records) == 40


def test_size_rejections_are_counted(broker: FakeBroker) -> None:
    exp = make_exporter(broker)
    try:
        broker.reject_bigger_than = 10
        exp.export(make_spans(1))
        assert exp.force_flush(5000)
        assert exp.metrics.dropped_rejected == 1
    finally:
        exp.shutdown()


def test_oversized_spans_are_truncated_with_marker(broker: FakeBroker) -> None:
    exp = make_exporter(broker)
    exp.settings = Settings(namespace="u.", max_message_bytes=4096)
    try:
        exp.export(make_spans(1, big="x" * 20_000))
        assert exp.force_flush(5000)
        (_, _, value), = broker.records
        rec = Codec().decode(value, expect="Span")
        assert len(value) <= 4096 and rec["attributes"]["boltstream.truncated"] is True
        assert "big" not in rec["attributes"] and exp.metrics.truncated == 1
    finally:
        exp.shutdown()


def test_export_never_raises(exporter: KafkaSpanExporter, broker: FakeBroker) -> None:
    class Broken:
        name = "broken"

        def __getattr__(self, item: str) -> Any:
            raise RuntimeError("boom")

    assert exporter.export([Broken(), *make_spans(2)]) is SpanExportResult.SUCCESS  # type: ignore[list-item]
    assert exporter.force_flush(5000)
    m = exporter.metrics
    assert m.dropped_encode_error == 1 and m.acked == 2


def test_shutdown_twice_and_export_after(broker: FakeBroker) -> None:
    exp = make_exporter(broker)
    exp.export(make_spans(3))
    exp.shutdown()
    exp.shutdown()
    assert exp.export(make_spans(2)) is SpanExportResult.FAILURE
    assert exp.force_flush(10)
    m = exp.metrics
    assert m.acked == 3 and m.dropped_shutdown == 2
    assert not any(t.name == "boltstream-exporter" and t.is_alive() for t in threading.enumerate()
                   if t is exp._thread)


def test_shutdown_is_bounded_when_the_broker_never_comes(broker: FakeBroker) -> None:
    broker.up = False
    exp = make_exporter(broker, flush_timeout_ms=200)
    exp.export(make_spans(5))
    started = time.perf_counter()
    exp.shutdown()
    assert time.perf_counter() - started < 3
    assert exp.metrics.dropped_shutdown == 5


# Partitions the sender's own murmur2 picked before it used aiokafka's: a key must not move.
PARTITION_KEYS = [b"", b"a", b"ab", b"abc", b"abcd", b"rollout-1", b"9f1c3a52-8d4e-5b7a-9c2d-0e1f2a3b4c5d",
                  "ü✓-session".encode(), b"ab" * 16, b"\xff" * 7]
PARTITIONS = {1: [0] * 10, 4: [1, 0, 2, 3, 0, 1, 2, 2, 3, 3], 12: [9, 4, 2, 3, 8, 5, 2, 10, 7, 7]}


@pytest.mark.parametrize("n", sorted(PARTITIONS))
def test_a_key_goes_to_the_partition_it_always_went_to(n: int) -> None:
    assert [partition_for(k, list(range(n))) for k in PARTITION_KEYS] == PARTITIONS[n]


def test_constructible_from_env_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("BOLTSTREAM_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("BOLTSTREAM_NAMESPACE", "envns.")
    monkeypatch.setenv("BOLTSTREAM_EXPORTER_BUFFER_SIZE", "7")
    monkeypatch.setenv("BOLTSTREAM_ROLLOUT_ID", "from-env")
    monkeypatch.setenv("BOLTSTREAM_STATE_FILE", str(tmp_path / "none.json"))
    exp = KafkaSpanExporter()
    try:
        assert exp.topic == "envns.spans" and exp.config.buffer_size == 7
        assert exp.config.defaults.rollout_id == "from-env"
    finally:
        exp.shutdown()


def test_a_process_given_a_rollout_id_ends_it_at_shutdown(broker: FakeBroker, caplog: pytest.LogCaptureFixture) -> None:
    """One process = one rollout (env ids): shutdown sends ``boltstream.rollout.end`` with the ids, after the
    process's own spans on the same key, and says so; twice shut down, one marker."""
    exp = make_exporter(broker, defaults=RolloutDefaults(rollout_id="ro-env", attempt_id="a:0", task_id="t"))
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    with tp.get_tracer("t").start_as_current_span("agent"):
        pass
    assert exp.export(mem.get_finished_spans()) is SpanExportResult.SUCCESS
    with caplog.at_level("INFO", logger="boltstream.producers.exporter"):
        exp.shutdown()
        exp.shutdown()
    codec = Codec()
    spans = [(p, k, codec.decode(v, expect="Span")) for p, k, v in broker.records]
    assert [(k, s["name"]) for _, k, s in spans] == [(b"ro-env", "agent"), (b"ro-env", "boltstream.rollout.end")]
    assert spans[0][0] == spans[1][0], "one key, one partition: the marker comes after the process's spans"
    end = spans[1][2]
    assert (end["rollout_id"], end["attempt_id"], end["task_id"]) == ("ro-env", "a:0", "t")
    assert not end["parent_span_id"] and end["trace_id"] != spans[0][2]["trace_id"]
    assert "rollout ro-env ended with the process: end marker sent" in caplog.text


@pytest.mark.parametrize("case", ["no env id", "nothing exported"])
def test_no_end_marker_without_an_env_rollout_or_a_span(broker: FakeBroker, case: str) -> None:
    defaults = RolloutDefaults() if case == "no env id" else RolloutDefaults(rollout_id="ro-env")
    exp = make_exporter(broker, defaults=defaults)
    if case == "no env id":
        exp.export(make_spans(2))
    exp.shutdown()
    names = [Codec().decode(v, expect="Span")["name"] for _, _, v in broker.records]
    assert "boltstream.rollout.end" not in names and len(names) == (2 if case == "no env id" else 0)


def test_the_end_marker_never_raises_into_the_host(broker: FakeBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    from boltstream.producers import rollout_end

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no resource")

    monkeypatch.setattr(rollout_end, "end_marker", broken)
    exp = make_exporter(broker, defaults=RolloutDefaults(rollout_id="ro-env"))
    exp.export(make_spans(1))
    exp.shutdown()  # logged, not raised; the process's own span is still delivered
    assert exp.metrics.acked == 1
