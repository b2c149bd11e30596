"""Schema evolution: data written with an older version is read with a newer reader schema.

Two kinds: added defaulted fields (a future Span v3 in a tmp dir layered over the packaged schemas with
``Codec(schema_dirs=...)``), and the move of token payloads from Avro arrays into packed bytes (Span
v1 -> v2, Trajectory/Sample/TrainingBatch v2 -> v3; the golden fixtures of the old versions are in
tests/golden/v1 and v2, and test_codec decodes them all).
"""

from __future__ import annotations

import json
import struct
from array import array
from io import BytesIO
from pathlib import Path

import pytest
from fastavro import schemaless_reader, schemaless_writer

from boltstream.schemas import Codec, InMemorySchemaRegistry, SchemaCatalog, SchemaError
from boltstream.schemas.loader import default_catalog
from boltstream.schemas.packed import as_lists, has_packed_fields
from tests.golden.regenerate import TOPICS, golden_path, golden_registry
from tests.unit.schemas.record_examples import (
    EXAMPLES,
    OLDER_VERSIONS,
    PROMPT_IDS,
    RESPONSE_IDS,
    RESPONSE_LOGPROBS,
)

ADDED_FIELDS = [
    {"name": "sampler", "type": ["null", "string"], "default": None},
    {"name": "priority", "type": "int", "default": 5},
]


@pytest.fixture
def v2_dir(tmp_path: Path) -> Path:
    """``span/v3.avsc``: today's Span plus two fields with defaults, as a real schema change would add
    them (named ``v2_dir`` for the reader: "the next version")."""
    raw = json.loads(json.dumps(default_catalog().latest("Span").raw))
    raw["fields"].extend(ADDED_FIELDS)
    (tmp_path / "span").mkdir()
    (tmp_path / "span" / "v3.avsc").write_text(json.dumps(raw, indent=2))
    return tmp_path


def _with_defaults(record: dict) -> dict:
    return {**record, "sampler": None, "priority": 5}


def test_v2_is_the_newest_and_v1_is_still_known(v2_dir: Path) -> None:
    codec = Codec(schema_dirs=[v2_dir])
    assert [sv.version for sv in codec.catalog.versions("Span")] == [1, 2, 3]
    assert codec.catalog.latest("Span").version == 3
    assert default_catalog().latest("Span").version == 2  # the shared catalog is untouched


def test_single_object_v1_writer_v2_reader(v2_dir: Path) -> None:
    old, new = Codec(), Codec(schema_dirs=[v2_dir])
    data = old.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    assert as_lists(new.decode(data, topic="boltstream.spans", expect="Span")) == _with_defaults(EXAMPLES["Span"])
    # The new codec writes v3 (another fingerprint) and reads its own data back unchanged.
    value = {**EXAMPLES["Span"], "sampler": "top-k", "priority": 1}
    written = new.encode("Span", value, topic="boltstream.spans")
    assert written[2:10] != data[2:10]
    assert as_lists(new.decode(written, topic="boltstream.spans")) == value
    # Without a registry the old codec cannot know v3's fingerprint: a clear error, not garbage.
    with pytest.raises(SchemaError, match="unknown schema fingerprint"):
        old.decode(written, topic="boltstream.spans")


def test_confluent_v1_writer_v2_reader_via_registry(v2_dir: Path) -> None:
    registry = InMemorySchemaRegistry()
    old = Codec(registry=registry)
    data = old.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    # A separate process: shares only the registry, resolves id -> v2 writer -> newest (v3) reader.
    new = Codec(registry=registry, schema_dirs=[v2_dir])
    assert as_lists(new.decode(data, topic="boltstream.spans", expect="Span")) == _with_defaults(EXAMPLES["Span"])
    # And forward: the old reader reads v3 data by dropping the fields it does not know.
    written = new.encode("Span", {**EXAMPLES["Span"], "sampler": "greedy"}, topic="boltstream.spans")
    assert written[1:5] != data[1:5]
    assert registry.subjects["boltstream.spans-value"] == [1, 2]
    assert as_lists(Codec(registry=registry).decode(written, topic="boltstream.spans")) == EXAMPLES["Span"]


def test_conflicting_duplicate_version_is_rejected(tmp_path: Path) -> None:
    raw = json.loads(json.dumps(default_catalog().get("Task", 1).raw))
    raw["fields"].append({"name": "extra", "type": "int", "default": 0})
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "v1.avsc").write_text(json.dumps(raw))
    with pytest.raises(SchemaError, match="Task v1 is defined twice"):
        Codec(schema_dirs=[tmp_path])


# ------------------------------------------------------------------ packed token payloads


@pytest.mark.parametrize("framing", ["single", "confluent"])
def test_v1_span_golden_reads_as_v2_with_the_same_ids_as_arrays(framing: str) -> None:
    data = golden_path("Span", framing, 1).read_bytes()
    codec = Codec(registry=golden_registry(1)) if framing == "confluent" else Codec()
    llm = codec.decode(data, topic=TOPICS["Span"], expect="Span")["llm"]
    assert llm["prompt_token_ids"] == array("i", PROMPT_IDS)
    assert llm["response_token_ids"] == array("i", RESPONSE_IDS)
    assert llm["response_logprobs"] == array("f", RESPONSE_LOGPROBS)
    assert not {k for k in llm if k.endswith(("_i32", "_f32"))}  # the wire fields never reach a consumer


@pytest.mark.parametrize("record", ["Trajectory", "Sample", "TrainingBatch"])
def test_v1_and_v2_goldens_read_as_v3_with_arrays(record: str) -> None:
    for version in (1, 2):
        decoded = Codec().decode(golden_path(record, "single", version).read_bytes(), expect=record)
        item = decoded["turns"][0] if record == "Trajectory" else (
            decoded["samples"][0] if record == "TrainingBatch" else decoded)
        ids = item["prompt_token_ids"] if record == "Trajectory" else item["token_ids"]
        assert isinstance(ids, array) and ids.typecode == "i"
        assert as_lists(decoded) == OLDER_VERSIONS[version][record]


def test_new_span_carries_packed_bytes_and_empty_legacy_arrays() -> None:
    """The wire shape, read with the raw v2 schema (what Redpanda Console or another Avro tool sees)."""
    data = Codec().encode("Span", EXAMPLES["Span"])
    raw = schemaless_reader(BytesIO(data[10:]), default_catalog().get("Span", 2).parsed, None)
    llm = raw["llm"]
    assert llm["prompt_token_ids"] == [] and llm["response_logprobs"] == []
    assert llm["prompt_token_ids_i32"] == struct.pack(f"<{len(PROMPT_IDS)}i", *PROMPT_IDS)
    assert llm["response_logprobs_f32"] == struct.pack(f"<{len(RESPONSE_LOGPROBS)}f", *RESPONSE_LOGPROBS)


def test_every_older_version_resolves_into_the_newest_schema() -> None:
    """Adding the packed fields (not retyping the arrays) keeps the newest version able to read every
    older one, what a registry's BACKWARD_TRANSITIVE check asks (checked here with fastavro's schema
    resolution on real records; no registry's own checker runs in this test)."""
    for record in ("Span", "Trajectory", "Sample", "TrainingBatch"):
        versions = default_catalog().versions(record)
        latest = versions[-1]
        for older in versions[:-1]:
            example = OLDER_VERSIONS[older.version].get(record) or OLDER_VERSIONS[1][record]
            body = BytesIO()
            schemaless_writer(body, older.parsed, example)
            body.seek(0)
            assert schemaless_reader(body, older.parsed, latest.parsed)


def test_a_codec_over_older_versions_only_writes_arrays_that_today_s_codec_reads(tmp_path: Path) -> None:
    """``Codec(catalog=...)`` without the package schemas: what the previous release was (Span v1)."""
    (tmp_path / "span").mkdir()
    (tmp_path / "span" / "v1.avsc").write_text(json.dumps(default_catalog().get("Span", 1).raw))
    old = Codec(catalog=SchemaCatalog([tmp_path], include_package=False))
    assert not has_packed_fields("Span", old.catalog.latest("Span").parsed)
    assert has_packed_fields("Span", default_catalog().latest("Span").parsed)
    data = old.encode("Span", EXAMPLES["Span"])
    assert data[2:10] == default_catalog().get("Span", 1).fingerprint
    assert old.decode(data)["llm"]["prompt_token_ids"] == PROMPT_IDS  # lists, as the old release had
    assert Codec().decode(data)["llm"]["prompt_token_ids"] == array("i", PROMPT_IDS)
