"""The worker's span sink against the real broker: a span over the message size arrives truncated, not refused."""

from __future__ import annotations

import dataclasses

from boltstream.config import Settings
from boltstream.inference.capture import KafkaSpanSink
from boltstream.schemas import Codec
from boltstream.schemas.records import TRUNCATED
from tests.integration.inference.conftest import read_spans
from tests.unit.inference.test_inference_capture_sink import (
    MAX_MESSAGE_BYTES,
    PROMPT_IDS,
    RESPONSE_IDS,
    oversized_llm_span,
)


async def test_a_captured_span_over_the_message_size_is_written_truncated(settings: Settings) -> None:
    small = dataclasses.replace(settings, max_message_bytes=MAX_MESSAGE_BYTES)
    sink = KafkaSpanSink(small, Codec.from_registry_url(settings.schema_registry_url), timeout=30.0)
    await sink.start()
    try:
        await sink.send([oversized_llm_span("roll-big")])  # returns once the broker acked it
    finally:
        await sink.stop()
    ((key, span),) = await read_spans(settings, 1)
    assert key == b"roll-big" and span["rollout_id"] == "roll-big" and sink.truncated == 1
    assert span["attributes"][TRUNCATED] is True and "gen_ai.input.messages" not in span["attributes"]
    assert span["llm"]["prompt_token_ids"] == PROMPT_IDS and span["llm"]["response_token_ids"] == RESPONSE_IDS
