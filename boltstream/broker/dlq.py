"""The one writer of dead letters, used by every component (stream app, runner, OTLP ingest, learner).

Why one: input a component cannot use must neither stop it nor vanish. It is kept
whole on the ``dlq`` topic as a DeadLetter (``schemas/dead_letter/v1.avsc``, built
by :func:`boltstream.schemas.records.dead_letter`) with the reason and its origin
topic/partition/offset, keyed by the original key, to inspect or replay. One
builder and one writer, so every component's dead letters fit the broker's
message size and read the same.

Shaped like aiokafka's producer: ``start``/``stop`` or ``async with``, and
:meth:`DeadLetterWriter.send` returns the broker-ack future. A caller that must
not commit the source offset before the dead letter is durable awaits that
future (or, like the stream app, lets its producer flush before the commit).
A failed write is delivered to the future AND logged, so nothing is lost
silently even when nobody awaits it.

The writer either sends through a producer the component already has (the
learner's aiokafka producer, the stream app's Faust producer) or starts its own
aiokafka producer, lazily: most runs never dead-letter anything.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from boltstream.config import Settings
from boltstream.schemas import records

log = logging.getLogger(__name__)

# (topic, key, value) -> awaitable of the broker-ack future, e.g. Faust's
# ``lambda t, k, v: app.producer.send(t, k, v, None, None, None)``.
SendFn = Callable[[str, bytes | None, bytes], Awaitable[Any]]


class DeadLetterWriter:
    """Builds, encodes and sends DeadLetter records for ``component``; counts them by category.

    Pass ``producer`` (an aiokafka producer the caller starts and stops) or ``send``
    (any other producer, see :data:`SendFn`); with neither the writer owns an aiokafka
    producer, started on :meth:`start` or on the first send, stopped on :meth:`stop`.
    """

    def __init__(self, settings: Settings, codec: Any, component: str, *, producer: Any = None,
                 send: SendFn | None = None) -> None:
        if producer is not None and send is not None:
            raise ValueError("DeadLetterWriter: pass producer or send, not both")
        self.settings = settings
        self.codec = codec
        self.component = component
        self.topic = settings.topic("dlq")
        self.max_bytes = settings.max_message_bytes
        # Dead letters by reason category ("undecodable", "no_rollout_id", ...): components report them.
        self.counts: collections.Counter[str] = collections.Counter()
        self.acked = 0
        self.failed = 0
        # A DeadLetter's timestamp: the wall clock, or a replay's event clock (its output is repeatable).
        self.clock_ns: Callable[[], int] = time.time_ns
        self._producer = producer
        self._send = send
        self._owns_producer = producer is None and send is None
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the writer's own producer (no-op when it sends through the caller's)."""
        if not self._owns_producer:
            return
        async with self._start_lock:  # concurrent first sends must not start two producers
            if self._producer is not None:
                return
            from aiokafka import AIOKafkaProducer

            from boltstream.broker.kafka import producer_kwargs

            producer = AIOKafkaProducer(**producer_kwargs(self.settings))
            await producer.start()
            self._producer = producer

    async def stop(self) -> None:
        """Flush and stop the writer's own producer; a caller's producer is left to the caller."""
        if self._owns_producer and self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def __aenter__(self) -> DeadLetterWriter:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def encode(self, reason: str, *, topic: str, partition: int, offset: int, key: bytes | None,
               value: bytes | None) -> bytes:
        """The framed DeadLetter bytes, for a caller that sends them with its other outputs."""
        record = records.dead_letter(reason, component=self.component, topic=topic, partition=partition,
                                     offset=offset, key=key, value=value, max_bytes=self.max_bytes,
                                     now_ns=self.clock_ns())
        return self.codec.encode("DeadLetter", record, topic=self.topic)  # type: ignore[no-any-return]

    async def send(self, reason: str, *, topic: str, partition: int, offset: int, key: bytes | None,
                   value: bytes | None, category: str = "invalid") -> asyncio.Future[Any]:
        """Queue one dead letter; returns the broker-ack future, which carries any failure."""
        self.counts[category] += 1
        log.warning("%s: %s[%d]@%d -> %s: %s", self.component, topic, partition, offset, self.topic, reason)
        try:
            data = self.encode(reason, topic=topic, partition=partition, offset=offset, key=key, value=value)
            future = asyncio.ensure_future(await self._transmit(key, data))
        except Exception as exc:  # refused before it reached the producer: still the caller's to see
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
        future.add_done_callback(lambda f: self._on_ack(f, topic, partition, offset))
        return future

    async def reject(self, record: Any, reason: str, category: str = "invalid") -> asyncio.Future[Any]:
        """Dead-letter a consumed record (aiokafka's or Faust's: topic, partition, offset, key, value) whole."""
        return await self.send(reason, topic=record.topic, partition=record.partition, offset=record.offset,
                               key=record.key, value=record.value, category=category)

    async def _transmit(self, key: bytes | None, data: bytes) -> Any:
        if self._send is not None:
            return await self._send(self.topic, key, data)
        if self._producer is None:
            await self.start()
        return await self._producer.send(self.topic, data, key=key)

    def _on_ack(self, future: asyncio.Future[Any], topic: str, partition: int, offset: int) -> None:
        if future.cancelled():
            self.failed += 1
            log.error("%s: dead letter of %s[%d]@%d cancelled before the broker acked it", self.component, topic,
                      partition, offset)
        elif (exc := future.exception()) is not None:
            self.failed += 1
            log.error("%s: dead letter of %s[%d]@%d not written: %s: %s", self.component, topic, partition, offset,
                      type(exc).__name__, exc)
        else:
            self.acked += 1
