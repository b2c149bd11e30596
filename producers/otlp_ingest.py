"""``boltstream ingest otlp --topic otlp_spans``: re-emit a Collector's OTLP spans as ``Span`` records.

Why: the Collector's ``kafka`` exporter is the way agents in any language (or
apps already wired to a Collector) reach Kafka. This consumer reads that
topic (named exactly as the Collector writes it, not namespaced), decodes
``otlp_proto`` or ``otlp_json`` (auto-detected per message unless
``--encoding`` says), runs every span through the same normaliser as the
in-process exporter and produces to ``<namespace>spans`` keyed by rollout id.

At-least-once: a batch's offsets are committed after every Span it produced
(and every dead letter) is acknowledged. A message that cannot be decoded goes
whole to ``<namespace>dlq`` as a DeadLetter with the reason and its origin.
Consumer group: ``<namespace>otlp-ingest`` unless ``--group-id``; more
processes in the group split the partitions.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import time
from typing import TYPE_CHECKING, Any, ClassVar

from boltstream.config import Settings, flags_from_dataclass, load, opt

from .normalise import normalise
from .otlp_decode import OtlpDecodeError, decode

if TYPE_CHECKING:
    from boltstream.broker.dlq import DeadLetterWriter

log = logging.getLogger(__name__)

ENCODINGS = ("auto", "otlp_proto", "otlp_json")


@dataclasses.dataclass(frozen=True)
class IngestConfig:
    """``BOLTSTREAM_INGEST_*`` knobs plus :class:`Settings`."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_INGEST_"
    settings: Settings = dataclasses.field(default_factory=Settings)
    topic: str = opt("otlp_spans", "topic the Collector writes (not namespaced)")
    encoding: str = opt("auto", "message encoding; auto detects it per message", choices=ENCODINGS)
    group_id: str | None = opt(None, "consumer group (default <namespace>otlp-ingest)")
    exit_when_idle_s: float | None = opt(None, "exit after this long with nothing to read")

    def __post_init__(self) -> None:
        from boltstream.errors import ConfigError

        if self.encoding not in ENCODINGS:
            raise ConfigError("encoding", self.encoding, f"one of {', '.join(ENCODINGS)}")

    @property
    def group(self) -> str:
        return self.group_id or f"{self.settings.namespace}otlp-ingest"


@dataclasses.dataclass
class IngestStats:
    messages: int = 0
    spans: int = 0
    dead_letters: int = 0
    truncated: int = 0


class OtlpIngest:
    def __init__(self, config: IngestConfig) -> None:
        self.config = config
        self.stats = IngestStats()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> IngestStats:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        from boltstream.broker.dlq import DeadLetterWriter
        from boltstream.broker.kafka import consumer_kwargs, producer_kwargs

        from .span_encoder import SpanRecordEncoder

        settings = self.config.settings
        encoder = SpanRecordEncoder(settings)
        dlq = DeadLetterWriter(settings, encoder.codec, "otlp_ingest")  # its producer starts on first use
        consumer = AIOKafkaConsumer(self.config.topic, **consumer_kwargs(settings, self.config.group))
        producer = AIOKafkaProducer(**producer_kwargs(settings, max_batch_size=settings.max_message_bytes))
        await producer.start()
        await consumer.start()
        log.info("ingesting %s (%s) into %s", self.config.topic, self.config.encoding, encoder.topic)
        idle_since = time.monotonic()
        try:
            while not self._stop.is_set():
                batches = await consumer.getmany(timeout_ms=200, max_records=500)
                if not consumer.assignment():
                    idle_since = time.monotonic()  # still joining the group: not idle yet
                if not batches:
                    limit = self.config.exit_when_idle_s
                    if limit is not None and time.monotonic() - idle_since > limit:
                        log.info("idle for %.1fs; exiting", limit)
                        break
                    continue
                idle_since = time.monotonic()
                futures: list[asyncio.Future[Any]] = []
                for records in batches.values():
                    for record in records:
                        futures.extend(await self._one(record, encoder, producer, dlq))
                await asyncio.gather(*futures)
                await consumer.commit()
        finally:
            await consumer.stop()
            await producer.stop()
            await dlq.stop()
        return self.stats

    async def _one(self, record: Any, encoder: Any, producer: Any, dlq: DeadLetterWriter) -> list[Any]:
        """The broker-ack futures of what ``record`` became: its spans, or its dead letter."""
        self.stats.messages += 1
        try:
            encoded, truncated = span_records(record.value, self.config.encoding, encoder)
        except Exception as exc:  # undecodable or unencodable: keep it whole, say why
            self.stats.dead_letters += 1
            return [await dlq.reject(record, f"{type(exc).__name__}: {exc}")]
        self.stats.truncated += truncated
        futures = [await producer.send(encoder.topic, value, key=key) for key, value in encoded]
        self.stats.spans += len(futures)
        return futures


def span_records(value: bytes | None, encoding: str, encoder: Any) -> tuple[list[tuple[bytes, bytes]], int]:
    """One Collector message -> the (key, framed Span) pairs to produce, and how many were truncated.

    Pure, so it can be fuzzed: bad input raises ``OtlpDecodeError`` (the payload) or ``SchemaError``
    (a span the codec refuses); the ingest dead-letters the message whole on either.
    """
    if not value:
        raise OtlpDecodeError("empty message")
    encoded, truncated = [], 0
    for inp in decode(value, encoding):
        key, framed, removed = encoder(normalise(inp))
        truncated += bool(removed)
        encoded.append((key, framed))
    return encoded, truncated


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream ingest", description="Re-emit spans written by other tools.")
    sub = p.add_subparsers(dest="source", required=True)
    o = sub.add_parser("otlp", help="OTLP spans from an OpenTelemetry Collector's kafka exporter")
    flags_from_dataclass(o, IngestConfig)
    return p


def main(argv: list[str]) -> int:
    args = vars(parser().parse_args(argv))
    args.pop("source")
    config = load(IngestConfig, args)
    return asyncio.run(_main(config))


async def _main(config: IngestConfig) -> int:
    ingest = OtlpIngest(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ingest.stop)
    stats = await ingest.run()
    log.info("ingested %d messages: %d spans, %d dead letters, %d truncated", stats.messages, stats.spans,
             stats.dead_letters, stats.truncated)
    return 0
