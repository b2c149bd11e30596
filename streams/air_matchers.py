"""The built-in AIR matchers: which span outcomes count as a tool error, a timeout, invalid tool arguments.

Why a module of their own: :mod:`boltstream.streams.air` decides how a matched
span becomes a reward on an LLM call; this module only decides whether a span
matches. Each matcher comes in two forms: ``match_<name>(span)`` (public, what a
YAML rule or a test calls) and ``_<name>(span, kind)`` with the span's
:class:`~boltstream.streams.spans.SpanFlags` already known, which
:func:`~boltstream.streams.air.evaluate_air` uses so every span is classified
once per rollout instead of once per rule.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .spans import (
    Span,
    SpanFlags,
    attr,
    openinference_kind,
    reward_of,
    span_flags,
    status_code,
    status_message,
    unwrap,
)

Matcher = Callable[[Span], "bool | float | None"]
KindMatcher = Callable[[Span, SpanFlags], "bool | float | None"]

_TIMEOUT_TEXT = re.compile(r"time[ds]?[\s_-]?out|deadline[\s_-]?exceeded", re.IGNORECASE)
_TIMEOUT_HTTP_STATUS = frozenset({408, 504})
_LLM_OUTPUT_ARGS = re.compile(r"^llm\.output_messages\..*tool_call\.function\.arguments$")
_LLM_OUTPUT_PREFIX = "llm.output_messages."


def _unparsable_json(value: Any) -> bool:
    if not isinstance(value, str) or not value.strip():
        return False
    try:
        json.loads(value)
    except ValueError:
        return True
    return False


# Built-in matchers come in two forms: ``_name(span, kind)`` with the span's kind already known
# (what evaluate_air calls, classifying each span once), and the public ``match_name(span)``.


def _tool_error(span: Span, kind: SpanFlags) -> bool:
    return kind.tool and status_code(span) == "ERROR"


def _tool_args_invalid(span: Span, kind: SpanFlags) -> bool:
    if kind.llm:
        return any(
            key.startswith(_LLM_OUTPUT_PREFIX) and _LLM_OUTPUT_ARGS.match(key) and _unparsable_json(unwrap(value))
            for key, value in (span.get("attributes") or {}).items()
        )
    if not kind.tool:
        return False
    if _unparsable_json(attr(span, "gen_ai.tool.call.arguments")):
        return True
    return (
        openinference_kind(span) == "TOOL"
        and attr(span, "input.mime_type") == "application/json"
        and _unparsable_json(attr(span, "input.value"))
    )


def _timeout(span: Span, kind: SpanFlags) -> bool:
    if kind.llm:
        return False
    message = status_message(span)
    if message and _TIMEOUT_TEXT.search(message):
        return True
    for key in ("error.type", "exception.type", "exception.message"):
        value = attr(span, key)
        if isinstance(value, str) and _TIMEOUT_TEXT.search(value):
            return True
    for key in ("http.response.status_code", "http.status_code"):
        if attr(span, key) in _TIMEOUT_HTTP_STATUS:
            return True
    for event in span.get("events") or ():
        if event.get("name") != "exception":
            continue
        for key in ("exception.type", "exception.message"):
            value = (event.get("attributes") or {}).get(key)
            if isinstance(value, str) and _TIMEOUT_TEXT.search(value):
                return True
    return False


def _reward_span(span: Span, kind: SpanFlags) -> float | None:
    if not kind.reward:
        return None
    info = reward_of(span)
    if info is None or info.final:
        return None
    return info.value


def _span_error(span: Span, kind: SpanFlags) -> bool:
    return status_code(span) == "ERROR"


def _any_span(span: Span, kind: SpanFlags) -> bool:
    return True


def match_tool_error(span: Span) -> bool:
    """A tool span that ended with status ERROR."""
    return _tool_error(span, span_flags(span))


def match_tool_args_invalid(span: Span) -> bool:
    """Tool-call arguments the model produced that are not valid JSON."""
    return _tool_args_invalid(span, span_flags(span))


def match_timeout(span: Span) -> bool:
    """A non-LLM span marked as timed out by its status, attributes or exception events."""
    return _timeout(span, span_flags(span))


def match_reward_span(span: Span) -> float | None:
    """The value of an intermediate (non-final) reward span."""
    return _reward_span(span, span_flags(span))


def match_span_error(span: Span) -> bool:
    """Any span with status ERROR."""
    return _span_error(span, span_flags(span))


def match_any_span(span: Span) -> bool:
    """Every span (narrow it with ``span_name``)."""
    return True


WITH_KIND: dict[str, KindMatcher] = {
    "reward_span": _reward_span,
    "tool_args_invalid": _tool_args_invalid,
    "timeout": _timeout,
    "tool_error": _tool_error,
    "span_error": _span_error,
    "span": _any_span,
}

BUILTIN_MATCHERS: dict[str, Matcher] = {
    "reward_span": match_reward_span,
    "tool_args_invalid": match_tool_args_invalid,
    "timeout": match_timeout,
    "tool_error": match_tool_error,
    "span_error": match_span_error,
    "span": match_any_span,
}
