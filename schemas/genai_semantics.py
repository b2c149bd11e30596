"""What kind of work a span records, read from the tracing conventions agents already write.

Why one module, in the records layer: the producers derive ``boltstream.span.kind`` from a
span's attributes when they normalise it, and the stream app classifies every span it assembles
(LLM call, tool, reward) from the same attributes, for spans that reached the topic without a
derived kind. Two copies of these rules drifted apart once (OpenLLMetry's ``llm.request.type``
made an LLM call of any value on one side, of ``chat`` / ``completion`` only on the other); here
both sides call :func:`span_kind`, and a test classifies the same span shapes through both paths.

The conventions, first match wins (an instrumentation that writes two of them is classified by
the first it writes):

1. ``boltstream.span.kind``: ours, explicit, or derived earlier by the producers;
2. our own span names (``boltstream.rollout``, ``boltstream.reward``);
3. OpenInference ``openinference.span.kind`` (``LLM``, ``TOOL``, ``AGENT``, ``CHAIN`` ...);
4. OTel GenAI ``gen_ai.operation.name`` (``chat``, ``text_completion``, ``generate_content``
   are LLM calls; ``execute_tool`` a tool; ``invoke_agent`` / ``create_agent`` an agent);
5. OpenLLMetry / Traceloop ``traceloop.span.kind`` (``workflow``, ``task``, ``agent``, ``tool``)
   and AgentOps ``agentops.span.kind``;
6. OpenLLMetry's ``llm.request.type`` (its ``LLMRequestTypeValues``: ``chat`` and ``completion``
   are LLM calls, ``embedding`` and ``rerank`` are not; ``unknown`` says nothing).

Kinds are lower-case strings; an unknown operation name is its own kind. Values are plain
attribute values (a string attribute is never wrapped in the Avro union, so records and SDK
attributes read the same).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .records import REWARD_SPAN, ROLLOUT_SPAN, SPAN_KIND

OPENINFERENCE_KIND = "openinference.span.kind"
GENAI_OPERATION = "gen_ai.operation.name"
TRACELOOP_KIND = "traceloop.span.kind"
AGENTOPS_KIND = "agentops.span.kind"
LLM_REQUEST_TYPE = "llm.request.type"

LLM = "llm"
TOOL = "tool"
AGENT = "agent"
REWARD = "reward"
ROLLOUT = "rollout"

# gen_ai.operation.name values that are one call of a language model.
LLM_OPERATIONS = frozenset({"chat", "text_completion", "completion", "generate_content", "responses"})
KIND_BY_OPERATION = {"execute_tool": TOOL, "invoke_agent": AGENT, "create_agent": AGENT, "embeddings": "embedding"}
# OpenLLMetry's llm.request.type values; "unknown" (and anything else) names no kind.
KIND_BY_REQUEST_TYPE = {"chat": LLM, "completion": LLM, "embedding": "embedding", "rerank": "rerank"}
# Attributes whose value is a kind as it stands (lower-cased), in precedence order after ours.
_KIND_ATTRIBUTES = (OPENINFERENCE_KIND, GENAI_OPERATION, TRACELOOP_KIND, AGENTOPS_KIND)


# Values already in canonical form: returned without strip() / lower() (the common case, per span).
_CANONICAL = frozenset({LLM, TOOL, AGENT, REWARD, ROLLOUT, "chain", *LLM_OPERATIONS, *KIND_BY_OPERATION,
                        *KIND_BY_REQUEST_TYPE})


def _word(value: Any) -> str | None:
    if value.__class__ is str:
        if value in _CANONICAL:
            return value
        value = value.strip().lower()
        if value:
            return value
    elif isinstance(value, str):
        return _word(str(value))
    return None


def convention_kind(attrs: Mapping[str, Any]) -> str | None:
    """The kind the tracing conventions (3.-6. in the module docstring) give these attributes, or None."""
    for key in _KIND_ATTRIBUTES:
        kind = _word(attrs.get(key))
        if kind is not None:
            if key == GENAI_OPERATION:
                return LLM if kind in LLM_OPERATIONS else KIND_BY_OPERATION.get(kind, kind)
            return kind
    request_type = _word(attrs.get(LLM_REQUEST_TYPE))
    return KIND_BY_REQUEST_TYPE.get(request_type) if request_type is not None else None


def span_kind(name: str | None, attrs: Mapping[str, Any]) -> str | None:
    """boltstream's coarse kind of a span (``llm``, ``tool``, ``agent``, ``reward``, ``rollout``,
    ``chain`` ...), or None when nothing says."""
    kind = _word(attrs.get(SPAN_KIND))
    if kind is not None:
        return kind
    if name == ROLLOUT_SPAN:
        return ROLLOUT
    if name == REWARD_SPAN:
        return REWARD
    return convention_kind(attrs)
