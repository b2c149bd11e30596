"""Avro schema -> Arrow types, with the value conversion each one needs. Pure functions.

Why derive instead of writing the columns down: the export must follow the
schemas as they evolve (a field added in ``v3.avsc`` shows up as a column with
no change here), and a hand-written Arrow schema would drift from the Avro one.

The mapping keeps every value exact and loadable as is by pyarrow, pandas and
``datasets``:

* primitives map to their Arrow twins (``int`` -> int32, ``long`` -> int64,
  ``float`` -> float32: logprobs keep their 32 recorded bits);
* records become structs, arrays lists, enums strings, fixed/bytes binary;
* ``["null", X]`` is a nullable X;
* maps and unions of several types (span attributes: a map of scalar-or-array
  unions) become one JSON string: Arrow has no mixed-type column, and a JSON
  string is what both pandas and ``datasets`` load without a custom feature.
  Array attributes, ``{"strings": [...]}`` on the wire, are written as plain
  JSON arrays.
"""

from __future__ import annotations

import base64
import json
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from boltstream.schemas.packed import wire_fields

Convert = Callable[[Any], Any]

PRIMITIVES: dict[str, pa.DataType] = {
    "null": pa.null(),
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "bytes": pa.binary(),
    "string": pa.string(),
}
# The wrapper records a span attribute's array value travels in (schemas/span/v1.avsc).
ARRAY_WRAPPERS = frozenset({"bools", "longs", "doubles", "strings"})


@dataclass(frozen=True)
class Column:
    """One Arrow type and the function that turns a decoded Avro value into it (None: as is)."""

    type: pa.DataType
    convert: Convert | None = None

    def __call__(self, value: Any) -> Any:
        return value if self.convert is None else self.convert(value)


def plain(value: Any) -> Any:
    """A decoded Avro value as plain JSON data: array wrappers unwrapped, bytes as base64."""
    if isinstance(value, dict):
        if len(value) == 1:
            key, inner = next(iter(value.items()))
            if key in ARRAY_WRAPPERS and isinstance(inner, list):
                return inner
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    return value


def _tolist(value: Any) -> Any:
    return value.tolist() if isinstance(value, array) else value


def to_json(value: Any) -> str | None:
    """The JSON text of a map or multi-type union value (keys sorted, so equal values give equal text)."""
    return None if value is None else json.dumps(plain(value), sort_keys=True, ensure_ascii=False)


class Names:
    """Named Avro types seen so far, by full and short name (records refer back to earlier ones)."""

    def __init__(self) -> None:
        self.types: dict[str, Any] = {}

    def add(self, schema: Mapping[str, Any], namespace: str) -> str:
        name = str(schema["name"])
        ns = schema.get("namespace", namespace)
        full = name if "." in name or not ns else f"{ns}.{name}"
        self.types[full] = schema
        self.types.setdefault(name.rsplit(".", 1)[-1], schema)
        return full.rpartition(".")[0]

    def get(self, name: str, namespace: str) -> Any:
        for key in (name, f"{namespace}.{name}"):
            if key in self.types:
                return self.types[key]
        raise ValueError(f"unknown Avro type {name!r}")


def column(schema: Any, names: Names | None = None, namespace: str = "") -> Column:
    """The Arrow column for one Avro schema (a parsed-JSON schema: str, list or dict)."""
    names = names if names is not None else Names()
    if isinstance(schema, str):
        if schema in PRIMITIVES:
            return Column(PRIMITIVES[schema])
        return column(names.get(schema, namespace), names, namespace)
    if isinstance(schema, list):
        return _union(schema, names, namespace)
    kind = schema["type"]
    if kind in PRIMITIVES:
        return Column(PRIMITIVES[kind])
    if kind == "record":
        inner_ns = names.add(schema, namespace)
        # Packed token payloads (``prompt_token_ids_i32``) come decoded under their logical names.
        wire = wire_fields(f["name"] for f in schema["fields"])
        fields = [(f["name"], column(f["type"], names, inner_ns)) for f in schema["fields"] if f["name"] not in wire]
        return _struct(fields)
    if kind == "array":
        item = column(schema["items"], names, namespace)
        # Decoded token payloads are array.array: lists for JSON lines, and a loss mask's 0/1 bytes as
        # True/False (Arrow takes nothing else for booleans).
        conv = bool if item.type == pa.bool_() else item.convert
        if conv is None:
            return Column(pa.list_(item.type), _tolist)
        return Column(pa.list_(item.type), lambda v: None if v is None else [conv(x) for x in v])
    if kind == "map":
        column(schema["values"], names, namespace)  # registers named types defined inside
        return Column(pa.string(), to_json)
    if kind == "enum":
        names.add(schema, namespace)
        return Column(pa.string())
    if kind == "fixed":
        names.add(schema, namespace)
        return Column(pa.binary())
    return column(kind, names, namespace)  # {"type": "string"} and friends, or a named reference


def _union(branches: list[Any], names: Names, namespace: str) -> Column:
    others = [b for b in branches if b != "null"]
    if len(others) == 1:
        inner = column(others[0], names, namespace)
        conv = inner.convert
        return Column(inner.type, None if conv is None else (lambda v: None if v is None else conv(v)))
    for b in others:  # registers named types defined inside the union
        column(b, names, namespace)
    return Column(pa.string(), to_json)


def _struct(fields: list[tuple[str, Column]]) -> Column:
    typ = pa.struct([pa.field(name, c.type) for name, c in fields])
    converted = [(name, c.convert) for name, c in fields if c.convert is not None]
    if not converted:
        return Column(typ)

    def convert(value: Any) -> Any:
        if value is None:
            return None
        out = dict(value)
        for name, conv in converted:
            out[name] = conv(out.get(name))
        return out

    return Column(typ, convert)


def record_fields(schema: Mapping[str, Any], names: Names | None = None) -> list[tuple[str, Any, Column]]:
    """(name, Avro type, Column) of each top-level field of a record schema, in schema order (without
    the packed wire fields: the decoded record holds those under their logical names)."""
    names = names if names is not None else Names()
    ns = names.add(schema, "")
    wire = wire_fields(f["name"] for f in schema["fields"])
    return [(f["name"], f["type"], column(f["type"], names, ns)) for f in schema["fields"] if f["name"] not in wire]


def nested_record(avro_type: Any, names: Names) -> Mapping[str, Any] | None:
    """The record schema behind a field's type (a record or a nullable record), else None."""
    branches = avro_type if isinstance(avro_type, list) else [avro_type]
    others = [b for b in branches if b != "null"]
    if len(others) != 1:
        return None
    t = others[0]
    if isinstance(t, str) and t not in PRIMITIVES:
        t = names.get(t, "")
    return t if isinstance(t, dict) and t.get("type") == "record" else None
