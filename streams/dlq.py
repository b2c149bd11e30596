"""Dead letters of the stream app: input it cannot use, kept whole on the ``dlq`` topic.

Why: one poison record (garbage bytes, a record of another schema, a span that
belongs to no rollout) must neither stop the worker nor vanish. It is wrapped
in a DeadLetter (``schemas/dead_letter/v1.avsc``) with the reason and its
origin topic/partition/offset, keyed by the original key, so it can be
inspected or replayed, and the worker moves on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from boltstream.schemas import Codec

log = logging.getLogger(__name__)

COMPONENT = "stream"
# Room for the DeadLetter's own fields when the original value must be truncated to fit.
ENVELOPE_BYTES = 4096


def dead_letter(
    reason: str,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    max_bytes: int,
) -> dict[str, Any]:
    """The DeadLetter dict; a value too large to fit is truncated and the reason says so."""
    data = bytes(value) if value is not None else b""
    limit = max(0, max_bytes - ENVELOPE_BYTES)
    if len(data) > limit:
        reason = f"{reason} (value truncated from {len(data)} bytes)"
        data = data[:limit]
    return {
        "reason": reason,
        "component": COMPONENT,
        "topic": topic,
        "partition": int(partition),
        "offset": int(offset),
        "key": bytes(key) if key is not None else None,
        "value": data,
        "timestamp_ns": time.time_ns(),
    }


class DeadLetters:
    """Sends dead letters through the app's producer and counts them by reason category."""

    def __init__(self, app: Any, codec: Codec, topic: str, max_bytes: int) -> None:
        self.app = app
        self.codec = codec
        self.topic = topic
        self.max_bytes = max_bytes
        self.counts: collections.Counter[str] = collections.Counter()

    async def send(
        self,
        reason: str,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        category: str = "invalid",
    ) -> asyncio.Future[Any]:
        """Queue one dead letter; returns the broker-ack future (the offset commit waits for it too)."""
        self.counts[category] += 1
        log.warning("%s[%d]@%d -> dlq: %s", topic, partition, offset, reason)
        record = dead_letter(
            reason, topic=topic, partition=partition, offset=offset, key=key, value=value, max_bytes=self.max_bytes
        )
        data = self.codec.encode("DeadLetter", record, topic=self.topic)
        return await self.app.producer.send(self.topic, record["key"], data, None, None, None)  # type: ignore[no-any-return]

    async def reject(self, message: Any, reason: str, category: str = "invalid") -> asyncio.Future[Any]:
        """Dead-letter a consumed record whole, with where it came from."""
        return await self.send(reason, topic=message.topic, partition=message.partition, offset=message.offset,
                               key=message.key, value=message.value, category=category)
