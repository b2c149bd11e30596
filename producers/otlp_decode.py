"""OTLP trace payloads (what a Collector's ``kafka`` exporter writes) -> :class:`SpanInput` lists. Pure.

Why: agents in any language can feed boltstream through an OpenTelemetry
Collector; its ``kafka`` exporter writes one ``ExportTraceServiceRequest`` per
message, as protobuf (``otlp_proto``, the default) or OTLP/JSON
(``otlp_json``). Both are reduced to the same :class:`SpanInput` the SDK path
uses, so one normaliser decides the record.

OTLP/JSON differs from protobuf's canonical JSON in ways that matter: trace
and span ids are hex (not base64), enums are integers, 64-bit integers are
strings. We accept the spec's form and the common deviations (base64 ids,
enum names, snake_case keys, the pre-1.0 ``instrumentationLibrarySpans``).
Anything undecodable raises :class:`OtlpDecodeError` with the reason, which the
ingest turns into a dead letter.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from .normalise import SpanEventInput, SpanInput

KINDS = {0: "INTERNAL", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


class OtlpDecodeError(ValueError):
    """The payload is not an OTLP trace export request."""


def detect(data: bytes) -> str:
    """``otlp_json`` when the payload looks like a JSON object, else ``otlp_proto``."""
    return "otlp_json" if data.lstrip()[:1] == b"{" else "otlp_proto"


def decode(data: bytes, encoding: str = "auto") -> list[SpanInput]:
    """All spans in one message. ``encoding``: auto | otlp_proto | otlp_json."""
    if encoding == "auto":
        encoding = detect(data)
    if encoding == "otlp_json":
        return decode_json(data)
    if encoding == "otlp_proto":
        return decode_proto(data)
    raise OtlpDecodeError(f"unknown encoding {encoding!r}")


# ------------------------------------------------------------------ protobuf


def _any_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def _kvs(items: Any) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in items}


def decode_proto(data: bytes) -> list[SpanInput]:
    try:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError as exc:  # pragma: no cover - the [otlp] extra
        raise OtlpDecodeError(f"otlp_proto needs opentelemetry-proto (pip install 'boltstream[otlp]'): {exc}") \
            from exc
    from google.protobuf.message import DecodeError

    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise OtlpDecodeError(f"not an OTLP protobuf ExportTraceServiceRequest: {exc}") from exc
    out: list[SpanInput] = []
    for rs in req.resource_spans:
        resource = _kvs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for sp in ss.spans:
                if len(sp.trace_id) != 16 or len(sp.span_id) != 8:
                    raise OtlpDecodeError(f"span {sp.name!r} has invalid ids "
                                          f"(trace {len(sp.trace_id)} bytes, span {len(sp.span_id)} bytes)")
                out.append(SpanInput(
                    trace_id=sp.trace_id.hex(), span_id=sp.span_id.hex(),
                    parent_span_id=sp.parent_span_id.hex() or None, name=sp.name,
                    kind=KINDS.get(sp.kind, "INTERNAL"),
                    start_time_ns=_nanos(sp.start_time_unix_nano, "start_time_unix_nano"),
                    end_time_ns=_nanos(sp.end_time_unix_nano, "end_time_unix_nano"),
                    status_code=STATUS.get(sp.status.code, "UNSET"), status_message=sp.status.message or None,
                    attributes=_kvs(sp.attributes),
                    events=tuple(SpanEventInput(e.name, _nanos(e.time_unix_nano, "time_unix_nano"), _kvs(e.attributes))
                                 for e in sp.events),
                    resource=resource, scope_name=ss.scope.name or None, scope_version=ss.scope.version or None,
                ))
    if not out and data and not req.resource_spans:
        raise OtlpDecodeError("payload decoded to an empty request (not OTLP traces?)")
    return out


# ------------------------------------------------------------------ JSON


def _get(d: Mapping[str, Any], camel: str, default: Any = None) -> Any:
    if camel in d:
        return d[camel]
    snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
    return d.get(snake, default)


def _json_value(v: Mapping[str, Any] | None) -> Any:
    if not v:
        return None
    for key, conv in (("stringValue", str), ("boolValue", bool), ("intValue", int), ("doubleValue", float)):
        x = _get(v, key)
        if x is not None:
            return conv(x)
    arr = _get(v, "arrayValue")
    if arr is not None:
        return [_json_value(x) for x in arr.get("values", [])]
    kvl = _get(v, "kvlistValue")
    if kvl is not None:
        return _json_kvs(kvl.get("values", []))
    b = _get(v, "bytesValue")
    if b is not None:
        return base64.b64decode(b)
    return None


def _json_kvs(items: Any) -> dict[str, Any]:
    out = {}
    for kv in items or ():
        key = kv["key"]
        if not isinstance(key, str):
            raise OtlpDecodeError(f"attribute key must be a string, got {type(key).__name__} {key!r:.40}")
        out[key] = _json_value(kv.get("value"))
    return out


def _json_id(v: Any, nbytes: int, what: str) -> str | None:
    if not v:
        return None
    s = str(v)
    if len(s) == 2 * nbytes:
        try:
            bytes.fromhex(s)
            return s.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == nbytes:
        return raw.hex()
    raise OtlpDecodeError(f"invalid {what} {s!r}")


def _nanos(v: Any, what: str) -> int:
    """A unix-nanosecond time: an Avro long, so a value past 2^63 (a protobuf fixed64 can hold one) would
    wrap silently in the record."""
    ns = int(v)
    if not 0 <= ns < 2**63:
        raise OtlpDecodeError(f"{what} {ns} is outside [0, 2^63)")
    return ns


def _opt_str(v: Any, what: str) -> str | None:
    """An optional string field; anything else is refused (the record schema holds strings only)."""
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise OtlpDecodeError(f"{what} must be a string, got {type(v).__name__} {v!r:.40}")
    return v


def _enum(v: Any, table: Mapping[int, str], prefix: str, default: str) -> str:
    if isinstance(v, int):
        return table.get(v, default)
    if isinstance(v, str):
        name = v.removeprefix(prefix)
        return name if name in table.values() else default
    return default


def decode_json(data: bytes) -> list[SpanInput]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurd nesting
        raise OtlpDecodeError(f"invalid OTLP JSON: {type(exc).__name__}: {exc}") from exc
    if not isinstance(doc, dict) or _get(doc, "resourceSpans") is None:
        raise OtlpDecodeError("OTLP JSON has no resourceSpans")
    out: list[SpanInput] = []
    try:
        for rs in _get(doc, "resourceSpans"):
            resource = _json_kvs((_get(rs, "resource") or {}).get("attributes"))
            for ss in _get(rs, "scopeSpans") or _get(rs, "instrumentationLibrarySpans") or ():
                scope = _get(ss, "scope") or _get(ss, "instrumentationLibrary") or {}
                for sp in ss.get("spans", ()):
                    status = sp.get("status") or {}
                    out.append(SpanInput(
                        trace_id=_json_id(_get(sp, "traceId"), 16, "trace id") or "",
                        span_id=_json_id(_get(sp, "spanId"), 8, "span id") or "",
                        parent_span_id=_json_id(_get(sp, "parentSpanId"), 8, "parent span id"),
                        name=str(sp.get("name", "")),
                        kind=_enum(sp.get("kind", 1), KINDS, "SPAN_KIND_", "INTERNAL"),
                        start_time_ns=_nanos(_get(sp, "startTimeUnixNano", 0), "startTimeUnixNano"),
                        end_time_ns=_nanos(_get(sp, "endTimeUnixNano", 0), "endTimeUnixNano"),
                        status_code=_enum(status.get("code", 0), STATUS, "STATUS_CODE_", "UNSET"),
                        status_message=_opt_str(status.get("message"), "status message"),
                        attributes=_json_kvs(sp.get("attributes")),
                        events=tuple(SpanEventInput(str(e.get("name", "")),
                                                    _nanos(_get(e, "timeUnixNano", 0), "timeUnixNano"),
                                                    _json_kvs(e.get("attributes"))) for e in sp.get("events", ())),
                        resource=resource, scope_name=_opt_str(scope.get("name"), "scope name"),
                        scope_version=_opt_str(scope.get("version"), "scope version"),
                    ))
    except OtlpDecodeError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        raise OtlpDecodeError(f"malformed OTLP JSON: {type(exc).__name__}: {exc}") from exc
    for s in out:
        if not s.trace_id or not s.span_id:
            raise OtlpDecodeError(f"span {s.name!r} lacks a trace or span id")
    return out
