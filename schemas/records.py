"""The record contract shared by every component: span names, attribute names, topic keys.

Why one module: a producer writes ``boltstream.rollout_id`` and the stream app reads it; if
each side spelled the name itself, a typo on one side would silently turn every span into
"a span that belongs to no rollout". Pure constants and pure functions, no imports from the
rest of boltstream, so every layer may depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Span names written by the rollout context (producers) and recognised by assembly (streams).
ROLLOUT_SPAN = "boltstream.rollout"
REWARD_SPAN = "boltstream.reward"

# Rollout identity, on every span of a rollout (and in OTel baggage, so it crosses processes).
ROLLOUT_ID = "boltstream.rollout_id"
ATTEMPT_ID = "boltstream.attempt_id"
TASK_ID = "boltstream.task_id"
ID_ATTRIBUTES = (ROLLOUT_ID, ATTEMPT_ID, TASK_ID)
# The same ids as Agent Lightning writes them; read as equivalents, never written.
AGENTLIGHTNING_ID_ATTRIBUTES = ("agentlightning.rollout_id", "agentlightning.attempt_id", "agentlightning.task_id")

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

# Set on a span whose attributes were cut to fit the broker's message size.
TRUNCATED = "boltstream.truncated"
TRUNCATED_FIELDS = "boltstream.truncated.fields"


def span_key(span: Mapping[str, Any]) -> bytes:
    """The ``spans`` topic key: the rollout id, else the trace id (design.md, "Topics").

    Every span of a rollout lands in one partition, in the order it was produced: the
    stream app's completeness rule (LLM spans before the root span) depends on it.
    """
    return str(span.get("rollout_id") or span["trace_id"]).encode("utf-8")
