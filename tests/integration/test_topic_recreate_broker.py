"""``recreate_topics`` (``boltstream replay --overwrite``) against the real broker: empty topics however it is raced.

Tansu drops a deleted topic's records at once but re-creates the topic on the next metadata
request naming it; a client polling the topic meanwhile is what made an earlier kill-and-rerun
test flaky. Here a client asks for the topic's metadata all along the recreate.
"""

from __future__ import annotations

import asyncio
import dataclasses

from aiokafka.admin import AIOKafkaAdminClient

from boltstream.broker.kafka import admin_kwargs
from boltstream.broker.topics import describe_topics, ensure_topics, held_records, recreate_topics
from boltstream.config import Settings
from tests.integration.streams.stream_helpers import produce


async def test_recreated_topics_are_empty_with_their_partitions_even_while_polled(settings: Settings) -> None:
    out = dataclasses.replace(settings, namespace=f"{settings.namespace}re.")
    names = ("trajectories", "batches", "dlq")
    await ensure_topics(out, names)
    for short in names:
        await produce(out, out.topic(short), [(b"k%d" % i, b"v") for i in range(20)])
    full = [out.topic(n) for n in names]
    assert set((await held_records(out, full)).values()) == {20}

    stop = asyncio.Event()
    polls = 0

    async def poll() -> None:  # metadata requests naming the topics, as a consumer still reading them sends
        nonlocal polls
        admin = AIOKafkaAdminClient(**admin_kwargs(out))
        await admin.start()
        try:
            while not stop.is_set():
                await admin.describe_topics(full)
                polls += 1
                await asyncio.sleep(0.01)  # load shaping, not synchronisation
        finally:
            await admin.close()

    poller = asyncio.create_task(poll())
    try:
        await recreate_topics(out, names, timeout=30.0)
    finally:
        stop.set()
        await asyncio.wait_for(poller, 10.0)
    assert polls > 0
    assert await held_records(out, full) == dict.fromkeys(full, 0)
    assert {t["topic"]: t["partitions"] for t in await describe_topics(out, full)} == dict.fromkeys(
        full, settings.partitions)
    await produce(out, out.topic("batches"), [(b"k", b"after")])
    assert (await held_records(out, [out.topic("batches")]))[out.topic("batches")] == 1
