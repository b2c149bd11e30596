"""``DeadLetterWriter`` with its own aiokafka producer against the real broker: a record at the size limit."""

from __future__ import annotations

import asyncio

from boltstream.broker.dlq import DeadLetterWriter
from boltstream.config import Settings
from boltstream.schemas import Codec
from tests.integration.conftest import read_keyed


class Consumed:
    """What a consumer handed a component: a record bigger than the dlq topic's message size."""

    topic, partition, offset, key = "elsewhere", 1, 42, b"big-key"

    def __init__(self, value: bytes) -> None:
        self.value = value


async def test_a_record_over_the_message_size_is_dead_lettered_truncated(settings: Settings) -> None:
    codec = Codec.from_registry_url(settings.schema_registry_url)
    too_big = bytes(range(256)) * (settings.max_message_bytes // 256 + 100)
    async with DeadLetterWriter(settings, codec, "learner") as dlq:
        ack = await dlq.reject(Consumed(too_big), "undecodable: not a TrainingBatch", "undecodable")
        await asyncio.wait_for(ack, 30)
    ((key, letter),) = await read_keyed(settings, "dlq", "DeadLetter", 1)
    assert key == b"big-key" and dlq.counts == {"undecodable": 1} and dlq.acked == 1
    assert letter["reason"] == f"undecodable: not a TrainingBatch (value truncated from {len(too_big)} bytes)"
    assert (letter["component"], letter["topic"], letter["partition"], letter["offset"]) == ("learner", "elsewhere", 1, 42)
    assert 0 < len(letter["value"]) < settings.max_message_bytes and too_big.startswith(letter["value"])
