"""A faust Kafka transport tuned for the embedded broker and for per-span throughput.

Two measured problems with faust-streaming 0.15.3's stock aiokafka transport:

1. Latency. faust hard-codes ``fetch_max_wait_ms=1500``. Tansu does not answer
   a waiting fetch when new records arrive (Kafka does): it holds the fetch
   for the whole wait, so every hop (spans -> trajectories -> batches) added
   ~0.6 s median, 1.3 s worst (measured with aiokafka against Tansu 0.6;
   50 ms wait -> 1.3 ms median). :class:`TunedConsumerThread` sets our own
   wait (``FETCH_MAX_WAIT_MS``) before the consumer starts.
2. Throughput. For every record, faust's consumer loop runs
   ``wait_first(callback(message), suspend_flow.wait())``, which creates four
   asyncio tasks (the callback, the suspend flag, the service's stopped and
   crashed flags) just to be able to abandon a delivery when a rebalance
   starts. That capped a worker at ~3,000 records/s with NO work done
   (profiled: 4 tasks and 3 event-loop rounds per record). When the flow is
   not suspended, flow control is open and the producer buffer is not over
   its limit, the callback cannot block on any of those, so
   :class:`FastDrainConsumer` awaits it directly (~6,000 records/s with no
   work); otherwise it takes faust's own path. Off with
   ``BOLTSTREAM_STREAM_FAST_CONSUMER=false``.

Everything else (group protocol, assignor, offsets, recovery) is faust's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import faust
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka

log = logging.getLogger(__name__)

FETCH_MAX_WAIT_MS = 20
YIELD_EVERY = 100


class TunedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's consumer thread with a short broker-side fetch wait (see the module docstring)."""

    fetch_max_wait_ms: int = FETCH_MAX_WAIT_MS

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = self.fetch_max_wait_ms  # read by AIOKafkaConsumer.start()
        return consumer


class TunedConsumer(faust_aiokafka.Consumer):
    """Stock record delivery, tuned fetch wait."""

    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return TunedConsumerThread(self, loop=self.loop, beacon=self.beacon)


class FastDrainConsumer(TunedConsumer):
    """Delivers a record without faust's per-record ``wait_first`` when nothing can block."""

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - runs inside faust
        # Same loop as faust.transport.consumer.Consumer._drain_messages (0.15.3) except the delivery.
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        acks_enabled_for = self.app.topics.acks_enabled_for
        suspend_flow = self.suspend_flow
        flow_control = self.app.flow_control
        buffer = self.app.producer.buffer
        since_yield = 0
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(faust_consumer.CONSUMER_FETCHING)
                ait = cast(AsyncIterator[Any], getmany(timeout=1.0))
                await self.sleep(0)
                if not self.should_stop:
                    async for tp, message in ait:
                        since_yield += 1
                        if since_yield > YIELD_EVERY:
                            await asyncio.sleep(0)
                            since_yield = 0
                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is not None and offset < r_offset:
                            continue
                        if r_offset and offset - r_offset > 1 and acks_enabled_for(message.topic):
                            await self._add_gap(tp, r_offset + 1, offset)
                        if self._commit_every is not None and self._n_acked >= self._commit_every:
                            self._n_acked = 0
                            await self.commit()
                        if suspend_flow.is_set() or not flow_control.is_active() or buffer.size > buffer.max_messages:
                            await self.wait_first(callback(message), suspend_flow.wait())
                        else:
                            await callback(message)
                        set_read_offset(tp, offset)
                self.diag.unset_flag(faust_consumer.CONSUMER_FETCHING)
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


class TunedTransport(faust_aiokafka.Transport):
    Consumer = TunedConsumer


class FastTransport(faust_aiokafka.Transport):
    Consumer = FastDrainConsumer


class StreamFaustApp(faust.App):
    """faust.App whose consumer transport is :class:`FastTransport` or :class:`TunedTransport`."""

    fast_consumer: bool = True

    def _new_transport(self) -> Any:
        cls = FastTransport if self.fast_consumer else TunedTransport
        return cls(self.conf.broker_consumer, self)
