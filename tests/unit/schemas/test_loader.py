"""Schema discovery, caching, canonical form and CRC-64-AVRO fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastavro.schema import to_parsing_canonical_form

from boltstream.schemas import RECORDS, SchemaCatalog, SchemaError, load_schema
from boltstream.schemas.loader import crc64_avro_fingerprint, default_catalog, snake_case

SCHEMAS_DIR = Path(__file__).resolve().parents[3] / "schemas"


def test_records_match_the_folders_on_disk() -> None:
    on_disk = {p.parent.name for p in SCHEMAS_DIR.glob("*/v*.avsc")}
    assert on_disk == {snake_case(r) for r in RECORDS}
    assert set(default_catalog().records) == set(RECORDS)


@pytest.mark.parametrize("record", RECORDS)
def test_load_schema_is_parsed_once(record: str) -> None:
    parsed = load_schema(record)
    newest = default_catalog().latest(record).version
    assert parsed is load_schema(record) is load_schema(record, version=newest)
    # Every version keeps the v1 full name: Avro resolves a writer's record against a reader's by name.
    assert parsed["name"] == load_schema(record, version=1)["name"] == f"boltstream.v1.{record}"
    assert parsed["__fastavro_parsed"]


def test_load_schema_unknown() -> None:
    with pytest.raises(SchemaError, match="unknown record type 'Nope'"):
        load_schema("Nope")
    with pytest.raises(SchemaError, match="Span has no schema version 99"):
        load_schema("Span", version=99)


# Vectors from Apache Avro's share/test/data/schema-tests.txt (fingerprints as signed 64-bit ints).
SPEC_VECTORS = [
    ('"null"', 7195948357588979594),
    ('"int"', 8247732601305521295),
    ('{"fields":[], "type":"record", "name":"foo", "namespace":"x.y"}', 5916914534497305771),
    ('{"fields":[], "type":"record", "name":"foo", "doc":"Useful info"}', -4824392279771201922),
    (
        '{"name":"PigValue","type":"record","fields":[{"name":"value", "type":["null", "int", "long", "PigValue"]}]}',
        -1759257747318642341,
    ),
]


@pytest.mark.parametrize(("schema", "expected"), SPEC_VECTORS)
def test_crc64_avro_matches_the_avro_spec(schema: str, expected: int) -> None:
    fingerprint = crc64_avro_fingerprint(to_parsing_canonical_form(json.loads(schema)))
    assert len(fingerprint) == 8
    assert int.from_bytes(fingerprint, "little", signed=True) == expected


def test_canonical_form_strips_docs_and_defaults() -> None:
    canonical = default_catalog().latest("Task").canonical_form
    assert canonical.startswith('{"name":"boltstream.v1.Task","type":"record","fields":[')
    assert "doc" not in canonical and "default" not in canonical
    assert '"default"' in default_catalog().latest("Task").schema_json  # the registry gets defaults


def test_training_batch_embeds_the_same_sample_schema() -> None:
    """TrainingBatch inlines Sample: both copies must stay identical or consumers disagree."""
    batch = default_catalog().latest("TrainingBatch").raw
    (samples,) = [f for f in batch["fields"] if f["name"] == "samples"]
    embedded = to_parsing_canonical_form(samples["type"]["items"])
    assert embedded == default_catalog().latest("Sample").canonical_form


def test_later_versions_only_add_fields_with_defaults() -> None:
    """The design's evolution rule, checked for every version pair on disk (vacuous until a v2)."""
    for record in RECORDS:
        versions = default_catalog().versions(record)
        for older, newer in zip(versions, versions[1:], strict=False):
            old_names = {f["name"] for f in older.raw["fields"]}
            for f in newer.raw["fields"]:
                assert f["name"] in old_names or "default" in f, f"{record} v{newer.version}: {f['name']}"


def test_record_in_the_wrong_folder(tmp_path: Path) -> None:
    (tmp_path / "span").mkdir()
    (tmp_path / "span" / "v3.avsc").write_text(json.dumps(default_catalog().latest("Task").raw))
    with pytest.raises(SchemaError, match="defines record 'Task'; it belongs in folder 'task'"):
        SchemaCatalog([tmp_path])


def test_invalid_schema_files(tmp_path: Path) -> None:
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "v2.avsc").write_text("{not json")
    with pytest.raises(SchemaError, match="task/v2.avsc .* is not valid JSON"):
        SchemaCatalog([tmp_path])
    (tmp_path / "task" / "v2.avsc").write_text(
        '{"type": "record", "name": "Task", "fields": [{"name": "x"}]}'
    )
    with pytest.raises(SchemaError, match="is not a valid Avro schema"):
        SchemaCatalog([tmp_path])
    with pytest.raises(SchemaError, match="does not exist"):
        SchemaCatalog([tmp_path / "missing"])
