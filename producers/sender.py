"""The exporter's broker side: a bounded buffer and the coroutine that drains it into Kafka.

Split like aiokafka's producer/sender and OTel's OTLP exporter: the host's
threads only ever touch :class:`SpanBuffer` (a lock, a deque, O(1) per call),
and everything that can wait on the network runs in :class:`KafkaSender` on
the exporter's private event loop. Accounting is exact by construction: a span
is counted once as accepted or dropped when offered, and every accepted span
ends as acked, dropped with a reason, or still held (``unacked``).

Ordering: spans are encoded in arrival order and at most one round of
batches is on the wire at a time; a failed round goes back to the front of
the queue, so a rollout's spans reach their partition in the order they
ended (the root span last) even across broker outages.

With a :class:`~boltstream.producers.spool.Spool` the sender writes every
encoded span to it before sending and sends from it (the spool is the queue);
while the broker is away it keeps moving spans from memory to disk, so the
in-memory buffer never fills and an outage costs disk, not spans.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError
from aiokafka.partitioner import murmur2

if TYPE_CHECKING:
    from .spool import Spool

log = logging.getLogger(__name__)

Encoded = tuple[bytes, bytes]  # (key, value)
ENCODE_CHUNK = 250  # spans encoded between two turns of the sender's loop (~5 ms of CPU)


@dataclass
class Counters:
    """Mutable counters; read through :class:`~boltstream.producers.exporter.ExporterMetrics` snapshots."""

    received: int = 0
    acked: int = 0
    dropped_buffer_full: int = 0
    dropped_encode_error: int = 0
    dropped_rejected: int = 0
    dropped_shutdown: int = 0
    dropped_spool_full: int = 0
    dropped_spool_error: int = 0
    spooled: int = 0
    replayed: int = 0
    truncated: int = 0
    send_failures: int = 0
    retried: int = 0
    last_error: str | None = None
    broker_up: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class SpanBuffer:
    """Bounded, thread-safe hand-off from ``export()`` to the sender. Never blocks for long."""

    def __init__(self, capacity: int, counters: Counters) -> None:
        self.capacity = capacity
        self.counters = counters
        self._raw: collections.deque[Any] = collections.deque()
        self._unacked = 0  # raw + encoded-but-unacked spans
        self._accepted_total = 0  # spans ever accepted / ever finished (acked or dropped): a FIFO watermark
        self._done_total = 0
        self._cond = threading.Condition(threading.Lock())

    def offer(self, spans: Sequence[Any], timeout: float) -> int:
        """Accept as many spans as fit (oldest kept, newest dropped); returns how many were dropped."""
        if not self._cond.acquire(timeout=timeout):
            with self.counters.lock:
                self.counters.received += len(spans)
                self.counters.dropped_buffer_full += len(spans)
            return len(spans)
        try:
            room = max(0, self.capacity - self._unacked)
            take = spans if len(spans) <= room else spans[:room]
            self._raw.extend(take)
            self._unacked += len(take)
            self._accepted_total += len(take)
        finally:
            self._cond.release()
        dropped = len(spans) - len(take)
        with self.counters.lock:
            self.counters.received += len(spans)
            self.counters.dropped_buffer_full += dropped
        return dropped

    def take(self, n: int) -> list[Any]:
        with self._cond:
            k = min(n, len(self._raw))
            return [self._raw.popleft() for _ in range(k)]

    def has_raw(self) -> bool:
        return bool(self._raw)

    def done(self, n: int) -> None:
        """n accepted spans left the buffer for good (acked or dropped)."""
        if n:
            with self._cond:
                self._unacked = max(0, self._unacked - n)
                self._done_total += n
                self._cond.notify_all()

    @property
    def unacked(self) -> int:
        return self._unacked

    def wait_empty(self, timeout: float) -> bool:
        """Wait until every span accepted BEFORE this call is finished (later ones may still flow).

        A watermark, not "buffer empty": under constant load the buffer is never
        empty, and a flush must still complete. Spans finish in arrival order
        (failed rounds go back to the front), so a count is a position.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._accepted_total
            while self._done_total < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def drain_all(self) -> int:
        """Forget everything still held (shutdown); returns how many spans that was."""
        with self._cond:
            n = self._unacked
            self._raw.clear()
            self._unacked = 0
            self._done_total = self._accepted_total
            self._cond.notify_all()
            return n


def partition_for(key: bytes, partitions: Sequence[int]) -> int:
    """The partition Kafka's default partitioner (murmur2 of the key) picks among ``partitions``,
    so our records land where every other producer of the key puts them."""
    return partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]


def _is_size_error(exc: BaseException) -> bool:
    return isinstance(exc, MessageSizeTooLargeError | RecordTooLargeError)


class KafkaSender:
    """Drains a :class:`SpanBuffer` into one topic; retries with backoff while the broker is away."""

    def __init__(
        self,
        buffer: SpanBuffer,
        topic: str,
        encode: Callable[[Sequence[Any]], list[Encoded]],
        producer_factory: Callable[[], Any],
        *,
        batch_size: int,
        backoff_s: float,
        backoff_max_s: float,
        spool: Spool | None = None,
    ) -> None:
        self.buffer = buffer
        self.counters = buffer.counters
        self.topic = topic
        self._encode = encode
        self._factory = producer_factory
        self._batch_size = batch_size
        self._backoff = (backoff_s, backoff_max_s)
        self._failures = 0
        self.spool = spool
        self._retry: collections.deque[Any] = collections.deque()  # Encoded, or spool Items
        self._wake = asyncio.Event()
        self._spill_wake = asyncio.Event()
        self._stop_event = asyncio.Event()
        self._stopping = False
        self._producer: Any = None
        self._partitions: list[int] = []
        self._part_cache: dict[bytes, int] = {}

    def wake(self) -> None:
        """Called on the loop (via call_soon_threadsafe) when spans were offered."""
        self._wake.set()
        self._spill_wake.set()

    def _has_work(self) -> bool:
        return bool(self._retry) or self.buffer.has_raw() or (self.spool is not None and self.spool.has_unsent())

    async def _next_items(self) -> list[Encoded]:
        """The next round: retried items first, else up to ``batch_size`` spans encoded now.

        Encoding is CPU work that holds the loop, so it runs in chunks with a turn of the loop
        before each: the previous round's produce request goes out and its acks come back
        while this round is encoded, instead of after it (the broker works while we do).
        """
        if self._retry:
            n = min(self._batch_size, len(self._retry))
            return [self._retry.popleft() for _ in range(n)]
        if self.spool is not None:
            await self._spill(self._batch_size)
            return self.spool.take(self._batch_size)
        raw = self.buffer.take(self._batch_size)
        items: list[Encoded] = []
        for i in range(0, len(raw), ENCODE_CHUNK):
            await asyncio.sleep(0)
            items += self._encode(raw[i:i + ENCODE_CHUNK])
        lost = len(raw) - len(items)
        if lost:  # encode errors were counted and logged by the encoder
            self.buffer.done(lost)
        return items

    async def _spill(self, limit: int | None = None) -> None:
        """Spool mode: encode buffered spans and append them to the spool (they leave memory)."""
        assert self.spool is not None
        moved = 0
        while self.buffer.has_raw() and (limit is None or moved < limit):
            raw = self.buffer.take(ENCODE_CHUNK if limit is None else min(ENCODE_CHUNK, limit - moved))
            items = self._encode(raw)
            try:
                self.spool.append(items)
            except OSError as exc:
                with self.counters.lock:
                    self.counters.dropped_spool_error += len(items)
                    self.counters.last_error = f"spool: {exc}"
                log.error("boltstream exporter: cannot write %d spans to the spool %s: %s; dropped",
                          len(items), self.spool.dir, exc)
            self.buffer.done(len(raw))
            moved += len(raw)
            await asyncio.sleep(0)

    async def _sleep_backoff(self) -> None:
        self._failures += 1
        base, cap = self._backoff
        delay = min(cap, base * (2 ** min(self._failures - 1, 16)))
        try:  # a backoff, not a synchronisation: stop() cuts it short
            await asyncio.wait_for(self._stop_event.wait(), delay)
        except TimeoutError:
            pass

    async def _spill_loop(self) -> None:
        """Spool mode, beside :meth:`_run`: spans offered go to disk at once, even while the sender
        waits on a dead broker (connecting, backing off), so the in-memory buffer never fills."""
        while not self._stopping:
            await self._spill_wake.wait()
            self._spill_wake.clear()
            await self._spill()
            self._wake.set()

    def _note_failure(self, exc: BaseException) -> None:
        with self.counters.lock:
            self.counters.send_failures += 1
            self.counters.last_error = f"{type(exc).__name__}: {exc}"
            was_up, self.counters.broker_up = self.counters.broker_up, False
        if was_up or self._failures == 0:
            log.warning("boltstream exporter: broker unreachable (%s); buffering spans (%d held, capacity %d)",
                        exc, self.buffer.unacked, self.buffer.capacity)

    def _note_success(self) -> None:
        if not self.counters.broker_up:
            with self.counters.lock:
                self.counters.broker_up = True
            if self._failures:
                log.warning("boltstream exporter: broker reachable again; delivering %d held spans",
                            self.buffer.unacked + (self.spool.pending if self.spool is not None else 0))
        self._failures = 0

    async def _ensure_producer(self) -> bool:
        if self._producer is not None:
            return True
        producer = self._factory()
        try:
            await producer.start()
            self._partitions = sorted(await producer.partitions_for(self.topic))
        except Exception as exc:
            self._note_failure(exc)
            try:
                await producer.stop()
            except Exception:
                pass
            return False
        self._producer = producer
        self._part_cache.clear()
        return True

    def _partition(self, key: bytes) -> int:
        p = self._part_cache.get(key)
        if p is None:
            if len(self._part_cache) > 100_000:
                self._part_cache.clear()
            p = self._part_cache[key] = partition_for(key, self._partitions)
        return p

    async def _send(self, items: list[Encoded]) -> list[tuple[list[Encoded], asyncio.Future[Any]]]:
        """Put one round on the wire as per-partition record batches; returns (items, future) pairs.

        Each batch is closed before it is handed over: it is complete, so aiokafka sends it at
        once instead of lingering ``linger_ms`` for records that will never come.
        """
        producer, topic = self._producer, self.topic
        ts = int(time.time() * 1000)
        by_partition: dict[int, list[Encoded]] = {}
        partition = self._partition
        for item in items:
            p = partition(item[0])
            members = by_partition.get(p)
            if members is None:
                by_partition[p] = [item]
            else:
                members.append(item)
        sent: list[tuple[list[Encoded], asyncio.Future[Any]]] = []
        for p, members in by_partition.items():
            batch, start = producer.create_batch(), 0
            append = batch.append
            for i, item in enumerate(members):
                if append(key=item[0], value=item[1], timestamp=ts) is None:  # full: send what fits, anew
                    batch.close()
                    sent.append((members[start:i], await producer.send_batch(batch, topic, partition=p)))
                    batch, start = producer.create_batch(), i
                    append = batch.append
                    append(key=item[0], value=item[1], timestamp=ts)
            batch.close()
            sent.append((members[start:], await producer.send_batch(batch, topic, partition=p)))
        return sent

    async def _settle(self, round_: list[tuple[list[Encoded], asyncio.Future[Any]]]) -> list[Encoded]:
        """Wait for one round's acks; returns the items to retry, in order."""
        results = await asyncio.gather(*(f for _, f in round_), return_exceptions=True)
        retry: list[Encoded] = []
        first_error: BaseException | None = None
        for (members, _), res in zip(round_, results, strict=True):
            if not isinstance(res, BaseException):
                with self.counters.lock:
                    self.counters.acked += len(members)
                self._finished(members)
            elif _is_size_error(res) and len(members) == 1:
                log.error("boltstream exporter: broker rejected a %d-byte span as too large; dropped",
                          len(members[0][1]))
                with self.counters.lock:
                    self.counters.dropped_rejected += 1
                self._finished(members)
            else:
                first_error = first_error or res
                retry.extend(members)
        if first_error is not None:
            self._note_failure(first_error)
        elif round_:
            self._note_success()
        return retry

    def _finished(self, members: list[Any]) -> None:
        """Records acked or refused for good leave the buffer (or the spool)."""
        if self.spool is not None:
            self.spool.settle(members)
        else:
            self.buffer.done(len(members))

    async def _restart_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await asyncio.wait_for(producer.stop(), 5.0)
            except Exception:
                pass

    async def run(self, close_timeout: float = 2.0) -> None:
        """Until :meth:`request_stop`: take, encode, send, settle; requeue on failure and back off."""
        spiller = asyncio.create_task(self._spill_loop()) if self.spool is not None else None
        try:
            await self._run()
        finally:
            if spiller is not None:
                spiller.cancel()
            producer, self._producer = self._producer, None
            if producer is not None:
                try:
                    await asyncio.wait_for(producer.stop(), close_timeout)
                except Exception as exc:
                    log.debug("boltstream exporter: producer stop: %s", exc)

    async def _run(self) -> None:
        # One round on the wire while the next one is encoded: the broker's work overlaps ours.
        inflight: list[tuple[list[Encoded], asyncio.Future[Any]]] | None = None
        while not self._stopping:
            if inflight is None:
                if not self._has_work():
                    self._wake.clear()
                    if not self._has_work() and not self._stopping:
                        await self._wake.wait()
                    continue
                if not await self._ensure_producer():
                    await self._sleep_backoff()
                    continue
            items = await self._next_items() if self._has_work() else []
            if inflight is not None:
                retry = await self._settle(inflight)
                inflight = None
                if retry:
                    with self.counters.lock:
                        self.counters.retried += len(retry)
                    self._retry.extendleft(reversed(items))
                    self._retry.extendleft(reversed(retry))
                    if self._failures >= 3:
                        await self._restart_producer()
                    await self._sleep_backoff()
                    continue
            if not items:
                continue
            try:
                inflight = await self._send(items)
            except (TimeoutError, KafkaError, OSError) as exc:
                self._retry.extendleft(reversed(items))
                self._note_failure(exc)
                await self._sleep_backoff()
        if inflight is not None:  # stopping: give the last round a short chance to be acked
            try:
                await asyncio.wait_for(self._settle(inflight), 2.0)
            except (TimeoutError, Exception):
                pass

    def request_stop(self) -> None:
        """Ask :meth:`run` to return (call on the loop); it closes the producer on its way out."""
        self._stopping = True
        self._stop_event.set()
        self._wake.set()
        self._spill_wake.set()
