"""OTLP payloads (protobuf and JSON, as a Collector's kafka exporter writes them) -> Span records."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from boltstream.producers.normalise import normalise, normalise_span
from boltstream.producers.otlp_decode import OtlpDecodeError, decode, detect


def sdk_spans() -> list[ReadableSpan]:
    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({"service.name": "go-agent", "boltstream.task_id": "t7"}))
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("scope", "2.0")
    with tracer.start_as_current_span("root", attributes={"boltstream.rollout_id": "r1"}):
        with tracer.start_as_current_span("chat", kind=SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 5, "response_token_ids": [1, 2],
                "flags": [True, False], "ratio": 0.5}) as sp:
            sp.add_event("retry", {"n": 1})
            sp.set_status(Status(StatusCode.ERROR, "bad"))
    return list(mem.get_finished_spans())


def comparable(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if k != "resource"} | {"resource": {
        k: v for k, v in rec["resource"].items() if not k.startswith("telemetry.")}}


def test_proto_round_trip_matches_the_sdk_path() -> None:
    spans = sdk_spans()
    payload = encode_spans(spans).SerializeToString()
    assert detect(payload) == "otlp_proto"
    decoded = decode(payload)
    assert [s.name for s in decoded] == ["chat", "root"]
    via_otlp = [normalise(s) for s in decoded]
    via_sdk = [normalise_span(s) for s in spans]
    for a, b in zip(via_otlp, via_sdk, strict=True):
        assert comparable(a) == comparable(b)
    chat = via_otlp[0]
    assert chat["kind"] == "CLIENT" and chat["status"] == {"code": "ERROR", "message": "bad"}
    assert chat["llm"]["response_token_ids"].tolist() == [1, 2] and chat["llm"]["input_tokens"] == 5
    assert chat["task_id"] == "t7", "task id promoted from the resource"
    assert chat["attributes"]["flags"] == {"bools": [True, False]}


def _spec_json(spans: list[ReadableSpan]) -> bytes:
    """OTLP/JSON as the spec writes it: hex ids, integer enums, int64 as strings."""
    doc = MessageToDict(encode_spans(spans), preserving_proto_field_name=False, use_integers_for_enums=True)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in sp:
                        sp[key] = base64.b64decode(sp[key]).hex()
    return json.dumps(doc).encode()


@pytest.mark.parametrize("variant", ["spec", "protobuf-json (base64 ids, enum names)"])
def test_json_variants(variant: str) -> None:
    spans = sdk_spans()
    if variant == "spec":
        payload = _spec_json(spans)
    else:
        payload = json.dumps(MessageToDict(encode_spans(spans))).encode()
    assert detect(payload) == "otlp_json"
    via_json = [normalise(s) for s in decode(payload)]
    via_sdk = [normalise_span(s) for s in spans]
    for a, b in zip(via_json, via_sdk, strict=True):
        assert comparable(a) == comparable(b)


def test_legacy_instrumentation_library_spans() -> None:
    doc = {"resourceSpans": [{"resource": {"attributes": []}, "instrumentationLibrarySpans": [{
        "instrumentationLibrary": {"name": "old"},
        "spans": [{"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "s", "kind": "SPAN_KIND_SERVER",
                   "startTimeUnixNano": "5", "endTimeUnixNano": "6",
                   "attributes": [{"key": "m", "value": {"kvlistValue": {"values": [
                       {"key": "a", "value": {"intValue": "3"}}]}}}]}]}]}]}
    (s,) = decode(json.dumps(doc).encode())
    rec = normalise(s)
    assert rec["kind"] == "SERVER" and rec["scope"]["name"] == "old" and rec["start_time_ns"] == 5
    assert rec["attributes"]["m"] == '{"a": 3}'


@pytest.mark.parametrize("payload", [
    b"\xff\xfe garbage",
    b"{not json",
    b'{"something": "else"}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "cd"}]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "no ids"}]}]}]}',
])
def test_undecodable_payloads_raise(payload: bytes) -> None:
    with pytest.raises(OtlpDecodeError):
        decode(payload)


def test_unknown_encoding() -> None:
    with pytest.raises(OtlpDecodeError):
        decode(b"{}", "otlp_avro")


def _one_span_doc(**span: Any) -> bytes:
    sp = {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "s", "startTimeUnixNano": "5", "endTimeUnixNano": "6",
          **span}
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [sp]}]}]}).encode()


# Found by tests/unit/fuzz/test_fuzz_otlp_ingest.py: each once escaped as a non-OtlpDecodeError (or, the
# 2^70 time, wrapped silently to 64 in the Span record).
@pytest.mark.parametrize(("payload", "why"), [
    (_one_span_doc(status={"message": True}), "status message must be a string"),
    (_one_span_doc(scope=None, attributes=[{"key": None, "value": {"intValue": "1"}}]), "attribute key"),
    (_one_span_doc(startTimeUnixNano=str(2**70)), r"outside \[0, 2\^63\)"),
    (_one_span_doc(endTimeUnixNano="-1"), r"outside \[0, 2\^63\)"),
    (_one_span_doc(events=[{"name": "e", "timeUnixNano": 2**64}]), r"outside \[0, 2\^63\)"),
    (_one_span_doc(startTimeUnixNano=1e400), "OverflowError"),
    (b'{"resourceSpans": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "RecursionError"),
])
def test_hostile_json_is_refused_with_a_reason(payload: bytes, why: str) -> None:
    with pytest.raises(OtlpDecodeError, match=why):
        decode(payload)


@pytest.mark.parametrize("field", ["start", "end", "event"])
def test_protobuf_times_beyond_an_avro_long_are_refused(field: str) -> None:
    """fixed64 in OTLP, long in the Span record: 2^64-1 came out as -1 before."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    sp = req.resource_spans.add().scope_spans.add().spans.add()
    sp.trace_id, sp.span_id, sp.name = b"a" * 16, b"b" * 8, "s"
    sp.start_time_unix_nano, sp.end_time_unix_nano = 5, 6
    if field == "event":
        sp.events.add().time_unix_nano = 2**64 - 1
    else:
        setattr(sp, f"{field}_time_unix_nano", 2**63)
    with pytest.raises(OtlpDecodeError, match=r"outside \[0, 2\^63\)"):
        decode(req.SerializeToString())
