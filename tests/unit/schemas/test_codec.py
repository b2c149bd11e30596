"""Codec: round trips, golden bytes, and every way bad input must fail (always as SchemaError)."""

from __future__ import annotations

import copy
import random
from io import BytesIO
from typing import Any

import pytest
from fastavro import schemaless_writer

from boltstream.schemas import RECORDS, Codec, InMemorySchemaRegistry, SchemaError
from boltstream.schemas.loader import default_catalog
from boltstream.schemas.packed import as_lists, pack_record
from tests.golden.regenerate import (
    GOLDEN_DIR,
    GOLDEN_SCHEMA_IDS,
    TOPICS,
    golden_bytes,
    golden_path,
    golden_registry,
)
from tests.unit.schemas.record_examples import EXAMPLES, MINIMAL, OLDER_VERSIONS

FRAMINGS = ("single", "confluent")


@pytest.fixture(scope="module")
def codecs() -> dict[str, Codec]:
    return {"single": Codec(), "confluent": Codec(registry=InMemorySchemaRegistry())}


@pytest.fixture(scope="module")
def golden_codec() -> Codec:
    """Decodes every golden fixture: knows the golden schema ids through its registry."""
    return Codec(registry=golden_registry())


def test_examples_cover_every_record() -> None:
    assert set(EXAMPLES) == set(RECORDS) == set(MINIMAL)


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("record", RECORDS)
def test_round_trip(codecs: dict[str, Codec], record: str, framing: str) -> None:
    example = EXAMPLES[record]
    before = copy.deepcopy(example)
    data = codecs[framing].encode(record, example, topic=TOPICS[record])
    assert data[:1] == (b"\x00" if framing == "confluent" else b"\xc3")
    assert as_lists(codecs[framing].decode(data, topic=TOPICS[record], expect=record)) == example
    assert example == before  # encode must not mutate the caller's dict


@pytest.mark.parametrize("framing", FRAMINGS)
def test_decoder_accepts_both_framings_whichever_way_it_was_built(
    codecs: dict[str, Codec], framing: str
) -> None:
    data = codecs[framing].encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    for other in FRAMINGS:
        if other == "single" and framing == "confluent":
            # A codec without a registry cannot resolve a Confluent id it never saw.
            with pytest.raises(SchemaError, match="no schema registry"):
                codecs[other].decode(data, topic="boltstream.spans")
        else:
            assert as_lists(codecs[other].decode(data, topic="boltstream.spans")) == EXAMPLES["Span"]


@pytest.mark.parametrize("record", RECORDS)
def test_minimal_record_gets_schema_defaults(codecs: dict[str, Codec], record: str) -> None:
    decoded = as_lists(codecs["single"].decode(codecs["single"].encode(record, MINIMAL[record]), expect=record))
    assert {k: decoded[k] for k in MINIMAL[record]} == MINIMAL[record]
    # Every field, except the packed wire fields (``token_ids_i32``...): they come back as ``token_ids``.
    fields = {f["name"] for f in default_catalog().latest(record).raw["fields"]}
    assert set(decoded) == {f for f in fields if not f.endswith(("_i32", "_f32", "_u8"))}


def test_record_name_aliases(codecs: dict[str, Codec]) -> None:
    codec = codecs["single"]
    expected = codec.encode("Task", EXAMPLES["Task"])
    assert codec.encode("task", EXAMPLES["Task"]) == expected
    assert codec.encode("boltstream.v1.Task", EXAMPLES["Task"]) == expected
    assert as_lists(codec.decode(expected, expect="boltstream.v1.Task")) == EXAMPLES["Task"]


def test_confluent_subject_is_topic_value_and_registered_once() -> None:
    registry = InMemorySchemaRegistry(first_id=7)
    codec = Codec(registry=registry)
    for _ in range(3):
        data = codec.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    codec.encode("Span", EXAMPLES["Span"])  # no topic: RecordNameStrategy subject
    assert data[:5] == b"\x00\x00\x00\x00\x07"
    assert registry.subjects == {"boltstream.spans-value": [7], "boltstream.v1.Span": [7]}
    assert registry.compatibility["boltstream.spans-value"] == "BACKWARD_TRANSITIVE"


@pytest.mark.parametrize("record", RECORDS)
def test_union_fast_path_writes_what_fastavro_would(codecs: dict[str, Codec], record: str) -> None:
    """The codec names union branches up front for speed; the bytes must not change."""
    plain = BytesIO()
    schemaless_writer(plain, default_catalog().latest(record).parsed, pack_record(record, EXAMPLES[record]))
    assert codecs["single"].encode(record, EXAMPLES[record])[10:] == plain.getvalue()


def test_union_fast_path_leaves_tuple_notation_alone(codecs: dict[str, Codec]) -> None:
    value = {**EXAMPLES["Span"], "attributes": {"k": ("boltstream.v1.StringArray", {"strings": ["a"]})}}
    decoded = codecs["single"].decode(codecs["single"].encode("Span", value))
    assert decoded["attributes"] == {"k": {"strings": ["a"]}}


# ---------------------------------------------------------------------------------------- golden


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("record", RECORDS)
def test_golden_bytes(golden_codec: Codec, record: str, framing: str) -> None:
    path = golden_path(record, framing)
    assert path.exists(), f"{path} missing: run tests/golden/regenerate.py"
    want = golden_bytes()[path]
    assert path.read_bytes() == want, (
        f"encoding {record} changed: {path.name} no longer matches. If the schema change is "
        "deliberate, run tests/golden/regenerate.py and commit the new fixtures."
    )
    assert as_lists(golden_codec.decode(path.read_bytes(), topic=TOPICS[record], expect=record)) == EXAMPLES[record]


OLDER_FIXTURES = [(v, r) for v, records in sorted(OLDER_VERSIONS.items()) for r in records]


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize(("version", "record"), OLDER_FIXTURES)
def test_older_golden_fixtures_decode_into_the_newest_shape(version: int, record: str, framing: str) -> None:
    """Data already in topics, written with an older schema version, reads with its new fields defaulted
    (Confluent: through a registry that holds the old schema under the id the data names)."""
    path = golden_path(record, framing, version)
    data = path.read_bytes()
    codec = Codec(registry=golden_registry(version)) if framing == "confluent" else Codec()
    if framing == "single":
        assert data[2:10] == default_catalog().get(record, version).fingerprint
    assert default_catalog().latest(record).version > version
    assert as_lists(codec.decode(data, topic=TOPICS[record], expect=record)) == OLDER_VERSIONS[version][record]


def test_every_older_fixture_on_disk_is_tested() -> None:
    tested = {golden_path(r, f, v) for v, r in OLDER_FIXTURES for f in FRAMINGS}
    assert set(GOLDEN_DIR.glob("v*/*.bin")) == tested


def test_golden_confluent_ids_are_fixed() -> None:
    for record, schema_id in GOLDEN_SCHEMA_IDS.items():
        assert golden_path(record, "confluent").read_bytes()[:5] == b"\x00" + schema_id.to_bytes(4, "big")


def test_golden_single_object_header_is_the_schema_fingerprint() -> None:
    for record in RECORDS:
        fingerprint = default_catalog().latest(record).fingerprint
        assert golden_path(record, "single").read_bytes()[:10] == b"\xc3\x01" + fingerprint


# ------------------------------------------------------------------------------------ bad input


def _raises(codec: Codec, data: bytes, match: str, topic: str = "boltstream.spans", **kw: Any) -> SchemaError:
    with pytest.raises(SchemaError, match=match) as info:
        codec.decode(data, topic=topic, **kw)
    assert f"topic {topic!r}" in str(info.value)
    assert isinstance(info.value, ValueError)
    return info.value


def test_empty_record(golden_codec: Codec) -> None:
    _raises(golden_codec, b"", "empty record")
    _raises(golden_codec, None, "no value .*tombstone")  # type: ignore[arg-type]
    _raises(golden_codec, "c301", "str, not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("record", RECORDS)
def test_every_truncation_is_a_schema_error(golden_codec: Codec, record: str, framing: str) -> None:
    data = golden_path(record, framing).read_bytes()
    for n in range(1, len(data)):
        with pytest.raises(SchemaError, match="truncated|corrupt") as info:
            golden_codec.decode(data[:n], topic=TOPICS[record])
        assert TOPICS[record] in str(info.value)


def test_wrong_magic_byte(golden_codec: Codec) -> None:
    body = golden_path("Span", "single").read_bytes()
    _raises(golden_codec, b'{"trace_id": "x"}', "wrong magic byte 0x7b")
    _raises(golden_codec, b"\xc3\x02" + body[2:], "wrong magic bytes 0xc3 0x02")
    _raises(golden_codec, b"\x01" + body[1:], "wrong magic byte 0x01")


def test_unknown_fingerprint(golden_codec: Codec) -> None:
    body = golden_path("Span", "single").read_bytes()[10:]
    err = _raises(
        golden_codec, b"\xc3\x01" + bytes(range(8)) + body, "unknown schema fingerprint 0001020304050607"
    )
    assert "unknown" in err.reason


def test_unknown_schema_id(golden_codec: Codec) -> None:
    body = golden_path("Span", "confluent").read_bytes()[5:]
    _raises(golden_codec, b"\x00\x00\x00\x03\xe7" + body, "unknown schema id 999")
    _raises(Codec(), b"\x00\x00\x00\x03\xe7" + body, "unknown schema id 999.*no schema registry")


def test_wrong_expected_type(golden_codec: Codec) -> None:
    for framing in FRAMINGS:
        data = golden_path("Trajectory", framing).read_bytes()
        _raises(golden_codec, data, "expected a Span record, got Trajectory", expect="Span")


def test_trailing_bytes(golden_codec: Codec) -> None:
    _raises(golden_codec, golden_path("Task", "single").read_bytes() + b"\x00", "1 bytes left over")


def test_random_corruption_never_escapes_as_another_exception(golden_codec: Codec) -> None:
    rnd = random.Random(42)
    for data in golden_bytes().values():
        start = 5 if data[0] == 0 else 10
        for _ in range(60):
            corrupt = bytearray(data)
            for _ in range(rnd.randint(1, 4)):
                corrupt[rnd.randrange(start, len(corrupt))] = rnd.randrange(256)
            try:
                golden_codec.decode(bytes(corrupt), topic="t")
            except SchemaError:
                pass  # anything else propagates and fails the test
        for _ in range(20):
            noise = data[:start] + rnd.randbytes(rnd.randint(0, 64))
            try:
                golden_codec.decode(noise, topic="t")
            except SchemaError:
                pass


def test_accepts_memoryview_and_bytearray(golden_codec: Codec) -> None:
    data = golden_path("Sample", "single").read_bytes()
    assert as_lists(golden_codec.decode(memoryview(data))) == EXAMPLES["Sample"]
    assert as_lists(golden_codec.decode(bytearray(data))) == EXAMPLES["Sample"]


# --------------------------------------------------------------------------- encode-side errors


@pytest.mark.parametrize(
    ("record", "change", "match"),
    [
        ("Span", {"start_time_ns": "yesterday"}, "start_time_ns.*str.*expected long"),
        ("Span", {"start_time_ns": 2**70}, "start_time_ns"),
        ("Span", {"name": None}, "name.*missing/None.*expected string"),
        ("Span", {"attributes": {"k": [1, 2]}}, "attributes.*list.*one of boolean, long"),
        ("Span", {"typo_field": 1}, "typo_field"),
        ("Span", {"llm": {"prompt_token_ids": [1, "two"]}}, "prompt_token_ids: cannot pack as i32"),
        ("Span", {"llm": {"prompt_token_ids": [2**31]}}, "prompt_token_ids: cannot pack as i32"),
        ("Span", {"llm": {"prompt_token_ids": b"abc"}}, "prompt_token_ids: 3 bytes is not a whole number"),
        ("Span", {"llm": {"prompt_token_ids": [1], "logprobs": [0.5]}}, "logprobs"),
        ("Span", {"attributes": {"k": {"longs": ["x"]}}}, "LongArray.longs.*str 'x'.*expected long"),
        ("Span", {"attributes": {"k": {"strings": "abc"}}}, "StringArray.strings.*str 'abc'.*expected array"),
        ("Span", {"resource": {"k": object()}}, "resource.*got object"),
        ("Sample", {"advantage": "high"}, "advantage.*expected double"),
        ("CheckpointEvent", {"files": [{"path": "a", "sha256": "b"}]}, "size"),
    ],
)
def test_invalid_record_on_encode(codecs: dict[str, Codec], record: str, change: dict, match: str) -> None:
    value = {**EXAMPLES[record], **change}
    for codec in codecs.values():
        with pytest.raises(SchemaError, match=match) as info:
            codec.encode(record, value, topic=TOPICS[record])
        assert f"topic {TOPICS[record]!r}: cannot encode {record}" in str(info.value)


def test_missing_required_field_on_encode(codecs: dict[str, Codec]) -> None:
    value = {k: v for k, v in EXAMPLES["Task"].items() if k != "payload_json"}
    with pytest.raises(SchemaError, match="payload_json"):
        codecs["single"].encode("Task", value, topic="boltstream.tasks")


def test_unknown_record_type_and_non_dict(codecs: dict[str, Codec]) -> None:
    with pytest.raises(SchemaError, match="unknown record type 'Spam'"):
        codecs["single"].encode("Spam", {}, topic="x")
    with pytest.raises(SchemaError, match="expected a dict, got list"):
        codecs["single"].encode("Task", [], topic="x")  # type: ignore[arg-type]


def test_from_registry_url() -> None:
    assert Codec.from_registry_url(None).framing == "single-object"
    assert Codec.from_registry_url("").registry is None
    codec = Codec.from_registry_url("http://127.0.0.1:1")
    assert codec.framing == "confluent"
    with pytest.raises(SchemaError, match="topic 'boltstream.spans'.*127.0.0.1:1"):
        codec.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
