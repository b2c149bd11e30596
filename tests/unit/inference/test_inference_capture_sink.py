"""The capture sink's encode step: a span over the broker's message size is truncated like the exporter's."""

from __future__ import annotations

from typing import Any

from boltstream.config import Settings
from boltstream.inference.backend import Completion, SamplingParams
from boltstream.inference.capture import MAX_TEXT_ATTR, CallContext, KafkaSpanSink, build_llm_span
from boltstream.schemas import Codec
from boltstream.schemas.records import ROLLOUT_ID, TRUNCATED, TRUNCATED_FIELDS

# Small enough that one captured message text (up to MAX_TEXT_ATTR chars) cannot fit.
MAX_MESSAGE_BYTES = 16_384
PROMPT_IDS = list(range(1, 300))
RESPONSE_IDS = [7, 8, 9, 258]


def oversized_llm_span(rollout_id: str = "roll-big") -> dict[str, Any]:
    """An LLM span whose prompt text alone is over MAX_MESSAGE_BYTES; its token ids are not."""
    ctx = CallContext(ids={ROLLOUT_ID: rollout_id}, trace_id="ab" * 16, start_ns=1)
    completion = Completion(token_ids=RESPONSE_IDS, logprobs=[-0.5] * len(RESPONSE_IDS), finish_reason="stop",
                            text="ok")
    return build_llm_span(ctx, operation="chat", request_model="tiny", served_model="tiny", response_id="r",
                          prompt_ids=PROMPT_IDS, completion=completion, choice_index=0,
                          params=SamplingParams(), policy_version=3,
                          input_messages=[{"role": "user", "content": "x" * MAX_TEXT_ATTR}], output_text="ok")


def test_an_oversized_span_is_truncated_with_the_marker_and_keeps_its_token_ids() -> None:
    codec = Codec()
    sink = KafkaSpanSink(Settings(namespace="u.", max_message_bytes=MAX_MESSAGE_BYTES), codec)
    span = oversized_llm_span()
    assert len(codec.encode("Span", span)) > MAX_MESSAGE_BYTES
    key, value = sink.encode(span)
    assert key == b"roll-big" and len(key) + len(value) < MAX_MESSAGE_BYTES and sink.truncated == 1
    got = codec.decode(value, expect="Span")
    assert got["attributes"][TRUNCATED] is True
    assert "attribute:gen_ai.input.messages" in got["attributes"][TRUNCATED_FIELDS]["strings"]
    assert "gen_ai.input.messages" not in got["attributes"]
    assert got["llm"]["prompt_token_ids"].tolist() == PROMPT_IDS
    assert got["llm"]["response_token_ids"].tolist() == RESPONSE_IDS
    assert got["llm"]["response_logprobs"].tolist() == [-0.5] * len(RESPONSE_IDS)


def test_a_span_that_fits_is_written_as_it_is() -> None:
    codec = Codec()
    sink = KafkaSpanSink(Settings(namespace="u."), codec)
    span = oversized_llm_span()
    key, value = sink.encode(span)
    assert value == codec.encode("Span", span, topic="u.spans") and sink.truncated == 0
