"""The record contract shared by every component: span names, attribute names, topic keys.

Why one module: a producer writes ``boltstream.rollout_id`` and the stream app reads it; if
each side spelled the name itself, a typo on one side would silently turn every span into
"a span that belongs to no rollout". Pure constants and pure functions, no imports from the
rest of boltstream, so every layer may depend on it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

# Span names written by the rollout context (producers) and recognised by assembly (streams).
ROLLOUT_SPAN = "boltstream.rollout"
# Written by the exporter of a process that IS one rollout (BOLTSTREAM_ROLLOUT_ID) when it shuts down:
# the rollout is over, the stream app closes it after grace_s instead of waiting session_idle_s.
ROLLOUT_END_SPAN = "boltstream.rollout.end"
REWARD_SPAN = "boltstream.reward"

# Rollout identity, on every span of a rollout (and in OTel baggage, so it crosses processes).
ROLLOUT_ID = "boltstream.rollout_id"
ATTEMPT_ID = "boltstream.attempt_id"
TASK_ID = "boltstream.task_id"
ID_ATTRIBUTES = (ROLLOUT_ID, ATTEMPT_ID, TASK_ID)
# The same ids as the Span record's promoted fields, in the same order.
ID_FIELDS = ("rollout_id", "attempt_id", "task_id")
# The same ids as Agent Lightning writes them; read as equivalents, never written.
AGENTLIGHTNING_ID_ATTRIBUTES = ("agentlightning.rollout_id", "agentlightning.attempt_id", "agentlightning.task_id")

# Instrumentation scope of the inference worker's LLM spans (the ones carrying token ids).
INFERENCE_SCOPE = "boltstream.inference"

# Root span outcome and the agent that made a call.
STATUS = "boltstream.status"
ERROR = "boltstream.error"
ATTEMPT = "boltstream.attempt"
AGENT_NAME = "boltstream.agent_name"
SPAN_KIND = "boltstream.span.kind"

# Reward spans.
REWARD_NAME = "boltstream.reward.name"
REWARD_VALUE = "boltstream.reward.value"
REWARD_FINAL = "boltstream.reward.final"
REWARD_PRIMARY = "boltstream.reward.primary"
# On a reward span made from delayed feedback (``boltstream feedback``, ``POST /v1/feedback``):
# the stream app dead-letters such a span when its rollout was already trained, or never existed.
FEEDBACK = "boltstream.feedback"
FEEDBACK_TARGET = "boltstream.feedback.target"
FEEDBACK_IDEMPOTENCY_KEY = "boltstream.feedback.idempotency_key"

# Set on a span whose attributes were cut to fit the broker's message size.
TRUNCATED = "boltstream.truncated"
TRUNCATED_FIELDS = "boltstream.truncated.fields"
# A span (or trajectory) is at most ``max_message_bytes - RECORD_HEADROOM`` bytes: the exporter
# truncates spans to that, the stream app dead-letters anything larger. The headroom is what the
# stream app adds around one record when it keeps it in its changelog (chunk framing, store key)
# or dead-letters it (the DeadLetter envelope with a reason of up to MAX_REASON_CHARS), so a
# record it accepted can always be kept, and dead-lettered whole.
RECORD_HEADROOM = 4096


# What one rollout is, when nothing names it explicitly: a conversation / session id (OTel GenAI,
# then OpenInference), in a span's attributes or, across processes, in W3C baggage.
SESSION_ATTRIBUTES = ("gen_ai.conversation.id", "session.id")


def rollout_key(span: Mapping[str, Any]) -> str:
    """What one rollout is (docs/zero-code.md): explicit rollout id > conversation/session id > trace id.

    Why one function: producers key the ``spans`` topic by it and the stream app accumulates
    by it, so the agent's spans and the inference worker's meet in one partition and one entry.
    """
    rollout_id = span.get("rollout_id")
    if rollout_id:
        return str(rollout_id)
    attrs = span.get("attributes") or {}
    for name in SESSION_ATTRIBUTES:
        value = attrs.get(name)
        if isinstance(value, str) and value.strip():
            return value
    return str(span.get("trace_id") or "")


def span_key(span: Mapping[str, Any]) -> bytes:
    """The ``spans`` topic key: :func:`rollout_key` (docs/architecture.md, "Topics and keys").

    Every span of a rollout lands in one partition, in the order it was produced: the
    stream app's completeness rule (LLM spans before the root span) depends on it.
    """
    return rollout_key(span).encode("utf-8")


# Dead letters (schemas/dead_letter/v1.avsc). The reason is for a human reading the DLQ; an
# exception message can be a whole payload, so it is bounded. The value is cut to what fits the
# broker's message size once the envelope is counted: a dead letter that cannot be written loses
# the very record it was meant to keep.
MAX_REASON_CHARS = 1000
# Avro field framing, the registry header and the Kafka record/batch framing around the fields
# counted exactly below (reason, component, topic, and the key: in the record and in the envelope).
ENVELOPE_BYTES = 1024


def dead_letter(
    reason: str,
    *,
    component: str,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    max_bytes: int,
    now_ns: int | None = None,
) -> dict[str, Any]:
    """The DeadLetter record for input ``component`` could not use, sized to fit ``max_bytes``.

    A value too large is cut and the reason says from how many bytes, so a reader knows the
    copy is partial. ``timestamp_ns`` is when the record was dead-lettered (now unless given),
    not when it was produced: the DLQ is read to see what failed recently.
    """
    if max_bytes <= 0:
        raise ValueError(f"dead_letter: max_bytes must be > 0, got {max_bytes}")
    if len(reason) > MAX_REASON_CHARS:
        reason = f"{reason[:MAX_REASON_CHARS]}... ({len(reason)} chars)"
    data = bytes(value) if value is not None else b""
    key = bytes(key) if key is not None else None
    envelope = (ENVELOPE_BYTES + len(reason.encode("utf-8")) + len(component.encode("utf-8"))
                + len(topic.encode("utf-8")) + 2 * len(key or b""))
    limit = max(0, max_bytes - envelope)
    if len(data) > limit:
        reason = f"{reason} (value truncated from {len(data)} bytes)"
        data = data[:limit]
    return {
        "reason": reason,
        "component": component,
        "topic": topic,
        "partition": int(partition),
        "offset": int(offset),
        "key": key,
        "value": data,
        "timestamp_ns": time.time_ns() if now_ns is None else int(now_ns),
    }
