"""The batches topic as seen by one learner: aiokafka, manual assignment, seek to checkpoint offsets.

Why no consumer group: there is one learner (rank 0 of a DeepSpeed job reads for all
ranks), it needs every partition, and its position lives in the checkpoint manifest,
not in the broker's committed offsets, because only the manifest is atomic with the
weights. A group would add nothing but the embedded broker's ~3 s joins and the risk of
eviction while a long step blocks heartbeats. Undecodable records are counted by the
assembler and copied whole to the ``dlq`` topic.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from boltstream.broker.dlq import DeadLetterWriter
from boltstream.broker.kafka import consumer_kwargs, log_end_offsets
from boltstream.config import Settings
from boltstream.errors import BoltstreamError

from .groups import GroupAssembler, StepInput

logger = logging.getLogger(__name__)


class TopicMissingError(BoltstreamError):
    """The batches topic does not exist (``boltstream topics create``)."""


class BatchSource:
    """Feeds every record of ``settings.topic('batches')`` to a :class:`GroupAssembler`, in log order."""

    def __init__(self, settings: Settings, assembler: GroupAssembler, *, codec: Any = None,
                 start: Mapping[int, int] | None = None, dlq: DeadLetterWriter | None = None) -> None:
        from boltstream.schemas import Codec

        self.settings = settings
        self.topic = settings.topic("batches")
        self.assembler = assembler
        self.codec = codec or Codec.from_registry_url(settings.schema_registry_url)
        self.start_offsets = {int(p): int(o) for p, o in (start or {}).items()}
        self.dlq = dlq
        self.records_read = 0
        self.last_record_at = time.monotonic()
        self._consumer: AIOKafkaConsumer | None = None
        self.partitions: list[TopicPartition] = []

    async def start(self) -> None:
        """Assign all partitions and seek each to its checkpoint offset (or the log start)."""
        consumer = AIOKafkaConsumer(**consumer_kwargs(self.settings, None, fetch_max_wait_ms=100))
        await consumer.start()
        self._consumer = consumer
        self.last_record_at = time.monotonic()  # idle time counts from here (after an offline phase too)
        await consumer.topics()  # metadata for every topic, so partitions_for_topic answers
        parts = consumer.partitions_for_topic(self.topic)
        if not parts:
            await self.stop()
            raise TopicMissingError(f"topic {self.topic} does not exist (run `boltstream topics create`)")
        self.partitions = [TopicPartition(self.topic, p) for p in sorted(parts)]
        consumer.assign(self.partitions)
        ends = await log_end_offsets(self.settings, self.partitions)
        for tp in self.partitions:
            if tp.partition in self.start_offsets:
                offset = self.start_offsets[tp.partition]
                if offset > ends[tp]:
                    logger.error("%s: checkpoint offset %d is past the log end %d; the broker lost records "
                                 "(an in-memory broker restarted?): reading from the log start", tp, offset,
                                 ends[tp])
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, offset)
            else:
                await consumer.seek_to_beginning(tp)
            position = await consumer.position(tp)
            self.assembler.tracker.start(tp.partition, position)
        logger.info("reading %s from %s (log ends %s)", self.topic,
                    {tp.partition: self.assembler.tracker.positions()[tp.partition] for tp in self.partitions},
                    {tp.partition: end for tp, end in ends.items()})

    def take_step(self, k: int, version: int, max_staleness: int | None = None,
                  vocab_size: int | None = None) -> StepInput | None:
        """The next K groups read so far (:meth:`GroupAssembler.take_step`); None until there are K."""
        return self.assembler.take_step(k, version, max_staleness, vocab_size)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def poll(self, timeout_ms: int, max_records: int | None = None) -> int:
        """Fetch what is there (waiting up to ``timeout_ms``), decode, feed; returns the record count."""
        assert self._consumer is not None, "start() first"
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        count = 0
        for tp in sorted(batches, key=lambda t: t.partition):
            for record in batches[tp]:
                count += 1
                try:
                    batch = self.codec.decode(record.value, topic=self.topic, expect="TrainingBatch")
                except Exception as exc:  # any undecodable input is counted and dead-lettered, never fatal
                    logger.warning("undecodable record %s@%d: %s", tp, record.offset, exc)
                    self.assembler.add(tp.partition, record.offset, None, "undecodable")
                    await self._dead_letter(record, f"undecodable: {exc}")
                else:
                    self.assembler.add(tp.partition, record.offset, batch)
        if count:
            self.records_read += count
            self.last_record_at = time.monotonic()
        return count

    async def _dead_letter(self, record: Any, reason: str) -> None:
        """Waits for the broker's ack, so a checkpoint's offsets never pass an unwritten dead letter.

        Best effort: a failure is logged by the writer and the drop is already counted.
        """
        if self.dlq is None:
            return
        with contextlib.suppress(Exception):
            await (await self.dlq.reject(record, reason, "undecodable"))

    def offsets(self) -> list[dict[str, Any]]:
        """The manifest form of the resume positions: ``[{topic, partition, offset}]``."""
        return [{"topic": self.topic, "partition": p, "offset": o}
                for p, o in self.assembler.tracker.positions().items()]
