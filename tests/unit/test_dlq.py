"""``boltstream.broker.dlq.DeadLetterWriter`` through a recording send callable: what it sends, counts and reports."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from boltstream.broker.dlq import DeadLetterWriter
from boltstream.config import Settings
from boltstream.schemas import Codec

CODEC = Codec()
SETTINGS = Settings(namespace="u.", max_message_bytes=4096)


class Record:
    topic, partition, offset, key = "u.spans", 2, 17, b"k"

    def __init__(self, value: bytes | None) -> None:
        self.value = value


class RecordingSend:
    """Stands in for a producer's send: records (topic, key, value), hands back a future the test settles."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.sent: list[tuple[str, bytes | None, bytes, asyncio.Future[Any]]] = []
        self.refuse = refuse

    async def __call__(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future[Any]:
        if self.refuse is not None:
            raise self.refuse
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append((topic, key, value, fut))
        return fut


async def test_a_rejected_record_is_sent_whole_and_the_ack_future_is_returned() -> None:
    send = RecordingSend()
    writer = DeadLetterWriter(SETTINGS, CODEC, "runner", send=send)
    future = await writer.reject(Record(b"junk"), "undecodable task", "undecodable")
    ((topic, key, value, ack),) = send.sent
    letter = CODEC.decode(value, expect="DeadLetter")
    assert (topic, key) == ("u.dlq", b"k")
    assert {k: v for k, v in letter.items() if k != "timestamp_ns"} == {
        "reason": "undecodable task", "component": "runner", "topic": "u.spans", "partition": 2, "offset": 17,
        "key": b"k", "value": b"junk"}
    assert not future.done() and writer.counts == {"undecodable": 1}
    ack.set_result("metadata")
    assert await asyncio.wait_for(future, 1) == "metadata" and writer.acked == 1 and writer.failed == 0


async def test_a_value_over_the_message_size_is_truncated_to_fit() -> None:
    send = RecordingSend()
    writer = DeadLetterWriter(SETTINGS, CODEC, "learner", send=send)
    await writer.reject(Record(b"x" * 10_000), "undecodable")
    value = send.sent[0][2]
    assert len(value) < SETTINGS.max_message_bytes
    assert "value truncated from 10000 bytes" in CODEC.decode(value, expect="DeadLetter")["reason"]


async def test_a_broker_failure_reaches_the_future_and_the_log(caplog: pytest.LogCaptureFixture) -> None:
    send = RecordingSend()
    writer = DeadLetterWriter(SETTINGS, CODEC, "stream", send=send)
    future = await writer.reject(Record(b"v"), "bad")
    send.sent[0][3].set_exception(TimeoutError("no ack"))
    with caplog.at_level(logging.ERROR, "boltstream.broker.dlq"), pytest.raises(TimeoutError, match="no ack"):
        await asyncio.wait_for(future, 1)
    assert writer.failed == 1 and "dead letter of u.spans[2]@17 not written: TimeoutError: no ack" in caplog.text


async def test_a_send_refused_locally_is_delivered_to_the_future(caplog: pytest.LogCaptureFixture) -> None:
    writer = DeadLetterWriter(SETTINGS, CODEC, "stream", send=RecordingSend(refuse=ValueError("too large")))
    with caplog.at_level(logging.ERROR, "boltstream.broker.dlq"):
        future = await writer.reject(Record(b"v"), "bad")
        with pytest.raises(ValueError, match="too large"):
            await asyncio.wait_for(future, 1)
    assert writer.failed == 1 and "not written: ValueError: too large" in caplog.text


def test_encode_gives_the_framed_record_for_callers_that_send_it_themselves() -> None:
    writer = DeadLetterWriter(SETTINGS, CODEC, "stream", send=RecordingSend())
    letter = CODEC.decode(writer.encode("rollout r1: boom", topic="u.spans", partition=1, offset=-1, key=b"r1",
                                        value=b"raw"), expect="DeadLetter")
    assert (letter["component"], letter["reason"], letter["offset"], letter["value"]) == (
        "stream", "rollout r1: boom", -1, b"raw")


def test_a_producer_and_a_send_callable_together_are_refused() -> None:
    with pytest.raises(ValueError, match="producer or send, not both"):
        DeadLetterWriter(SETTINGS, CODEC, "x", producer=object(), send=RecordingSend())
