"""The hand-written Span reader (schemas/span_decoder.py) against fastavro: the same records from the
same bytes, and ``SchemaError`` from the same bad bytes.

Both sides go through ``Codec.decode``: ``CODEC`` uses the hand-written reader for newest-Span
single-object records, ``FASTAVRO`` is the same codec with it detached (what ``decode`` did before).
"""

from __future__ import annotations

import json
import math
import random
from array import array
from dataclasses import replace
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from fastavro import schemaless_writer

from boltstream.producers.span_encoder import sample_record
from boltstream.schemas import Codec, SchemaError
from boltstream.schemas.loader import default_catalog
from boltstream.schemas.span_decoder import FastSpanDecoder, same
from tests.golden.regenerate import golden_path

CODEC = Codec()
FINGERPRINT = CODEC.catalog.latest("Span").fingerprint


def _fastavro_codec() -> Codec:
    codec = Codec()
    codec._by_fingerprint[FINGERPRINT] = replace(codec._by_fingerprint[FINGERPRINT], fast=None)
    return codec


FASTAVRO = _fastavro_codec()


def _outcome(codec: Codec, data: bytes) -> Any:
    """The decoded record, or the SchemaError (any other exception fails the test)."""
    try:
        return codec.decode(data, topic="t", expect="Span")
    except SchemaError as exc:
        assert str(exc).startswith("topic 't': "), exc
        return exc


def assert_same_outcome(data: bytes) -> Any:
    ours, theirs = _outcome(CODEC, data), _outcome(FASTAVRO, data)
    if isinstance(theirs, SchemaError) or isinstance(ours, SchemaError):
        assert isinstance(ours, SchemaError) and isinstance(theirs, SchemaError), (ours, theirs, data)
    else:
        assert same(ours, theirs), (ours, theirs)
    return ours


def test_the_codec_reads_newest_spans_by_hand_and_older_ones_with_fastavro() -> None:
    assert CODEC._by_fingerprint[FINGERPRINT].fast is not None
    v1 = CODEC.catalog.get("Span", 1).fingerprint
    assert CODEC._by_fingerprint[v1].fast is None  # schema resolution stays with fastavro
    data = CODEC.encode("Span", sample_record())
    assert same(CODEC.decode(data, expect="Span"), FASTAVRO.decode(data, expect="Span"))


def test_same_compares_types_nan_and_arrays() -> None:
    assert same({"a": [1.0, math.nan]}, {"a": [1.0, math.nan]})
    assert not same({"a": True}, {"a": 1})  # bool is not int, although True == 1
    assert not same({"a": 1}, {"b": 1})
    assert not same([1.0], [1])
    assert same(array("i", [1, 2]), array("i", [1, 2]))
    assert not same(array("i", [1, 2]), array("f", [1, 2]))
    assert not same(array("f", [math.nan]), array("f", [0.0]))


@pytest.mark.parametrize("path", [golden_path("Span", "single"), golden_path("Span", "single", version=1)])
def test_golden_spans(path: Path) -> None:
    record = assert_same_outcome(path.read_bytes())
    assert not isinstance(record, SchemaError)
    assert record["llm"] is not None and len(record["llm"]["prompt_token_ids"]) > 0


@pytest.mark.parametrize("empty", [False, True])
def test_sample_records(empty: bool) -> None:
    record = assert_same_outcome(CODEC.encode("Span", sample_record(empty=empty)))
    assert isinstance(record, dict)


# ------------------------------------------------------------------ randomized spans

_WORDS = ["", "a", "ü✓", "🦀 crab", "x" * 63, "y" * 64, "z" * 300, "null\x00byte", "\u2028", "日本語"]


def _text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(_WORDS)
    return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0xD800), rng.randrange(0x10000, 0x10FFFF)]))
                   for _ in range(rng.randrange(0, 80)))


def _long(rng: random.Random) -> int:
    return rng.choice([0, -1, 1, 63, 64, -64, -65, 2**63 - 1, -(2**63), rng.randrange(-(2**63), 2**63),
                       rng.randrange(-1000, 1000), 1_700_000_000_000_000_000 + rng.randrange(10**12)])


def _double(rng: random.Random) -> float:
    return rng.choice([math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308,
                       rng.uniform(-1e6, 1e6), rng.gauss(0, 1)])


def _value(rng: random.Random) -> Any:
    pick = rng.randrange(9)
    n = rng.choice([0, 1, 3, 200])
    return [None, rng.random() < 0.5, _long(rng), _double(rng), _text(rng),
            {"bools": [rng.random() < 0.5 for _ in range(n)]}, {"longs": [_long(rng) for _ in range(n)]},
            {"doubles": [_double(rng) for _ in range(n)]}, {"strings": [_text(rng) for _ in range(n)]}][pick]


def _attrs(rng: random.Random, most: int = 15) -> dict[str, Any]:
    return {_text(rng): _value(rng) for _ in range(rng.choice([0, rng.randrange(most + 1)]))}


def _opt(rng: random.Random, make: Any) -> Any:
    return None if rng.random() < 0.3 else make()


def _llm(rng: random.Random) -> dict[str, Any]:
    n = rng.choice([0, 1, 5, 100_000])
    return {"prompt_token_ids": [rng.randrange(-(2**31), 2**31) for _ in range(n)],
            "response_token_ids": array("i", [rng.randrange(200_000) for _ in range(rng.choice([0, 7]))]),
            "response_logprobs": [rng.choice([-0.5, math.nan, -math.inf, 0.0]) for _ in range(rng.choice([0, 7]))],
            "model": _opt(rng, lambda: _text(rng)), "policy_version": _long(rng),
            "temperature": _opt(rng, lambda: _double(rng)), "top_p": _opt(rng, lambda: _double(rng)),
            "max_tokens": _opt(rng, lambda: rng.randrange(-(2**31), 2**31)), "seed": _opt(rng, lambda: _long(rng)),
            "finish_reason": _opt(rng, lambda: "stop"), "input_tokens": _opt(rng, lambda: _long(rng)),
            "output_tokens": _opt(rng, lambda: _long(rng))}


def random_span(rng: random.Random) -> dict[str, Any]:
    return {
        "trace_id": f"{rng.getrandbits(128):032x}", "span_id": f"{rng.getrandbits(64):016x}",
        "parent_span_id": _opt(rng, lambda: f"{rng.getrandbits(64):016x}"), "name": _text(rng),
        "kind": rng.choice(["INTERNAL", "CLIENT", _text(rng)]), "start_time_ns": _long(rng), "end_time_ns": _long(rng),
        "status": {"code": rng.choice(["UNSET", "OK", "ERROR"]), "message": _opt(rng, lambda: _text(rng))},
        "attributes": _attrs(rng),
        "events": [{"name": _text(rng), "time_ns": _long(rng), "attributes": _attrs(rng, 3)}
                   for _ in range(rng.choice([0, 0, 1, 3]))],
        "resource": _attrs(rng, 4), "scope": _opt(rng, lambda: {"name": _text(rng), "version": _opt(rng, lambda: "1")}),
        "rollout_id": _opt(rng, lambda: _text(rng)), "attempt_id": _opt(rng, lambda: "t:0"),
        "task_id": _opt(rng, lambda: _text(rng)), "llm": None if rng.random() < 0.4 else _llm(rng),
    }


@pytest.mark.parametrize("seed", range(4))
def test_random_spans(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        record = assert_same_outcome(CODEC.encode("Span", random_span(rng)))
        assert isinstance(record, dict)


# ------------------------------------------------------------------ bad bytes


@pytest.mark.parametrize("empty", [False, True])
def test_every_truncation_fails_both_ways(empty: bool) -> None:
    data = CODEC.encode("Span", sample_record(empty=empty))
    for end in range(10, len(data)):
        with pytest.raises(SchemaError, match="topic 't': truncated or corrupt Span v2 record"):
            CODEC.decode(data[:end], topic="t", expect="Span")
        assert isinstance(_outcome(FASTAVRO, data[:end]), SchemaError)


def _body(value: dict[str, Any]) -> bytes:
    """Single-object bytes of a raw Span v2 dict (wire fields as given), bypassing the codec's packing."""
    latest = default_catalog().latest("Span")
    buf = BytesIO(b"\xc3\x01" + latest.fingerprint)
    buf.seek(0, 2)
    schemaless_writer(buf, latest.parsed, value)
    return buf.getvalue()


_SMALL = {**sample_record(empty=True), "attributes": {"k": "v"}}
_SMALL_BYTES = CODEC.encode("Span", _SMALL)
_ATTR_AT = _SMALL_BYTES.index(b"\x02k") + 2  # the attribute value's union position


@pytest.mark.parametrize(("data", "reason"), [
    (_SMALL_BYTES + b"\x00", "1 bytes left over after the record"),
    (_SMALL_BYTES[:_ATTR_AT] + b"\x12" + _SMALL_BYTES[_ATTR_AT + 1:], "union index 9 out of range"),
    (_SMALL_BYTES[:_ATTR_AT] + b"\x13" + _SMALL_BYTES[_ATTR_AT + 1:], "union index -10 out of range"),
    (_SMALL_BYTES.replace(b"\x02k", b"\x02\xff"), "UnicodeDecodeError"),
    (_SMALL_BYTES[:-1] + b"\xff", "ran past the end"),
    (_SMALL_BYTES[:-1] + b"\x04", "union index 2 out of range"),
    (_SMALL_BYTES.replace(b"\x02k", b"\x7fk"), "string of -64 bytes"),
    (_body({**sample_record(), "llm": {**sample_record()["llm"], "prompt_token_ids": [], "response_token_ids": [],
                                       "response_logprobs": [], "prompt_token_ids_i32": b"\x01\x02\x03\x04\x05",
                                       "response_token_ids_i32": b"", "response_logprobs_f32": b""}}),
     "corrupt Span v2 record: field prompt_token_ids: 5 bytes is not a whole number of i32 items"),
])
def test_corrupt_records_fail_both_ways(data: bytes, reason: str) -> None:
    with pytest.raises(SchemaError, match=reason):
        CODEC.decode(data, topic="t", expect="Span")
    assert isinstance(_outcome(FASTAVRO, data), SchemaError)


@pytest.mark.parametrize("data", [
    # fastavro indexes the union list: position -1 is the last branch (StringArray), -9 the first (null).
    _SMALL_BYTES[:_ATTR_AT] + b"\x01\x02\x02x\x00" + _SMALL_BYTES[_ATTR_AT + 3:],
    _SMALL_BYTES[:_ATTR_AT] + b"\x11" + _SMALL_BYTES[_ATTR_AT + 3:],
    # Non-canonical varints (a union position, a length): read like the canonical ones.
    _SMALL_BYTES[:_ATTR_AT] + b"\x88\x00" + _SMALL_BYTES[_ATTR_AT + 1:],
    _SMALL_BYTES[:10] + b"\xc0\x80\x00" + _SMALL_BYTES[11:],
    # Any non-zero byte is true; a map in two blocks, the second with a byte size (negative count).
    CODEC.encode("Span", {**_SMALL, "attributes": {"b": True}}).replace(b"\x02b\x02\x01", b"\x02b\x02\x07"),
    _SMALL_BYTES.replace(b"\x02\x02k\x08\x02v\x00", b"\x02\x02k\x08\x02v\x01\x0c\x02j\x00\x00"),
])
def test_odd_but_readable_bytes_read_the_same(data: bytes) -> None:
    assert isinstance(assert_same_outcome(data), dict)


def test_mutated_records_fail_or_read_the_same_both_ways() -> None:
    rng = random.Random(5)
    seeds = [CODEC.encode("Span", s) for s in (sample_record(), _SMALL, random_span(random.Random(1)))]
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(10, len(data))
            op = rng.randrange(3)
            if op == 0:
                data[at] = rng.randrange(256)
            elif op == 1:
                data.insert(at, rng.randrange(256))
            else:
                del data[at]
        assert_same_outcome(bytes(data))


# ------------------------------------------------------------------ the self-check


def _catalog_with(tmp_path: Path, change: Any) -> Codec:
    raw = json.loads(json.dumps(default_catalog().latest("Span").raw))
    change(raw)
    (tmp_path / "span").mkdir()
    (tmp_path / "span" / "v3.avsc").write_text(json.dumps(raw))
    return Codec(schema_dirs=[tmp_path])


def _retype_end_time(raw: dict[str, Any]) -> None:
    next(f for f in raw["fields"] if f["name"] == "end_time_ns")["type"] = "double"


def _extra_field(raw: dict[str, Any]) -> None:
    raw["fields"].append({"name": "sampler", "type": ["null", "string"], "default": None})


def _reorder_unions(raw: dict[str, Any]) -> None:
    fields = {f["name"]: f for f in raw["fields"]}
    fields["attributes"]["type"]["values"].reverse()
    for name in ("parent_span_id", "rollout_id", "attempt_id", "task_id", "llm"):
        fields[name]["type"].reverse()
    fields["status"]["type"]["fields"][1]["type"].reverse()


def _kind_enum(raw: dict[str, Any]) -> None:
    next(f for f in raw["fields"] if f["name"] == "kind")["type"] = {
        "type": "enum", "name": "SpanKind", "symbols": ["INTERNAL", "CLIENT", "SERVER", "PRODUCER", "CONSUMER"]}


def _three_branch_union(raw: dict[str, Any]) -> None:
    next(f for f in raw["fields"] if f["name"] == "parent_span_id")["type"] = ["null", "string", "long"]


@pytest.mark.parametrize("change", [_kind_enum, _three_branch_union])
def test_create_refuses_a_span_schema_it_cannot_read(tmp_path: Path, change: Any) -> None:
    codec = _catalog_with(tmp_path, change)
    assert FastSpanDecoder.create(codec) is None
    assert codec._by_fingerprint[codec.catalog.latest("Span").fingerprint].fast is None
    record = codec.decode(codec.encode("Span", sample_record()), expect="Span")  # fastavro, as before
    assert record["name"] == "n" * 200


def test_create_refuses_when_the_self_check_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = Codec()
    roundtrip = codec.reference_roundtrip

    def off_by_one(record: str, value: dict[str, Any]) -> tuple[bytes, int, dict[str, Any]]:
        data, offset, reference = roundtrip(record, value)
        return data, offset, {**reference, "end_time_ns": reference["end_time_ns"] + 1}

    monkeypatch.setattr(codec, "reference_roundtrip", off_by_one)
    assert FastSpanDecoder.create(codec) is None


@pytest.mark.parametrize("change", [_retype_end_time, _extra_field, _reorder_unions])
def test_the_layout_comes_from_the_schema(tmp_path: Path, change: Any) -> None:
    """A retyped field, an added field, reordered union branches: a different schema (so a different
    fingerprint), still read right."""
    codec = _catalog_with(tmp_path, change)
    assert codec._by_fingerprint[codec.catalog.latest("Span").fingerprint].fast is not None
    fast = FastSpanDecoder.create(codec)
    assert fast is not None
    for sample in (sample_record(), sample_record(empty=True), random_span(random.Random(3))):
        data, offset, reference = codec.reference_roundtrip("Span", sample)
        assert same(fast.decode(data, offset), reference)


_PARENT_AT = 10 + 33 + 17  # header, trace id, span id: the parent span id's union position


@pytest.mark.parametrize("data", [
    _SMALL_BYTES[:_PARENT_AT] + b"\x03" + _SMALL_BYTES[_PARENT_AT + 1:],  # position -2: null
    _SMALL_BYTES[:_PARENT_AT] + b"\x01\x02p" + _SMALL_BYTES[_PARENT_AT + 1:],  # position -1: the string
    # A block count of -2**63: fastavro's C negation leaves it negative, so the block is empty.
    _SMALL_BYTES.replace(b"\x02\x02k\x08\x02v\x00", b"\xff" * 9 + b"\x01\x00\x00"),
])
def test_negative_positions_and_counts_read_as_fastavro_reads_them(data: bytes) -> None:
    assert isinstance(assert_same_outcome(data), dict)
