"""Read-only helpers over Span records (plain dicts shaped like ``schemas/span/v2.avsc``).

Why this module exists: spans come from many producers (our inference worker and
runner, OpenTelemetry GenAI semantic conventions, OpenInference, OpenLLMetry,
AutoGen, LangGraph ...), each naming the same facts differently. Everything that
depends on *which* attribute a framework writes lives here, so assembly, AIR and
credit assignment reason about "an LLM call", "a tool span" or "the agent" only.
What kind of span it is (LLM call, tool, reward) is decided by
:mod:`boltstream.schemas.genai_semantics`, the rules the producers derive
``boltstream.span.kind`` with.

Attribute values are Avro union values as fastavro reads them: a scalar, or for
arrays a one-key dict (``{"longs": [...]}``, ``{"strings": [...]}``, ...).
:func:`attr` unwraps those to plain lists.

Agent names (for ``agent_match``) are read from the span itself, first match wins:

1. ``boltstream.agent_name`` - our own, set by the runner / ``rollout`` context.
2. ``gen_ai.agent.name`` - OTel GenAI conventions; written by AutoGen/AG2 on
   ``invoke_agent``/``create_agent`` spans, by the OTel OpenAI Agents SDK
   instrumentation and Microsoft Agent Framework.
3. ``agent.name`` - OpenInference semantic conventions (also AgentOps' OpenAI
   Agents SDK instrumentation, which Agent Lightning reads).
   Then ``operation.name`` on an AgentOps ``@agent`` span (``agentops.span.kind``
   = ``agent``), as Agent Lightning's adapter reads it.
4. ``graph.node.id`` on an OpenInference ``AGENT`` span - the OpenInference
   OpenAI Agents SDK processor stores the agent's name there.
5. ``recipient_agent_type`` on AutoGen core runtime message-processing spans
   (``messaging.operation`` = ``process``).
6. LangGraph node / LangChain agent: ``lc_agent_name`` then ``langgraph_node``
   from the OpenInference ``metadata`` JSON string, from LangSmith's OTel
   export (``langsmith.metadata.*``) or OpenLLMetry
   (``traceloop.association.properties.*``); then a plain ``langgraph.node``.

A span without its own name inherits the nearest ancestor's
(:func:`inherited_agent_names`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from boltstream.schemas import genai_semantics as semantics
from boltstream.schemas import records

logger = logging.getLogger(__name__)

Span = Mapping[str, Any]

_ARRAY_KEYS = ("longs", "strings", "doubles", "bools")
_AGENT = frozenset({semantics.AGENT})
_AGENT_METADATA_KEYS = ("lc_agent_name", "langgraph_node")
_METADATA_PREFIXES = ("langsmith.metadata.", "traceloop.association.properties.")


_EMPTY: Mapping[str, Any] = {}
# Types that are never an array wrapper: the common case of unwrap() without an ABC isinstance check.
_SCALAR_TYPES = frozenset({str, int, float, bool, type(None), bytes})


def unwrap(value: Any) -> Any:
    """Turn an Avro attribute union value into a plain Python value.

    Array attributes arrive as ``{"longs": [...]}`` etc.; everything else is
    already a scalar (or None).
    """
    if type(value) in _SCALAR_TYPES:
        return value
    if isinstance(value, Mapping) and len(value) == 1:
        key = next(iter(value))
        if key in _ARRAY_KEYS:
            return list(value[key])
    return value


def _attrs(span: Span) -> Mapping[str, Any]:
    return span.get("attributes") or _EMPTY


def attr(span: Span, key: str, default: Any = None) -> Any:
    """One attribute of ``span``, unwrapped; ``default`` when absent or null."""
    value = _attrs(span).get(key)
    if value is None:
        return default
    return unwrap(value)


def attributes(span: Span) -> dict[str, Any]:
    """All attributes of ``span`` as a new dict of plain values."""
    return {k: unwrap(v) for k, v in _attrs(span).items()}


def status_code(span: Span) -> str:
    """``UNSET`` | ``OK`` | ``ERROR`` (upper-cased; UNSET when missing)."""
    status = span.get("status") or _EMPTY
    return str(status.get("code") or "UNSET").upper()


def status_message(span: Span) -> str | None:
    """The span status description, if any."""
    status = span.get("status") or _EMPTY
    return status.get("message")


# The predicates below run several times per span on the stream app's hot path, so they read the
# attribute map once and compare raw values: a string attribute is never wrapped (only arrays are),
# so ``_str_of`` gives exactly what ``attr`` + a non-blank string check would.


def _str_of(attrs: Mapping[str, Any], key: str) -> str | None:
    value = attrs.get(key)
    if isinstance(value, str) and value.strip():
        return value
    return None


def _str_attr(span: Span, key: str) -> str | None:
    return _str_of(_attrs(span), key)


def _lower_in(attrs: Mapping[str, Any], key: str, allowed: frozenset[str]) -> bool:
    value = attrs.get(key)
    return isinstance(value, str) and value.lower() in allowed


def _oi_kind(attrs: Mapping[str, Any]) -> str | None:
    kind = _str_of(attrs, semantics.OPENINFERENCE_KIND)
    return kind.upper() if kind else None


def openinference_kind(span: Span) -> str | None:
    """The OpenInference span kind upper-cased (``LLM``, ``TOOL``, ``AGENT``, ...)."""
    return _oi_kind(_attrs(span))


def _kind(span: Span, attrs: Mapping[str, Any]) -> str | None:
    return semantics.span_kind(span.get("name"), attrs)


def _is_llm(span: Span, attrs: Mapping[str, Any]) -> bool:
    return span.get("llm") is not None or (bool(attrs) and _kind(span, attrs) == semantics.LLM)


def is_llm_span(span: Span) -> bool:
    """True for an LLM call, recorded by us or described by a tracing convention.

    Ours carry the typed ``llm`` block; others are recognised by the rules of
    :mod:`boltstream.schemas.genai_semantics` (GenAI ``gen_ai.operation.name``, OpenInference
    kind ``LLM``, OpenLLMetry's ``llm.request.type`` ...). Whether token ids were recorded is a
    separate question (:func:`has_token_ids`).
    """
    return _is_llm(span, _attrs(span))


def has_token_ids(span: Span) -> bool:
    """True when the span's ``llm`` block holds both prompt and response token ids."""
    llm = span.get("llm")
    return bool(llm) and bool(llm.get("prompt_token_ids")) and bool(llm.get("response_token_ids"))


def is_tool_span(span: Span) -> bool:
    """True for a tool execution (GenAI ``execute_tool``, OpenInference ``TOOL``, OpenLLMetry or AgentOps ``tool``)."""
    return span_flags(span).tool


def is_reward_span(span: Span) -> bool:
    """True for a reward span: ``boltstream.reward`` (``emit_reward``, the runner) or one the
    producers' normaliser recognised (``boltstream.span.kind`` = ``reward``, e.g. Agent Lightning's)."""
    return _kind(span, _attrs(span)) == semantics.REWARD


def is_feedback(span: Span) -> bool:
    """True for a reward span made from delayed feedback (producers/feedback.py), which may come late."""
    return _attrs(span).get(records.FEEDBACK) is True


def is_rollout_root(span: Span) -> bool:
    """True for the runner's ``boltstream.rollout`` span (ids, status, timings)."""
    return span.get("name") == records.ROLLOUT_SPAN


def is_local_root(span: Span) -> bool:
    """True for a span with no parent that the agent wrote: the end of a trace seen from the agent.

    The inference worker's LLM span has no parent either when the request had no
    ``traceparent``; it never ends a trace, nor does delayed feedback (it may come first).
    """
    return (not span.get("parent_span_id") and not is_feedback(span)
            and (span.get("scope") or _EMPTY).get("name") != records.INFERENCE_SCOPE)


def is_final_reward(span: Span) -> bool:
    """True for a reward span carrying a final reward (what a held rollout waits for)."""
    info = reward_of(span)
    return info is not None and info.final


class SpanFlags(NamedTuple):
    """What a span is, classified once (assembly and AIR ask these several times per span)."""

    llm: bool
    tool: bool
    reward: bool


def span_flags(span: Span) -> SpanFlags:
    """:func:`is_llm_span`, :func:`is_tool_span` and :func:`is_reward_span` of ``span`` in one pass."""
    kind = _kind(span, _attrs(span))
    llm = span.get("llm") is not None or kind == semantics.LLM
    return SpanFlags(llm, not llm and kind == semantics.TOOL, kind == semantics.REWARD)


@dataclass(frozen=True)
class RewardInfo:
    """What a reward span says: name, value, final-vs-intermediate, primary flag."""

    name: str
    value: float
    final: bool
    primary: bool
    span_id: str
    time_ns: int


def reward_of(span: Span) -> RewardInfo | None:
    """The reward a reward span carries; None when it is not one or has no numeric value.

    ``boltstream.reward.final`` absent: a primary reward is final (the normaliser
    marks Agent Lightning's rewards primary), anything else intermediate.
    """
    if not is_reward_span(span):
        return None
    value = attr(span, records.REWARD_VALUE)
    if isinstance(value, bool) or not isinstance(value, int | float):
        logger.warning("reward span %s has no numeric %s: %r", span.get("span_id"), records.REWARD_VALUE, value)
        return None
    primary = bool(attr(span, records.REWARD_PRIMARY, False))
    return RewardInfo(
        name=_str_attr(span, records.REWARD_NAME) or "reward",
        value=float(value),
        final=bool(attr(span, records.REWARD_FINAL, primary)),
        primary=primary,
        span_id=str(span.get("span_id")),
        time_ns=int(span.get("start_time_ns") or 0),
    )


def span_ids(span: Span) -> tuple[str | None, str | None, str | None]:
    """(rollout_id, attempt_id, task_id): ``boltstream.*`` attributes first, then promoted fields."""
    return (
        _str_attr(span, records.ROLLOUT_ID) or span.get("rollout_id"),
        _str_attr(span, records.ATTEMPT_ID) or span.get("attempt_id"),
        _str_attr(span, records.TASK_ID) or span.get("task_id"),
    )


def _from_metadata_json(attrs: Mapping[str, Any]) -> str | None:
    raw = attrs.get("metadata")
    if not isinstance(raw, str) or "lang" not in raw:
        return None
    try:
        metadata = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(metadata, Mapping):
        return None
    for key in _AGENT_METADATA_KEYS:
        value = metadata.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


_METADATA_KEYS = tuple(prefix + key for key in _AGENT_METADATA_KEYS for prefix in _METADATA_PREFIXES)
# Every attribute own_agent_name reads: a span carrying none of them names no agent.
_AGENT_NAME_KEYS = frozenset(
    {records.AGENT_NAME, "gen_ai.agent.name", "agent.name", semantics.AGENTOPS_KIND, "graph.node.id", "recipient_agent_type", "metadata",
     "langgraph.node", *_METADATA_KEYS}
)


def own_agent_name(span: Span) -> str | None:
    """The agent name this span itself carries (see module docstring for the order), or None."""
    attrs = _attrs(span)
    if not attrs or _AGENT_NAME_KEYS.isdisjoint(attrs):  # every source below is one of these attributes
        return None
    for key in (records.AGENT_NAME, "gen_ai.agent.name", "agent.name"):
        name = _str_of(attrs, key)
        if name:
            return name
    if _lower_in(attrs, semantics.AGENTOPS_KIND, _AGENT):
        name = _str_of(attrs, "operation.name")
        if name:
            return name
    if _oi_kind(attrs) == "AGENT":
        name = _str_of(attrs, "graph.node.id")
        if name:
            return name
    name = _str_of(attrs, "recipient_agent_type")
    if name and (unwrap(attrs.get("messaging.operation")) in (None, "process")):
        return name
    name = _from_metadata_json(attrs)
    if name:
        return name
    for key in _METADATA_KEYS:
        name = _str_of(attrs, key)
        if name:
            return name
    return _str_of(attrs, "langgraph.node")


def inherited_agent_names(
    spans_by_id: Mapping[str, Span], parent_of: Mapping[str, str | None]
) -> dict[str, str | None]:
    """Agent name of every span: its own, else the nearest ancestor's that names one.

    ``parent_of`` is the (possibly repaired) tree; ids it maps to that are not in
    ``spans_by_id`` (a virtual root) end the walk. Memoised, so linear in spans.
    """
    resolved: dict[str, str | None] = {}
    for start in spans_by_id:
        chain: list[str] = []
        seen: set[str] = set()
        current: str | None = start
        name: str | None = None
        while current is not None and current in spans_by_id and current not in seen:
            if current in resolved:
                name = resolved[current]
                break
            seen.add(current)
            chain.append(current)
            name = own_agent_name(spans_by_id[current])
            if name is not None:
                break
            current = parent_of.get(current)
        for span_id in chain:
            resolved[span_id] = name
    return resolved
