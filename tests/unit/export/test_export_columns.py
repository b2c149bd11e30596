"""Avro -> Arrow: each schema shape against the type and the converted value written out by hand."""

from __future__ import annotations

import pyarrow as pa

from boltstream.export.columns import Names, column, nested_record, plain, record_fields, to_json

SCHEMA = {
    "type": "record", "name": "Outer", "namespace": "t.v1",
    "fields": [
        {"name": "n", "type": "int"},
        {"name": "big", "type": "long"},
        {"name": "lp", "type": {"type": "array", "items": "float"}},
        {"name": "maybe", "type": ["null", "string"]},
        {"name": "inner", "type": ["null", {"type": "record", "name": "Inner",
                                            "fields": [{"name": "x", "type": "double"},
                                                       {"name": "m", "type": {"type": "map", "values": "long"}}]}]},
        {"name": "inners", "type": {"type": "array", "items": "Inner"}},
        {"name": "attrs", "type": {"type": "map", "values": [
            "null", "long", "string",
            {"type": "record", "name": "StringArray", "fields": [{"name": "strings",
                                                                   "type": {"type": "array", "items": "string"}}]}]}},
        {"name": "either", "type": ["long", "string"]},
        {"name": "colour", "type": {"type": "enum", "name": "Colour", "symbols": ["RED", "BLUE"]}},
        {"name": "raw", "type": "bytes"},
    ],
}


def test_types_follow_the_avro_shapes() -> None:
    names = Names()
    fields = {name: col for name, _, col in record_fields(SCHEMA, names)}
    inner = pa.struct([pa.field("x", pa.float64()), pa.field("m", pa.string())])
    assert {name: col.type for name, col in fields.items()} == {
        "n": pa.int32(), "big": pa.int64(), "lp": pa.list_(pa.float32()), "maybe": pa.string(), "inner": inner,
        "inners": pa.list_(inner), "attrs": pa.string(), "either": pa.string(), "colour": pa.string(),
        "raw": pa.binary(),
    }
    # values: maps and multi-type unions become JSON (keys sorted, array wrappers unwrapped); the rest as is
    assert fields["lp"]([-0.5, -0.125]) == [-0.5, -0.125]
    assert fields["maybe"](None) is None
    assert fields["inner"]({"x": 1.5, "m": {"b": 2, "a": 1}}) == {"x": 1.5, "m": '{"a": 1, "b": 2}'}
    assert fields["inner"](None) is None
    assert fields["inners"]([{"x": 0.0, "m": {}}]) == [{"x": 0.0, "m": "{}"}]
    assert fields["attrs"]({"k": 3, "tags": {"strings": ["a", "b"]}, "none": None}) == \
        '{"k": 3, "none": null, "tags": ["a", "b"]}'
    assert fields["either"](7) == "7" and fields["either"]("x") == '"x"'
    # a named type defined inside a nullable union is known by short name afterwards
    assert nested_record(SCHEMA["fields"][4]["type"], names)["name"] == "Inner"
    assert nested_record("int", names) is None and nested_record(["long", "string"], names) is None


def test_plain_json_values() -> None:
    assert plain({"doubles": [0.25]}) == [0.25]
    assert plain({"strings": "not a list"}) == {"strings": "not a list"}  # only wrappers of arrays unwrap
    assert plain({"a": {"longs": [1]}, "b": [b"\x00\xff"]}) == {"a": [1], "b": ["AP8="]}
    assert to_json(None) is None and to_json({"é": 1}) == '{"é": 1}'


def test_arrow_accepts_converted_values() -> None:
    col = column(SCHEMA)
    value = {"n": 1, "big": 2**40, "lp": [-1.0], "maybe": "m", "inner": None, "inners": [],
             "attrs": {"x": {"strings": []}}, "either": 1, "colour": "RED", "raw": b"\x01"}
    array = pa.array([col(value)], type=col.type)
    assert array.to_pylist()[0]["attrs"] == '{"x": []}' and array.to_pylist()[0]["big"] == 2**40
