"""Carry rollout ids to the inference worker: HTTP headers, or the base URL for agents that cannot set them.

Why both: the inference worker writes the LLM span (with token ids) and must
key it by the same rollout id as the agent's spans. Most clients accept
``default_headers``; some agents only let you set a base URL, so the ids can
ride in the path instead.

Headers (:func:`headers_for`): ``X-Boltstream-Rollout-Id``,
``X-Boltstream-Attempt-Id``, ``X-Boltstream-Task-Id`` (omitted when there is no
task), plus W3C ``traceparent`` (the rollout's root span, so the worker's
span joins the rollout's trace) and ``baggage`` (the same ids).

Base URL (:func:`base_url_for`), the exact form the worker parses with
:func:`parse_rollout_path`::

    {root}/rollout/{rollout_id}/{attempt_id}/{task_id}/v1

``root`` is the given base URL without a trailing ``/v1``. Each id segment is
the id itself when it only uses ``A-Z a-z 0-9 . _ : @ + = -`` and does not
start with ``~``; otherwise ``~`` followed by the unpadded base64url of its
UTF-8 bytes. A missing id (no task) is written as ``~`` alone. No percent
encoding, because servers disagree on whether ``%2F`` in a path is a slash.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Protocol

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from boltstream.schemas.records import ID_ATTRIBUTES, SESSION_ATTRIBUTES

HEADER_ROLLOUT_ID = "X-Boltstream-Rollout-Id"
HEADER_ATTEMPT_ID = "X-Boltstream-Attempt-Id"
HEADER_TASK_ID = "X-Boltstream-Task-Id"
# "off": serve the request but write no span (evaluation traffic must never become training data).
HEADER_CAPTURE = "X-Boltstream-Capture"
NO_CAPTURE_SEGMENT = "nocapture"
_PLAIN = re.compile(r"^[A-Za-z0-9._:@+=-]+$")
_PATH = re.compile(r"^(?P<prefix>.*?)/rollout/(?P<r>[^/]+)/(?P<a>[^/]+)/(?P<t>[^/]+)(?P<rest>/.*)?$")
_TRACE = TraceContextTextMapPropagator()
_BAGGAGE = W3CBaggagePropagator()


class RolloutIds(Protocol):
    """What the wire format needs of a rollout (:class:`~boltstream.producers.context.RolloutContext`
    has it): this module sits below the rollout API, which builds its headers from it."""

    rollout_id: str
    attempt_id: str
    task_id: str | None
    capture: bool
    span: Any

    @property
    def ids(self) -> dict[str, str]: ...


def headers_for(ctx: RolloutIds) -> dict[str, str]:
    """The headers that carry ``ctx``'s ids to the inference worker."""
    if not ctx.capture:
        return {HEADER_CAPTURE: "off"}
    headers = {HEADER_ROLLOUT_ID: ctx.rollout_id, HEADER_ATTEMPT_ID: ctx.attempt_id}
    if ctx.task_id is not None:
        headers[HEADER_TASK_ID] = ctx.task_id
    octx = otel_context.get_current()
    if ctx.span is not None and trace.get_current_span(octx).get_span_context().trace_id != \
            ctx.span.get_span_context().trace_id:
        octx = trace.set_span_in_context(ctx.span, octx)
    for k, v in ctx.ids.items():
        octx = baggage.set_baggage(k, v, octx)
    carrier: dict[str, str] = {}
    _TRACE.inject(carrier, context=octx)
    _BAGGAGE.inject(carrier, context=octx)
    headers.update(carrier)
    return headers


def session_of(context: otel_context.Context | None = None) -> tuple[str, str] | None:
    """(attribute, value) of the conversation/session a context is in, or None.

    Baggage first (``gen_ai.conversation.id``, ``session.id``: what crosses processes), then
    OpenInference's ``using_session`` context value. Why: with no explicit rollout id the
    session IS the rollout (:func:`~boltstream.schemas.records.rollout_key`), so the agent's
    spans and the worker's must all carry it.
    """
    for name in SESSION_ATTRIBUTES:
        value = baggage.get_baggage(name, context)
        if value:
            return name, str(value)
    value = otel_context.get_value(SESSION_ATTRIBUTES[-1], context)
    return (SESSION_ATTRIBUTES[-1], value) if isinstance(value, str) and value else None


def session_from_headers(headers: Any) -> dict[str, str]:
    """The worker's side of :func:`session_of`: ``{attribute: session id}`` from a request's W3C baggage."""
    found = session_of(_BAGGAGE.extract({k.lower(): v for k, v in dict(headers).items()}))
    return dict([found]) if found else {}


def ids_from_headers(headers: Any) -> dict[str, str]:
    """The inverse, for the worker: ``{"boltstream.rollout_id": ..., ...}`` from a header mapping."""
    get = headers.get
    out: dict[str, str] = {}
    for key, name in zip(ID_ATTRIBUTES, (HEADER_ROLLOUT_ID, HEADER_ATTEMPT_ID, HEADER_TASK_ID), strict=True):
        v = get(name) or get(name.lower())
        if v:
            out[key] = v
    if len(out) < 2:  # fall back to W3C baggage
        bag = _BAGGAGE.extract({k.lower(): v for k, v in dict(headers).items()})
        for key in ID_ATTRIBUTES:
            v = baggage.get_baggage(key, bag)
            if v and key not in out:
                out[key] = str(v)
    return out


def encode_segment(value: str | None) -> str:
    if not value:
        return "~"
    if _PLAIN.match(value) and not value.startswith("~"):
        return value
    return "~" + base64.urlsafe_b64encode(value.encode("utf-8")).decode("ascii").rstrip("=")


def decode_segment(segment: str) -> str | None:
    if not segment.startswith("~"):
        return segment
    body = segment[1:]
    if not body:
        return None
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("utf-8")


def base_url_for(base_url: str, ctx: RolloutIds) -> str:
    """``{root}/rollout/{rollout_id}/{attempt_id}/{task_id}/v1`` for ``ctx``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    if not ctx.capture:
        return f"{root}/{NO_CAPTURE_SEGMENT}/v1"
    segs = "/".join(encode_segment(v) for v in (ctx.rollout_id, ctx.attempt_id, ctx.task_id))
    return f"{root}/rollout/{segs}/v1"


def parse_rollout_path(path: str) -> tuple[dict[str, str], str] | None:
    """Split ``.../rollout/<r>/<a>/<t>/v1/chat/completions`` into (ids, ``.../v1/chat/completions``).

    Returns None when the path carries no rollout segment (or a malformed one).
    """
    m = _PATH.match(path)
    if m is None:
        return None
    try:
        values = [decode_segment(m.group(g)) for g in ("r", "a", "t")]
    except (ValueError, UnicodeDecodeError):
        return None
    ids = {k: v for k, v in zip(ID_ATTRIBUTES, values, strict=True) if v}
    if ID_ATTRIBUTES[0] not in ids:
        return None
    return ids, (m.group("prefix") or "") + (m.group("rest") or "")
