"""Finished spans -> ``Span`` record dicts (schemas/span/v2.avsc). Pure functions, no I/O.

Why a neutral :class:`SpanInput`: two very different sources feed the spans
topic, the in-process SDK (``ReadableSpan``) and an OpenTelemetry Collector
(OTLP protobuf/JSON via ``otlp_ingest``). Both are first turned into a
``SpanInput`` so one function, :func:`normalise`, decides the record: ids as
lowercase hex, attributes converted to the schema's union, GenAI dialects
mapped (see :mod:`boltstream.producers.genai`), ids promoted.

Promoted ids (``rollout_id``, ``attempt_id``, ``task_id``) are looked up in
this order: span attributes (``boltstream.*``, which is also what
:class:`~boltstream.producers.rollout_processor.RolloutSpanProcessor` copies from
baggage, then ``agentlightning.*``), resource attributes (a process-per-rollout
agent can set them with ``OTEL_RESOURCE_ATTRIBUTES``; Agent Lightning puts them
there), then the caller's defaults (``BOLTSTREAM_ROLLOUT_ID`` etc. for
env-only agents).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode

from boltstream.schemas import records

from .attributes import as_str, convert_attributes
from .genai import TOKEN_KEYS, derived_attributes
from .otel_internals import attribute_dict, span_attribute_dict

_KIND_NAMES = {k: k.name for k in SpanKind}
_STATUS_NAMES = {c: c.name for c in StatusCode}

# (attribute names to look for, promoted field), per id: ours, then Agent Lightning's.
_ID_LOOKUP = tuple(((ours, theirs), fld) for fld, ours, theirs in zip(
    records.ID_FIELDS, records.ID_ATTRIBUTES, records.AGENTLIGHTNING_ID_ATTRIBUTES, strict=True))
TRUNCATED = records.TRUNCATED


@dataclass(frozen=True, slots=True)
class SpanEventInput:
    name: str
    time_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpanInput:
    """What every source of spans is reduced to before it becomes a record."""

    trace_id: int | str
    span_id: int | str
    name: str
    start_time_ns: int
    end_time_ns: int
    parent_span_id: int | str | None = None
    kind: str = "INTERNAL"
    status_code: str = "UNSET"
    status_message: str | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    events: Sequence[SpanEventInput] = ()
    resource: Mapping[str, Any] = field(default_factory=dict)
    scope_name: str | None = None
    scope_version: str | None = None


def hex_id(v: int | str | bytes | None, width: int) -> str | None:
    """Trace/span id as lowercase hex of the given width; None for missing/zero ids."""
    if v is None:
        return None
    if isinstance(v, bytes | bytearray):
        v = bytes(v).hex()
    if isinstance(v, int):
        return format(v, f"0{width}x") if v else None
    s = str(v).strip().lower()
    if not s or set(s) == {"0"}:
        return None
    return s.rjust(width, "0")


def from_readable(span: Any) -> SpanInput:
    """Adapt an OTel SDK ``ReadableSpan`` (duck-typed, so tests may pass stand-ins)."""
    ctx = span.context
    parent = span.parent
    status = span.status
    scope = getattr(span, "instrumentation_scope", None)
    resource = getattr(span, "resource", None)
    return SpanInput(
        trace_id=ctx.trace_id,
        span_id=ctx.span_id,
        parent_span_id=parent.span_id if parent is not None else None,
        name=span.name,
        kind=span.kind.name if hasattr(span.kind, "name") else str(span.kind),
        start_time_ns=span.start_time or 0,
        end_time_ns=span.end_time or span.start_time or 0,
        status_code=status.status_code.name if status is not None else "UNSET",
        status_message=(status.description or None) if status is not None else None,
        attributes=span_attribute_dict(span),
        events=tuple(SpanEventInput(e.name, e.timestamp or 0, attribute_dict(e.attributes)) for e in span.events),
        resource=resource.attributes if resource is not None else {},
        scope_name=scope.name if scope is not None else None,
        scope_version=(scope.version or None) if scope is not None else None,
    )


def _ids(attrs: Mapping[str, Any], resource: Mapping[str, Any],
         defaults: Mapping[str, str | None] | None) -> tuple[str | None, str | None, str | None]:
    """(rollout_id, attempt_id, task_id) from attributes, then resource, then defaults."""
    r, a, t = (attrs.get(k) for k in records.ID_ATTRIBUTES)
    if type(r) is str and r and type(a) is str and a and type(t) is str and t:
        return r, a, t  # what RolloutSpanProcessor stamps on every span of a rollout: nothing to look up
    out: list[str | None] = []
    for keys, fld in _ID_LOOKUP:
        val = attrs.get(keys[0])  # fast path: what RolloutSpanProcessor stamps
        if type(val) is not str or not val:
            val = None
            for source in (attrs, resource):
                for k in keys:
                    val = as_str(source.get(k))
                    if val:
                        break
                if val:
                    break
        out.append(val or (defaults.get(fld) if defaults else None) or None)
    return out[0], out[1], out[2]


def promoted_ids(
    attrs: Mapping[str, Any], resource: Mapping[str, Any], defaults: Mapping[str, str | None] | None = None
) -> dict[str, str | None]:
    """rollout_id / attempt_id / task_id from attributes, then resource, then defaults."""
    return dict(zip(records.ID_FIELDS, _ids(attrs, resource, defaults), strict=True))


def _build(
    trace_hex: str, span_hex: str, parent_hex: str | None, name: str, kind: str, start: int, end: int,
    status_code: str, status_message: str | None, raw: Mapping[str, Any],
    events: Sequence[tuple[str, int, Mapping[str, Any]]], resource_raw: Mapping[str, Any],
    resource: Mapping[str, Any], scope_name: str | None, scope_version: str | None,
    defaults: Mapping[str, str | None] | None,
) -> dict[str, Any]:
    added, llm, consumed = derived_attributes(name, raw)
    # One pass builds the attribute map without what moved elsewhere: token arrays (now typed
    # int/float arrays in the llm block) and flattened messages (now in gen_ai.*.messages JSON).
    attrs = convert_attributes(raw) if llm is None else convert_attributes(
        raw, TOKEN_KEYS.union(consumed) if consumed else TOKEN_KEYS)
    if added:  # derived values are str / float / bool already: nothing to convert
        attrs.update(added)
    ids = _ids(raw, resource_raw, defaults)
    for attr, val in zip(records.ID_ATTRIBUTES, ids, strict=True):  # the promoted ids as attributes too (uniform queries)
        if val is not None and attr not in attrs:
            attrs[attr] = val
    return {
        "trace_id": trace_hex,
        "span_id": span_hex,
        "parent_span_id": parent_hex,
        "name": name,
        "kind": kind or "INTERNAL",
        "start_time_ns": start,
        "end_time_ns": end,
        "status": {"code": status_code or "UNSET", "message": status_message},
        "attributes": attrs,
        "events": [{"name": n, "time_ns": t, "attributes": convert_attributes(a)} for n, t, a in events]
        if events else [],
        "resource": resource,
        "scope": {"name": scope_name, "version": scope_version} if scope_name is not None else None,
        "rollout_id": ids[0],
        "attempt_id": ids[1],
        "task_id": ids[2],
        "llm": llm,
    }


def normalise(
    inp: SpanInput,
    defaults: Mapping[str, str | None] | None = None,
    resource: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``Span`` record dict. ``resource`` may pass an already converted resource map (a cache)."""
    return _build(
        hex_id(inp.trace_id, 32) or "0" * 32, hex_id(inp.span_id, 16) or "0" * 16,
        hex_id(inp.parent_span_id, 16), inp.name, inp.kind, int(inp.start_time_ns), int(inp.end_time_ns),
        inp.status_code, inp.status_message, inp.attributes,
        [(e.name, int(e.time_ns), e.attributes) for e in inp.events], inp.resource,
        resource if resource is not None else convert_attributes(inp.resource),
        inp.scope_name, inp.scope_version, defaults,
    )


def normalise_span(span: Any, defaults: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """``ReadableSpan`` -> ``Span`` record dict."""
    return normalise(from_readable(span), defaults)



class SpanNormaliser:
    """:func:`normalise` with a per-Resource cache: the exporter's hot path.

    A process has one or two ``Resource`` objects shared by every span;
    converting their attributes once instead of per span is measurable at
    20k spans/s. The cache is keyed by ``id()`` and holds the object itself so
    the id cannot be reused while cached.
    """

    def __init__(self, defaults: Mapping[str, str | None] | None = None, max_cached: int = 16) -> None:
        self.defaults = dict(defaults or {})
        self._cache: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._max = max_cached
        self._trace_hex: dict[int, str] = {}
        self._span_hex: dict[int, str] = {}

    def _resource(self, resource: Any) -> dict[str, Any]:
        hit = self._cache.get(id(resource))
        if hit is not None and hit[0] is resource:
            return hit[1]
        converted = convert_attributes(resource.attributes if resource is not None else {})
        if len(self._cache) >= self._max:
            self._cache.clear()
        self._cache[id(resource)] = (resource, converted)
        return converted

    def _hex(self, cache: dict[int, str], v: int, fmt: str) -> str:
        h = cache.get(v)
        if h is None:
            if len(cache) >= 4096:
                cache.clear()
            h = cache[v] = format(v, fmt)
        return h

    def __call__(self, span: Any) -> dict[str, Any]:
        try:  # ReadableSpan's public properties; the enum names by dict lookup
            ctx, parent, status, scope, res = (span.context, span.parent, span.status,
                                               span.instrumentation_scope, span.resource)
            kind = _KIND_NAMES[span.kind]
            code = _STATUS_NAMES[status.status_code] if status is not None else "UNSET"
        except (AttributeError, KeyError):
            return normalise(from_readable(span), self.defaults, self._resource(getattr(span, "resource", None)))
        start = span.start_time or 0
        events = span.events
        return _build(  # a trace's id, and its parents' ids, recur on many spans: formatted once
            self._hex(self._trace_hex, ctx.trace_id, "032x"), format(ctx.span_id, "016x"),
            self._hex(self._span_hex, parent.span_id, "016x") if parent is not None else None,
            span.name, kind, start, span.end_time or start,
            code, (status.description or None) if status is not None else None,
            span_attribute_dict(span),
            [(e.name, e.timestamp or 0, attribute_dict(e.attributes)) for e in events] if events else (),
            res.attributes if res is not None else {}, self._resource(res),
            scope.name if scope is not None else None, (scope.version or None) if scope is not None else None,
            self.defaults,
        )
