"""One runaway attribute never reaches the broker whole: the exporter's per-attribute cap (producers/truncate.py)."""

from __future__ import annotations

from boltstream.config import Settings, load
from boltstream.producers.exporter import ExporterConfig
from boltstream.producers.span_encoder import SpanRecordEncoder, sample_record
from boltstream.producers.truncate import (
    DEFAULT_MAX_ATTRIBUTE_BYTES,
    TRUNCATED,
    TRUNCATED_FIELDS,
    cap_attributes,
)
from boltstream.schemas import Codec
from boltstream.schemas.packed import as_lists
from boltstream.schemas.records import RECORD_HEADROOM

CODEC = Codec()


def test_values_within_the_limit_are_left_alone_and_the_record_is_not_copied() -> None:
    rec = sample_record()
    assert cap_attributes(rec, 1000) == (rec, [])
    assert cap_attributes(rec, 1000)[0] is rec
    assert cap_attributes({**rec, "attributes": {"x": "y" * 10_000}}, 0)[1] == [], "0: no cap"


def test_a_long_string_keeps_its_first_bytes_and_an_array_its_first_elements() -> None:
    rec = sample_record()
    rec["attributes"] = {**rec["attributes"], "blob": "ab" * 600, "utf": "é" * 600,
                         "list": {"strings": ["x" * 100] * 30}}
    capped, removed = cap_attributes(rec, 1000)
    attrs = capped["attributes"]
    assert attrs["blob"] == "ab" * 500 and attrs["utf"] == "é" * 500  # 2-byte chars: 500 fit in 1000 bytes
    assert attrs["list"] == {"strings": ["x" * 100] * 9}  # 9 x (100 + 2) + 2 = 920 <= 1000 < 1022
    assert removed == ["cut:attribute:blob", "cut:attribute:utf", "cut:attribute:list"]
    assert attrs[TRUNCATED] is True and attrs[TRUNCATED_FIELDS] == {"strings": removed}
    assert attrs["s"] == rec["attributes"]["s"] and len(rec["attributes"]["blob"]) == 1200, "input untouched"


def test_the_encoder_caps_a_10_mb_attribute_and_reports_it() -> None:
    settings = Settings(namespace="u.")
    rec = sample_record()
    rec["attributes"] = {**rec["attributes"], "tool.output": "z" * 10_000_000}
    key, value, removed = SpanRecordEncoder(settings, CODEC)(rec)
    assert removed == ["cut:attribute:tool.output"] and len(value) < DEFAULT_MAX_ATTRIBUTE_BYTES + 2_000
    decoded = CODEC.decode(value, expect="Span")
    assert decoded["attributes"]["tool.output"] == "z" * DEFAULT_MAX_ATTRIBUTE_BYTES
    assert decoded["attributes"][TRUNCATED] is True and as_lists(decoded["llm"]) == rec["llm"]
    # With the cap off, the whole-span truncation still keeps it within what the stream app accepts.
    key, value, removed = SpanRecordEncoder(settings, CODEC, max_attribute_bytes=0)(rec)
    assert "attribute:tool.output" in removed and len(value) + len(key) <= settings.max_message_bytes - RECORD_HEADROOM


def test_the_cap_is_an_exporter_knob() -> None:
    assert load(ExporterConfig, {}, env={}).max_attribute_bytes == DEFAULT_MAX_ATTRIBUTE_BYTES
    env = {"BOLTSTREAM_EXPORTER_MAX_ATTRIBUTE_BYTES": "4096", "BOLTSTREAM_STATE_FILE": "/nonexistent/stack.json"}
    assert load(ExporterConfig, {}, env=env).max_attribute_bytes == 4096
