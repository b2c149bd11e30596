"""Schema evolution: data written with v1 is read with a newer reader schema (added defaulted fields).

The v2 schema lives in a tmp dir layered over the packaged schemas (``Codec(schema_dirs=...)``);
Span itself ships only v1 (Trajectory, Sample and TrainingBatch have a real v2: see the golden v1 fixtures).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boltstream.schemas import Codec, InMemorySchemaRegistry, SchemaError
from boltstream.schemas.loader import default_catalog
from tests.unit.schemas.record_examples import EXAMPLES

ADDED_FIELDS = [
    {"name": "sampler", "type": ["null", "string"], "default": None},
    {"name": "priority", "type": "int", "default": 5},
]


@pytest.fixture
def v2_dir(tmp_path: Path) -> Path:
    """``span/v2.avsc``: v1 plus two fields with defaults, as a real schema change would add them."""
    raw = json.loads(json.dumps(default_catalog().get("Span", 1).raw))
    raw["fields"].extend(ADDED_FIELDS)
    (tmp_path / "span").mkdir()
    (tmp_path / "span" / "v2.avsc").write_text(json.dumps(raw, indent=2))
    return tmp_path


def _with_defaults(record: dict) -> dict:
    return {**record, "sampler": None, "priority": 5}


def test_v2_is_the_newest_and_v1_is_still_known(v2_dir: Path) -> None:
    codec = Codec(schema_dirs=[v2_dir])
    assert [sv.version for sv in codec.catalog.versions("Span")] == [1, 2]
    assert codec.catalog.latest("Span").version == 2
    assert default_catalog().latest("Span").version == 1  # the shared catalog is untouched


def test_single_object_v1_writer_v2_reader(v2_dir: Path) -> None:
    old, new = Codec(), Codec(schema_dirs=[v2_dir])
    data = old.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    assert new.decode(data, topic="boltstream.spans", expect="Span") == _with_defaults(EXAMPLES["Span"])
    # The new codec writes v2 (another fingerprint) and reads its own data back unchanged.
    value = {**EXAMPLES["Span"], "sampler": "top-k", "priority": 1}
    written = new.encode("Span", value, topic="boltstream.spans")
    assert written[2:10] != data[2:10]
    assert new.decode(written, topic="boltstream.spans") == value
    # Without a registry the old codec cannot know v2's fingerprint: a clear error, not garbage.
    with pytest.raises(SchemaError, match="unknown schema fingerprint"):
        old.decode(written, topic="boltstream.spans")


def test_confluent_v1_writer_v2_reader_via_registry(v2_dir: Path) -> None:
    registry = InMemorySchemaRegistry()
    old = Codec(registry=registry)
    data = old.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    # A separate process: shares only the registry, resolves id -> v1 writer -> newest (v2) reader.
    new = Codec(registry=registry, schema_dirs=[v2_dir])
    assert new.decode(data, topic="boltstream.spans", expect="Span") == _with_defaults(EXAMPLES["Span"])
    # And forward: the old reader reads v2 data by dropping the fields it does not know.
    written = new.encode("Span", {**EXAMPLES["Span"], "sampler": "greedy"}, topic="boltstream.spans")
    assert written[1:5] != data[1:5]
    assert registry.subjects["boltstream.spans-value"] == [1, 2]
    assert Codec(registry=registry).decode(written, topic="boltstream.spans") == EXAMPLES["Span"]


def test_conflicting_duplicate_version_is_rejected(tmp_path: Path) -> None:
    raw = json.loads(json.dumps(default_catalog().get("Task", 1).raw))
    raw["fields"].append({"name": "extra", "type": "int", "default": 0})
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "v1.avsc").write_text(json.dumps(raw))
    with pytest.raises(SchemaError, match="Task v1 is defined twice"):
        Codec(schema_dirs=[tmp_path])
