"""Every faust internal the stream app relies on: a Kafka transport tuned for the embedded broker
and for per-span throughput, in the one module that may touch faust's private API.

The contract (faust-streaming and aiokafka at the versions in :data:`CHECKED_WITH`; the test
``tests/unit/streams/test_faust_internals.py`` fails, naming them, on any other version: re-check
each point below against the new source, then add the version):

* ``faust.App._new_transport()`` builds the consumer transport (overridden to pick ours);
  ``faust.transport.drivers.aiokafka.Transport.Consumer`` is the consumer class it uses.
* ``Consumer._new_consumer_thread()`` builds the thread that owns the aiokafka consumer;
  ``AIOKafkaConsumerThread._create_worker_consumer()`` builds that consumer, and aiokafka's
  ``AIOKafkaConsumer`` reads ``_fetch_max_wait_ms`` in ``start()``.
* ``AIOKafkaConsumerThread._fetch_records(consumer, active_partitions, timeout, max_records)``
  runs each fetch in that thread; ``Consumer._getmany(active_partitions, timeout)`` asks for one.
* ``Consumer._drain_messages(fetcher)`` is the loop that hands records to faust's callback; ours
  replaces it and uses, as faust's own does: ``_stopped``, ``flow_active``, ``can_resume_flow``,
  ``_get_active_partitions()``, ``_buffered_partitions``, ``_read_offset``, ``_add_gap()``,
  ``_to_message()``, ``_unacked_messages``, ``ack()``, ``callback``, ``suspend_flow``,
  ``wait_first()``, ``seek_wait()``, ``diag`` with ``CONSUMER_FETCHING``,
  ``consumer_stopped_errors``, ``app.consumer_generation_id``, ``app.topics.acks_enabled_for``
  and the monitor's ``track_tp_end_offset`` / ``stream_inbound_time``.
* Consumer lag (streams/metrics.py): ``Consumer.highwater(tp)`` is the high watermark of the
  last fetch; ``Consumer._read_offset`` and ``_committed_offset`` map a partition to the last
  offset handed to a stage and to the committed one (:func:`read_offsets`).
* Tables (streams/tables.py, public API, but around faust's own writes): ``Table.data`` is the
  local store, a write to it sends nothing; ``app.producer.send(topic, key, value, partition,
  timestamp, headers)`` sends the changelog record; a table with ``key_type=bytes,
  value_type=bytes`` recovers exactly those bytes into ``Table.data``; faust flushes the
  producer before it commits offsets.

Two measured problems with faust-streaming 0.15.3's stock aiokafka transport:

1. Latency. faust hard-codes ``fetch_max_wait_ms=1500``. Tansu does not answer
   a waiting fetch when new records arrive (Kafka does): it holds the fetch
   for the whole wait, so every hop (spans -> trajectories -> batches) added
   ~0.6 s median, 1.3 s worst (measured with aiokafka against Tansu 0.6;
   50 ms wait -> 1.3 ms median). :class:`TunedConsumerThread` sets our own
   wait (``FETCH_MAX_WAIT_MS``) before the consumer starts.
2. Throughput. faust hands every record to an agent one at a time: for each,
   ``wait_first(callback(message), suspend_flow.wait())`` (four asyncio tasks),
   the conductor's callback, the agent's queue, the stream's iteration with its
   sensors and ack bookkeeping. That alone capped a worker at ~3,000 records/s
   doing nothing, before any of our own per-record work (a table write each).
   :class:`BatchDrainConsumer` hands a topic's records of one fetch to a
   *batch handler* (``StreamFaustApp.batch_handlers``, topic name -> async
   callable) in one call, so the stages decode, stage and write per batch.
   Off with ``BOLTSTREAM_STREAM_FAST_CONSUMER=false`` (then faust's own
   per-record path and agents run, unchanged).

What the batch path keeps from faust's (``Consumer.getmany`` and
``_drain_messages``, 0.15.3): only active (not paused) partitions are handed
over; a fetch that returns while the flow is stopped (a rebalance started) is
dropped and the partitions are sought back to their committed offsets; records
below the partition's read offset are skipped and gaps recorded; a batch is not
handed over once the consumer generation changed. Every record is tracked as
unacked before the handler runs and acked after it returned, so faust's offset
commit (which flushes the producer first) never passes a record whose table
writes were not sent, and a rebalance waits for a batch in progress
(``stream_wait_empty``). Topics without a handler (table changelogs during
recovery, faust's leader topic) go through faust's per-record callback.

The stall after a rebalance (the crash test lost samples about one run in four).
faust passes its *live* set of active partitions to aiokafka's
``fetched_records()``, which runs in faust's consumer thread and waits up to a
second for records. A rebalance meanwhile pauses partitions (emptying that set:
aiokafka reads an empty set as "every partition") or resumes others, so the
fetch in flight returns records - advancing aiokafka's position - for
partitions faust did not ask for or has paused since. faust then drops them:
silently when the partition is not active, or with ``perform_seek()`` (seek to
the committed offset) when the flow is stopped; but aiokafka's
``seek_to_committed`` leaves a partition with no committed offset where it is.
In the crash test the killed worker's partitions often have no commit yet (it
dies ~2 s after its first assignment), so the survivor that takes one over
starts it at offset 0, a stale fetch drains 0..N and those spans are never
processed: their rollouts stay open, their groups incomplete, until the next
rebalance (instrumented run: 254 spans of one partition drained this way, 158
samples missing). Both transports hand aiokafka a copy of the active set;
:class:`BatchDrainConsumer` also seeks every partition with records it fetched
but did not hand over back to the first of them (when still assigned), so
nothing depends on a commit existing. faust's own per-record path
(``fast_consumer=false``) still drops such records as faust does.

The 100 ms fetch stalls (the stream app's p99 of ~200 ms root span -> samples). faust "pauses" a partition only in its own bookkeeping (its active
set); aiokafka goes on fetching every assigned partition, including the table
changelogs after recovery, which the worker itself writes to all the time. Those
records are buffered and never read, and aiokafka sends no new fetch to a broker
while a partition of it holds buffered records younger than its
``prefetch_backoff`` (100 ms): each time a changelog partition got its first
record since the assignment, every partition stopped being fetched for 100 ms
(instrumented, 2-core box, 16 changelog partitions: five fetch gaps of ~100 ms
in a row as the steady load began, 37-39 of 1,000 rollouts over 150 ms in its
first second, none in the next three). :class:`TunedConsumerThread` makes aiokafka fetch what faust reads:
before each fetch it pauses, in aiokafka, the assigned partitions missing
from faust's active set and resumes the ones back in it (:func:`fetch_only`).

Everything else (group protocol, assignor, offsets, recovery) is faust's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from time import monotonic
from typing import Any

import faust
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka

log = logging.getLogger(__name__)

# distribution -> versions the contract above was checked against (read by the test).
CHECKED_WITH: dict[str, tuple[str, ...]] = {
    "faust-streaming": ("0.15.3",),
    "aiokafka": ("0.14.0",),
}

FETCH_MAX_WAIT_MS = 20
FETCH_TIMEOUT_S = 1.0  # how long one getmany waits for records (faust's value)
IDLE_WAIT_S = 0.1  # no active partition (recovery in progress): look again after this long


def read_offsets(consumer: Any) -> tuple[dict[Any, int], dict[Any, int]]:
    """(last offset handed to a stage, committed offset) per partition of faust's ``consumer``: what
    consumer lag is measured from (faust keeps both in private dicts; the batch path keeps the first)."""
    return getattr(consumer, "_read_offset", {}), getattr(consumer, "_committed_offset", {})


def fetch_only(consumer: Any, wanted: Collection[Any]) -> None:
    """Pause, in the aiokafka ``consumer``, its assigned partitions not in ``wanted``; resume the paused ones in it.

    Runs in the consumer's own thread and event loop (aiokafka's pause state is not
    thread-safe). Records already buffered for a partition stay there and are
    handed over once it is wanted again, so no position moves.
    """
    paused = consumer.paused()
    to_pause = [tp for tp in consumer.assignment() if tp not in wanted and tp not in paused]
    to_resume = [tp for tp in paused if tp in wanted]
    if to_pause:
        consumer.pause(*to_pause)
    if to_resume:
        consumer.resume(*to_resume)


class TunedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's consumer thread with a short broker-side fetch wait, fetching only what faust reads.

    See "latency" and "the 100 ms fetch stalls" in the module docstring.
    """

    fetch_max_wait_ms: int = FETCH_MAX_WAIT_MS

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = self.fetch_max_wait_ms  # read by AIOKafkaConsumer.start()
        return consumer

    async def _fetch_records(self, consumer: Any, active_partitions: Any, timeout: float | None = None,
                             max_records: int | None = None) -> Any:
        # An empty or missing set means "every partition" to aiokafka: leave that case as faust has it.
        if active_partitions and self.consumer.flow_active:
            fetch_only(consumer, active_partitions)
        return await super()._fetch_records(consumer, active_partitions, timeout=timeout, max_records=max_records)


class TunedConsumer(faust_aiokafka.Consumer):
    """Stock record delivery, tuned fetch wait, and the fetch asks for a copy of the active set."""

    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return TunedConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _getmany(self, active_partitions: set[Any] | None, timeout: float) -> Any:
        # faust hands aiokafka its live set; see "the stall" in the module docstring.
        wanted = None if active_partitions is None else set(active_partitions)
        return await super()._getmany(wanted, timeout)


BatchHandler = Callable[[list[Any]], Awaitable[None]]


class BatchDrainConsumer(TunedConsumer):
    """Delivers each fetch to the topics' batch handlers (see the module docstring)."""

    _announced: int | None = None  # the consumer generation whose first hand-over was logged

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - runs inside faust
        handlers: dict[str, BatchHandler] = self.app.batch_handlers
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                if not self.flow_active:
                    await self.wait(self.can_resume_flow)
                    continue
                generation = self.app.consumer_generation_id
                # A COPY of the active set: aiokafka reads it in the consumer thread while a
                # rebalance mutates ours, and it drains EVERY partition when handed an empty set.
                wanted = set(self._get_active_partitions())
                if not wanted:
                    await self.sleep(IDLE_WAIT_S)
                    continue
                self.diag.set_flag(faust_consumer.CONSUMER_FETCHING)
                try:
                    records = await self._getmany(active_partitions=wanted, timeout=FETCH_TIMEOUT_S)
                finally:
                    self.diag.unset_flag(faust_consumer.CONSUMER_FETCHING)
                await asyncio.sleep(0)
                if records and not self.should_stop:
                    await self._deliver(records, generation, handlers)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise

    def _deliverable(self, tp: Any, generation: int) -> bool:
        return (
            self.flow_active
            and self.app.consumer_generation_id == generation
            and (tp in self._get_active_partitions() or tp in self._buffered_partitions)
        )

    async def _deliver(self, records: Any, generation: int, handlers: dict[str, BatchHandler]) -> None:
        read_offset = self._read_offset
        acks_enabled_for = self.app.topics.acks_enabled_for
        monitor = self.app.monitor
        to_message = self._to_message
        batches: dict[str, list[Any]] = {}
        undelivered: dict[Any, int] = {}  # tp -> first offset fetched but not handed over
        for tp, tp_records in records.items():
            if not tp_records:
                continue
            if not self._deliverable(tp, generation):
                undelivered[tp] = tp_records[0].offset
                continue
            monitor.track_tp_end_offset(tp, self.highwater(tp))
            last = read_offset[tp]
            messages = []
            for record in tp_records:
                offset = record.offset
                if last is not None and offset < last:
                    continue
                if last and offset - last > 1 and acks_enabled_for(tp.topic):
                    await self._add_gap(tp, last + 1, offset)
                messages.append(to_message(tp, record))
                last = offset
            if not messages:
                continue
            if tp.topic in handlers:
                batches.setdefault(tp.topic, []).extend(messages)
                continue
            for message in messages:  # faust's per-record path (changelogs in recovery, leader topic)
                if not self._deliverable(tp, generation):
                    undelivered[tp] = message.offset
                    break
                await self.wait_first(self.callback(message), self.suspend_flow.wait())
                read_offset[tp] = message.offset
        for topic, messages in batches.items():
            if not all(self._deliverable(tp, generation) for tp in {m.tp for m in messages}):
                for message in messages:
                    undelivered.setdefault(message.tp, message.offset)
                continue
            if self._announced != generation:  # when consuming began after a (re)assignment: for operators
                self._announced = generation
                log.info("consumer generation %s: first %d record(s) of %s handed over", generation, len(messages), topic)
            await self._hand_over(handlers[topic], topic, messages)
        if undelivered:
            await self._rewind(undelivered)

    async def _hand_over(self, handler: BatchHandler, topic: str, messages: list[Any]) -> None:
        unacked = self._unacked_messages
        inbound = self.app.monitor.stream_inbound_time
        now = monotonic()
        for message in messages:
            unacked.add(message)
            inbound[message.tp] = now
        try:
            await handler(messages)
        except Exception:  # the handlers dead-letter what they cannot use; this is a bug, not input
            self.log.exception("batch handler for %s failed; %d record(s) acked anyway", topic, len(messages))
        ack = self.ack
        read_offset = self._read_offset
        for message in messages:
            ack(message)
            read_offset[message.tp] = message.offset

    async def _rewind(self, undelivered: dict[Any, int]) -> None:
        """Seek partitions back to records that were fetched (the position moved past them) but not handed over.

        faust drops such records silently and relies on the next recovery's seek to the
        committed offset, which aiokafka skips for a partition with no commit yet: the
        records would then be skipped until the next rebalance. A partition no longer
        assigned is left to its new owner.
        """
        assigned = self.assignment()
        for tp, offset in undelivered.items():
            if tp not in assigned:
                continue
            try:
                await self.seek_wait({tp: offset})
            except Exception as exc:  # revoked meanwhile: the new assignment starts from the commit
                self.log.info("not rewinding %s to %d: %r", tp, offset, exc)
                continue
            self._read_offset[tp] = offset if offset else None
            self.log.info("rewound %s to offset %d: fetched but not handed over", tp, offset)


class TunedTransport(faust_aiokafka.Transport):
    Consumer = TunedConsumer


class FastTransport(faust_aiokafka.Transport):
    Consumer = BatchDrainConsumer


class StreamFaustApp(faust.App):
    """faust.App whose consumer transport is :class:`FastTransport` or :class:`TunedTransport`.

    ``batch_handlers`` (topic name -> async callable taking a list of messages)
    is read by :class:`BatchDrainConsumer` only.
    """

    fast_consumer: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_handlers: dict[str, BatchHandler] = {}

    def _new_transport(self) -> Any:
        cls = FastTransport if self.fast_consumer else TunedTransport
        return cls(self.conf.broker_consumer, self)
