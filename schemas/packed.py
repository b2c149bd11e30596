"""Token payloads as packed bytes: little-endian int32 ids, float32 logprobs, one byte per mask flag.

Why: Avro writes ``array<int>`` one zig-zag varint at a time, and fastavro decodes it one Python int
at a time (~470 ns per token for encode + decode of a 4.5k-token LLM span). The same ids as one
``bytes`` field are a single memcpy each way, and the decoded value is an ``array.array`` that
``torch.frombuffer`` / ``numpy.frombuffer`` wrap without copying. ``array.array`` rather than numpy
because it is stdlib (the exporter in an agent process must stay light) and it behaves like the lists
it replaces: ``len``, indexing, slicing, ``bool``, ``x or []`` and ``==`` between arrays all work.

Which fields are packed, per record type, is :data:`PACKED_FIELDS`; the codec
(:mod:`boltstream.schemas.codec`) applies :func:`pack_record` before writing and
:func:`unpack_record` after reading. Record dicts keep the logical names (``prompt_token_ids``, ...);
the packed bytes travel in ``<name>_<kind>`` fields next to the old array fields.
Pure functions, no I/O.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import SchemaError

I32, F32, U8 = "i32", "f32", "u8"
#: kind -> (array typecode, struct format char, bytes per item)
_KINDS: dict[str, tuple[str, str, int]] = {I32: ("i", "i", 4), F32: ("f", "f", 4), U8: ("B", "B", 1)}
_BIG_ENDIAN = sys.byteorder == "big"
# The buffer-protocol formats accepted as already holding a kind's values (native or little-endian).
_FORMATS: dict[str, frozenset[str]] = {
    I32: frozenset({"i", "<i", "=i", "l", "<l", "=l"}),  # itemsize is checked too
    F32: frozenset({"f", "<f", "=f"}),
    U8: frozenset({"B", "<B", "=B", "?", "b", "c"}),
}
assert all(array(code).itemsize == size for code, _, size in _KINDS.values()), "unsupported platform"

_RAW, _SEQUENCES = (bytes, bytearray), (list, tuple)  # tuples: `bytes | bytearray` builds a new union per call

TOKEN_FIELDS: tuple[tuple[str, str], ...] = (
    ("prompt_token_ids", I32),
    ("response_token_ids", I32),
    ("response_logprobs", F32),
)
SAMPLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("token_ids", I32),
    ("loss_mask", U8),
    ("behaviour_logprobs", F32),
)
#: record type -> (where its packed fields live, the fields). Where: ``None`` the record itself,
#: ``("llm", "optional")`` a nullable sub-record, ``("turns", "list")`` each item of a list.
PACKED_FIELDS: dict[str, tuple[tuple[str, str] | None, tuple[tuple[str, str], ...]]] = {
    "Span": (("llm", "optional"), TOKEN_FIELDS),
    "Trajectory": (("turns", "list"), TOKEN_FIELDS),
    "Sample": (None, SAMPLE_FIELDS),
    "TrainingBatch": (("samples", "list"), SAMPLE_FIELDS),
}


def wire_name(field: str, kind: str) -> str:
    """``prompt_token_ids`` + ``i32`` -> ``prompt_token_ids_i32``: the Avro ``bytes`` field."""
    return f"{field}_{kind}"


def wire_fields(names: Iterable[str]) -> set[str]:
    """The packed ``bytes`` fields among a record's field names (``x_i32`` next to an ``x``): what a
    consumer of the decoded dicts (the export's columns) never sees, the codec puts them under ``x``."""
    names = set(names)
    return {n for n in names if n.rpartition("_")[2] in _KINDS and n.rpartition("_")[0] in names}


def pack(value: Any, kind: str, field: str = "value") -> bytes:
    """Little-endian bytes of ``value``: a list/tuple/iterable of numbers, an ``array.array``, a numpy
    array or any buffer of the kind's item type (used as is), or ``bytes`` already packed.

    Raises ``SchemaError`` naming ``field`` for a value that does not fit (an id beyond int32, a
    buffer whose length is not a whole number of items, a float where an int belongs).
    """
    code, fmt, size = _KINDS[kind]
    if isinstance(value, _RAW):
        if len(value) % size:
            raise SchemaError(f"field {field}: {len(value)} bytes is not a whole number of {kind} items")
        return bytes(value)
    if isinstance(value, array):
        if value.typecode == code:
            return _le(value).tobytes()
    elif isinstance(value, _SEQUENCES):
        try:
            return struct.pack(f"<{len(value)}{fmt}", *value)
        except (struct.error, OverflowError) as exc:
            raise SchemaError(f"field {field}: cannot pack as {kind}: {exc}") from None
    else:
        try:
            view = memoryview(value)
        except TypeError:
            view = None
        if view is not None and view.format in _FORMATS[kind] and view.itemsize == size:
            if view.ndim != 1:
                raise SchemaError(f"field {field}: expected a 1-d buffer, got {view.ndim} dimensions")
            data = view.tobytes()
            return data if not _BIG_ENDIAN or size == 1 else _le(_from_native(data, code)).tobytes()
    try:
        out = array(code, _numbers(value, kind))
    except (TypeError, OverflowError, ValueError) as exc:
        raise SchemaError(f"field {field}: cannot pack {type(value).__name__} as {kind}: {exc}") from None
    return _le(out).tobytes()


def packed_buffer(value: Any, kind: str, field: str = "value") -> tuple[Any, int]:
    """(a bytes-like object holding ``value`` packed, its size in bytes) without copying an ``array.array``
    of the kind (little-endian hosts): for writers that join buffers (``b"".join`` takes any), where
    :func:`pack`'s copy would be one more allocation of the payload's size per record."""
    if isinstance(value, array) and value.typecode == _KINDS[kind][0] and not _BIG_ENDIAN:
        return value, len(value) * value.itemsize
    data = pack(value, kind, field)
    return data, len(data)


def unpack(data: bytes, kind: str, field: str = "value") -> array:
    """The ``array.array`` (``'i'``, ``'f'`` or ``'B'``) held by little-endian ``data`` (a copy:
    one memcpy)."""
    code, _, size = _KINDS[kind]
    if len(data) % size:
        raise SchemaError(f"field {field}: {len(data)} bytes is not a whole number of {kind} items")
    out = _from_native(data, code)
    if _BIG_ENDIAN and size > 1:
        out.byteswap()
    return out


def as_array(value: Any, kind: str) -> array:
    """``value`` as an ``array.array`` of the kind (the same object when it already is one): lets the
    stream app treat lists from older code and tests like decoded arrays without copying the latter."""
    code = _KINDS[kind][0]
    if isinstance(value, array) and value.typecode == code:
        return value
    return unpack(pack(value, kind), kind)


def as_lists(value: Any) -> Any:
    """A copy of a record with every ``array.array`` as a list (JSON, printing, comparing with ``==``)."""
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: as_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_lists(v) for v in value]
    return value


def _numbers(value: Any, kind: str) -> Iterable[Any]:
    # array.array refuses numpy scalars of another width and bools in float arrays only by type:
    # ints for ids and masks, floats for logprobs, converted once.
    if kind == F32:
        return map(float, value)
    return map(int, value)


def _le(values: array) -> array:
    if not _BIG_ENDIAN or values.itemsize == 1:
        return values
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped


def _from_native(data: bytes, code: str) -> array:
    out = array(code)
    out.frombytes(data)
    return out


# ------------------------------------------------------------------------------------ records


def has_packed_fields(record: str, schema: Any) -> bool:
    """Whether a parsed ``schema`` of ``record`` has every packed field (where PACKED_FIELDS says):
    a codec over older schema versions only (benchmarks, compatibility tests) does not pack."""
    spec = PACKED_FIELDS.get(record)
    if spec is None:
        return False
    where, fields = spec
    if where is not None:
        field_type = next((f["type"] for f in schema["fields"] if f["name"] == where[0]), None)
        if where[1] == "optional" and isinstance(field_type, list):
            field_type = next((b for b in field_type if isinstance(b, dict)), None)
        elif isinstance(field_type, dict) and field_type.get("type") == "array":
            field_type = field_type["items"]
        schema = field_type
    if not isinstance(schema, dict) or schema.get("type") != "record":
        return False
    names = {f["name"] for f in schema["fields"]}
    return all(wire_name(f, k) in names for f, k in fields)


_Fields = tuple[tuple[str, str, str], ...]  # (logical name, kind, wire name)
_SPECS: dict[str, tuple[tuple[str, str] | None, _Fields]] = {
    record: (where, tuple((f, k, wire_name(f, k)) for f, k in fields))
    for record, (where, fields) in PACKED_FIELDS.items()
}


def _pack_item(item: Mapping[str, Any], fields: _Fields) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        return item  # type: ignore[return-value]  # fastavro reports the wrong type
    out = dict(item)  # never mutate the caller's dict
    for field, kind, wire in fields:
        # Missing means empty (the fields' default); the legacy array field is empty in everything
        # written today.
        out[wire] = pack(out.pop(field), kind, field) if field in out else out.get(wire, b"")
        out[field] = []
    return out


def _unpack_item(item: dict[str, Any], fields: _Fields) -> None:
    for field, kind, wire in fields:
        data = item.pop(wire, b"")
        # Written by today's code: the packed bytes. Written before them: the array field.
        item[field] = unpack(data, kind, field) if data else as_array(item.get(field) or (), kind)


def pack_record(record: str, value: Mapping[str, Any]) -> Mapping[str, Any]:
    """``value`` with its token payloads packed (a new dict; ``value`` is untouched); ``value`` itself
    for a record type without packed fields."""
    spec = _SPECS.get(record)
    if spec is None or not isinstance(value, Mapping):
        return value
    where, fields = spec
    if where is None:
        return _pack_item(value, fields)
    name, shape = where
    inner = value.get(name)
    if inner is None:
        return value
    out = dict(value)
    out[name] = _pack_item(inner, fields) if shape == "optional" else [_pack_item(i, fields) for i in inner]
    return out


def unpack_record(record: str, value: dict[str, Any]) -> dict[str, Any]:
    """Replace a decoded record's packed fields by arrays under their logical names, in place."""
    spec = _SPECS.get(record)
    if spec is None:
        return value
    where, fields = spec
    if where is None:
        _unpack_item(value, fields)
        return value
    inner = value.get(where[0])
    if inner is None:
        return value
    for item in [inner] if where[1] == "optional" else inner:
        _unpack_item(item, fields)
    return value
