"""Changelog-backed Faust tables written with an explicit partition, and their Tansu recovery fix.

Why not ``table[key] = value``: faust sends each table write through its
ProducerBuffer one message per event-loop round trip (~0.3 ms measured here,
more than all our own work per span), and a plain table write needs the
*current event* to pick the changelog partition, so a timer could not close
a rollout. :class:`ChangelogMap` keeps the table (faust declares its
changelog topic, recovers it on assignment and drops revoked partitions) but
writes the local store and sends the changelog record itself, with the
partition of the source record, through the app's producer. Faust flushes
that producer before every offset commit, so a committed source offset never
stands for a change that is not in the changelog. What this relies on in faust is listed, with
the versions checked, in :mod:`boltstream.streams.faust_internals`.

Keys and values are bytes on both sides (``key_type=bytes, value_type=bytes``:
faust's ``raw`` codec), so a recovered store holds exactly what was written.
Every key starts with ``b"<partition>\\x1f"`` (:func:`make_key`): after a
rebalance the stages can tell which entries belong to partitions they still own.

Chunks (:func:`pack_items`): the stages write the new items of one key from one
consumed batch as ONE table value (the raw records, length-prefixed), named by
the source offset of its first record, instead of one write per item: a rollout
of 7 spans costs one changelog record and one tombstone, not 7 of each.
Re-applying a batch after a crash rewrites the same records (the stages dedupe
items by id in memory), so this stays idempotent.

Tansu fix (:func:`catch_up`): faust ends recovery at the broker's reported
high watermark, and Tansu 0.6 reports the LAST BATCH's base offset + 1 there
(see boltstream.broker.kafka), so the rest of that batch may never reach the store.
After faust's recovery, :func:`catch_up` re-reads each active changelog
partition from that reported offset - 1 to the true log end and applies it in
order. Re-applying the tail of a key/value log in order is idempotent, so on
Kafka/Redpanda (one record re-read) it changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from boltstream.broker.kafka import consumer_kwargs, log_end_offsets, read_tails
from boltstream.config import Settings

log = logging.getLogger(__name__)

SEP = b"\x1f"
# First byte of a chunk value; a single raw record (Avro: 0xC3 or 0x00) never starts with it.
CHUNK_MAGIC = b"\xb5"
_LEN = struct.Struct(">I")
CHUNK_HEADER_BYTES = len(CHUNK_MAGIC)  # what a chunk adds once, and per item (:func:`pack_items`)
CHUNK_ITEM_BYTES = _LEN.size


def make_key(partition: int, *parts: str) -> bytes:
    """``b"<partition>\\x1f<part>\\x1f<part>..."``: a store key that names its source partition."""
    return SEP.join([str(partition).encode(), *(p.encode("utf-8") for p in parts)])


def split_key(key: bytes) -> tuple[int, list[str]]:
    """Inverse of :func:`make_key`."""
    head, *rest = key.split(SEP)
    return int(head), [r.decode("utf-8") for r in rest]


def pack_items(raws: Iterable[bytes]) -> bytes:
    """One table value holding several raw records (see the module docstring)."""
    parts = [CHUNK_MAGIC]
    for raw in raws:
        parts.append(_LEN.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def unpack_items(value: bytes) -> list[bytes]:
    """Inverse of :func:`pack_items`; a value that is not a chunk is one raw record."""
    if not value.startswith(CHUNK_MAGIC):
        return [value]
    out = []
    pos, end = len(CHUNK_MAGIC), len(value)
    while pos < end:
        (size,) = _LEN.unpack_from(value, pos)
        pos += _LEN.size
        out.append(value[pos : pos + size])
        pos += size
    return out


class ChangelogMap:
    """A faust Table of bytes -> bytes whose writes name their changelog partition explicitly."""

    def __init__(self, app: Any, name: str, help: str, partitions: int) -> None:
        self.app = app
        self.name = name
        self.table = app.Table(name, key_type=bytes, value_type=bytes, partitions=partitions, help=help)

    @property
    def store(self) -> MutableMapping[bytes, bytes]:
        """The local store (faust's memory store: a dict of the active partitions' keys)."""
        return self.table.data  # type: ignore[no-any-return]

    @property
    def topic(self) -> str:
        return str(self.table.changelog_topic.get_topic_name())

    def get(self, key: bytes) -> bytes | None:
        return self.store.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self.store

    async def put(self, partition: int, key: bytes, value: bytes) -> asyncio.Future[Any]:
        """Set ``key`` locally and send the change to changelog ``partition``; returns the ack future."""
        self.store[key] = value
        return await self.app.producer.send(self.topic, key, value, partition, None, None)  # type: ignore[no-any-return]

    async def delete(self, partition: int, key: bytes) -> asyncio.Future[Any]:
        """Remove ``key`` locally and send a tombstone to changelog ``partition``."""
        self.store.pop(key, None)
        return await self.app.producer.send(self.topic, key, None, partition, None, None)  # type: ignore[no-any-return]

    def keys_for(self, partitions: Iterable[int]) -> Iterator[bytes]:
        """Store keys whose partition prefix is in ``partitions`` (a snapshot, safe to mutate after)."""
        wanted = {str(p).encode() for p in partitions}
        return iter([k for k in list(self.store.keys()) if k.split(SEP, 1)[0] in wanted])

    def purge_except(self, partitions: Iterable[int]) -> int:
        """Drop (locally only, no tombstones) keys of partitions this worker no longer owns."""
        keep = {str(p).encode() for p in partitions}
        stale = [k for k in list(self.store.keys()) if k.split(SEP, 1)[0] not in keep]
        for key in stale:
            self.store.pop(key, None)
        return len(stale)


async def catch_up(
    settings: Settings, maps: Iterable[ChangelogMap], partitions: Iterable[int], timeout: float = 30.0
) -> int:
    """Apply the changelog tail faust's recovery may have missed on Tansu (see the module docstring).

    Returns how many records were (re-)applied.
    """
    by_topic = {m.topic: m for m in maps}
    tps = [TopicPartition(topic, p) for topic in by_topic for p in partitions]
    if not tps:
        return 0
    true_end = await log_end_offsets(settings, tps, timeout=timeout)
    todo = {tp: end for tp, end in true_end.items() if end > 0}
    if not todo:
        return 0
    applied = 0

    def apply(tp: TopicPartition, records: list[Any]) -> bool:
        nonlocal applied
        store, end = by_topic[tp.topic].store, todo[tp]
        for record in records:
            if record.offset >= end:
                return True
            if record.value is None:
                store.pop(record.key, None)
            else:
                store[record.key] = record.value
            applied += 1
        return records[-1].offset + 1 >= end

    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None))
    await consumer.start()
    try:
        reported = await consumer.end_offsets(list(todo))
        starts = {tp: max(0, min(reported.get(tp, 0), end) - 1) for tp, end in todo.items()}
        try:
            await read_tails(consumer, starts, apply, timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"changelog catch-up: {exc}") from exc
    finally:
        await consumer.stop()
    log.debug("changelog catch-up re-applied %d record(s)", applied)
    return applied
