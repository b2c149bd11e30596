"""Fuzz the OTLP ingest's message handling (decode -> normalise -> Span encoding): every payload a
Collector topic can hold either becomes Span records that decode again, or raises the two errors the
ingest dead-letters (``OtlpDecodeError``, ``SchemaError``), never anything else, never a hang."""

from __future__ import annotations

import json
import time
from typing import Any

from google.protobuf.json_format import MessageToDict
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from boltstream.config import Settings
from boltstream.producers.otlp_decode import OtlpDecodeError
from boltstream.producers.otlp_ingest import span_records
from boltstream.producers.span_encoder import SpanRecordEncoder
from boltstream.schemas import SchemaError
from tests.unit.fuzz.fuzzing import JSON_VALUES, fuzz_settings, mutated
from tests.unit.producers.test_producers_otlp import _spec_json, sdk_spans

SLOW_S = 2.0  # CPU seconds of this thread (a stalled, loaded machine does not count): a pathological loop
ENCODER = SpanRecordEncoder(Settings())
_SPANS = sdk_spans()
PROTO = encode_spans(_SPANS).SerializeToString()
SPEC_JSON = _spec_json(_SPANS)
PB_JSON = json.dumps(MessageToDict(encode_spans(_SPANS))).encode()
SEEDS = [PROTO, SPEC_JSON, PB_JSON]


def _check(payload: bytes, encoding: str = "auto") -> None:
    t0 = time.thread_time()
    try:
        records, _ = span_records(payload, encoding, ENCODER)
    except (OtlpDecodeError, SchemaError):
        pass
    else:
        for key, value in records:
            span = ENCODER.codec.decode(value, topic="fuzz", expect="Span")
            assert isinstance(key, bytes) and span["trace_id"] and span["span_id"]
    assert time.thread_time() - t0 < SLOW_S, f"{len(payload)} bytes took {time.thread_time() - t0:.1f}s"


@fuzz_settings()
@given(st.binary(max_size=2048), st.sampled_from(["auto", "otlp_proto", "otlp_json"]))
def test_arbitrary_bytes(payload: bytes, encoding: str) -> None:
    _check(payload, encoding)


@fuzz_settings()
@given(mutated(SEEDS))
def test_mutated_payloads(payload: bytes) -> None:
    _check(payload)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


@st.composite
def damaged_documents(draw: st.DrawFn) -> bytes:
    """The spec's OTLP/JSON with a few subtrees replaced by arbitrary JSON (type confusion,
    huge numbers, wrong ids), the way a buggy or hostile producer writes it."""
    doc = json.loads(draw(st.sampled_from([SPEC_JSON, PB_JSON])))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        *parent_path, last = draw(st.sampled_from(paths))
        parent = doc
        for step in parent_path:
            parent = parent[step]
        parent[last] = draw(JSON_VALUES)
    return json.dumps(doc).encode()


@fuzz_settings()
@given(damaged_documents())
def test_damaged_json_documents(payload: bytes) -> None:
    _check(payload, "otlp_json")
