"""The worker's consumer fetches only what faust reads (streams/transport.py, "the 100 ms fetch stalls").

A real aiokafka consumer with a manual assignment: pausing and resuming are local
state, so no broker is needed (nothing connects before ``start()``).
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.types import TP

from boltstream.streams.transport import fetch_only

SPANS = [TopicPartition("spans", 0), TopicPartition("spans", 1)]
CHANGELOGS = [TopicPartition("stream-rollout-spans-changelog", 0), TopicPartition("stream-rollout-spans-changelog", 1)]


async def test_partitions_faust_does_not_read_are_paused_and_resumed_when_read_again() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9")
    consumer.assign(SPANS + CHANGELOGS)
    try:
        # After recovery faust reads the source topics only (its TP type, as faust passes it).
        fetch_only(consumer, {TP("spans", 0), TP("spans", 1)})
        assert consumer.paused() == set(CHANGELOGS)
        # The next recovery reads the changelogs with the sources held back.
        fetch_only(consumer, {TP(tp.topic, tp.partition) for tp in CHANGELOGS})
        assert consumer.paused() == set(SPANS)
        # A partition back in the wanted set is fetched again; one still missing stays paused.
        fetch_only(consumer, {TP("spans", 1), *CHANGELOGS})
        assert consumer.paused() == {SPANS[0]}
        fetch_only(consumer, set(SPANS + CHANGELOGS))
        assert consumer.paused() == set()
    finally:
        await consumer.stop()


async def test_a_wanted_partition_not_assigned_is_ignored() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9")
    consumer.assign(SPANS)
    try:
        fetch_only(consumer, {TP("spans", 0), TP("revoked", 3)})
        assert consumer.paused() == {SPANS[1]}
    finally:
        await consumer.stop()
