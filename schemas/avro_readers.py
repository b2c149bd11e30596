"""Hand-written Avro binary readers, composed from a schema: the pieces of the fast Span reader
(schemas/span_decoder.py).

Each reader is ``(data, pos) -> (value, next pos)`` over ``bytes``; :func:`reader` builds one for a
schema type (records, arrays, maps of attribute unions, two-branch ``null`` unions, primitives) and
raises ``ValueError`` for a type it does not read. They read exactly what fastavro's C reader
(``schemaless_reader``) reads, bad bytes included: integers with 64-bit wrap-around and the shift
count taken modulo 64, non-canonical varints accepted, a negative union position counting from the
end of the union (fastavro indexes a Python list), any non-zero byte a true boolean, strings strict
UTF-8. What fastavro refuses raises :class:`Corrupt` (a reason), ``IndexError`` (past the end of the
data) or ``UnicodeDecodeError``; the caller turns them into ``SchemaError``.

Speed comes from reading the common case without calls: one-byte varints and string lengths come
from tables, map keys and string values are read inline, and the two 9-byte timestamp varints of a
span are half cached. schemas/avro_compiled.py inlines the same reads for a record's own fields.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

_MASK64 = (1 << 64) - 1
ZZ = tuple((b >> 1) ^ -(b & 1) for b in range(128))  # one-byte varints, zig-zag decoded
# One-byte string lengths (0..63); -1 for a longer or a negative length (read by read_string).
LEN = tuple(b >> 1 if b < 0x80 and not b & 1 else -1 for b in range(256))
_HIGH: dict[bytes, int] = {}  # bytes 4-8 of a 9-byte varint -> their bits (see read_varint)
_unpack_d = struct.Struct("<d").unpack_from
_unpack_f = struct.Struct("<f").unpack_from
# Attribute value kinds, in the order the map reader tests them (strings are the common case).
STRING, NULL, LONG, BOOL, DOUBLE, ARRAY = range(6)
_SCALARS = {"string": STRING, "null": NULL, "long": LONG, "boolean": BOOL, "double": DOUBLE}


class Corrupt(Exception):
    """Why bytes cannot be read (FastSpanDecoder.decode makes it a SchemaError with the record's label)."""


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of a zig-zag varint, read as fastavro's C ``read_long`` reads it.

    Nanosecond timestamps (two 9-byte varints per span, the costliest reads of a small span with the
    byte loop) take a fast path, the encoder's in reverse: bytes 4-8 (bits 28-62) are shared by every timestamp
    of a ~0.13 s window, so their value comes from a small cache keyed by those bytes, and the low
    28 bits are gathered from bytes 0-3 arithmetically."""
    b = data[pos]
    if b < 0x80:
        return ZZ[b], pos + 1
    high = _HIGH.get(data[pos + 4:pos + 9])
    if high is not None:
        v = int.from_bytes(data[pos:pos + 4], "little")
        if v & 0x80808080 == 0x80808080:  # bytes 0-3 continue: the cached bytes are this varint's end
            n = high | (v & 0x7F) | ((v >> 1) & 0x3F80) | ((v >> 2) & 0x1FC000) | ((v >> 3) & 0xFE00000)
            return (n >> 1) ^ -(n & 1), pos + 9
    start = pos
    pos += 1
    n = b & 0x7F
    shift = 7
    while b & 0x80:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << (shift & 63)  # a 64-bit shift: the count is taken modulo 64
        shift += 7
    n &= _MASK64
    if pos - start == 9:
        if len(_HIGH) > 4096:
            _HIGH.clear()
        _HIGH[data[start + 4:pos]] = n & ~0xFFFFFFF
    return (n >> 1) ^ -(n & 1), pos


def read_string(data: bytes, pos: int) -> tuple[str, int]:
    n = LEN[data[pos]]
    if n >= 0:  # a one-byte length; a string cut short by the end of the data fails the next read
        pos += n + 1
        return data[pos - n:pos].decode(), pos
    n, pos = read_varint(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise Corrupt(f"string of {n} bytes at offset {pos}, {len(data) - pos} left")
    return data[pos:end].decode(), end


def _bytes(data: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = read_varint(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise Corrupt(f"bytes of length {n} at offset {pos}, {len(data) - pos} left")
    return data[pos:end], end


def _blocks(data: bytes, pos: int) -> tuple[int, int]:
    """(item count, position) of the next array/map block; 0 at the end. A negative count is followed
    by the block's size in bytes, unused; fastavro's C negation leaves ``-2**63`` negative, so that
    block has no items and the next count follows."""
    n, pos = read_varint(data, pos)
    while n < 0:
        _, pos = read_varint(data, pos)
        if n != -(1 << 63):
            return -n, pos
        n, pos = read_varint(data, pos)
    return n, pos


def _union(branches: list[Any]) -> dict[int, int]:
    """Branch position -> index into ``branches``, negative positions too (fastavro indexes a list)."""
    k = len(branches)
    return {i: i % k for i in range(-k, k)}


def _fixed(typ: str) -> Callable[[bytes, int], tuple[float, int]]:
    size, unpack_from = (8, _unpack_d) if typ == "double" else (4, _unpack_f)

    def number(data: bytes, pos: int) -> tuple[float, int]:
        if pos + size > len(data):
            raise Corrupt(f"{typ} at offset {pos}, {len(data) - pos} bytes left")
        return unpack_from(data, pos)[0], pos + size

    return number


def _boolean(data: bytes, pos: int) -> tuple[bool, int]:
    return data[pos] != 0, pos + 1  # fastavro: any non-zero byte is true


_PRIMITIVES: dict[str, Callable[[bytes, int], tuple[Any, int]]] = {
    "string": read_string, "int": read_varint, "long": read_varint, "bytes": _bytes,
    "double": _fixed("double"), "float": _fixed("float"), "boolean": _boolean}


def reader(typ: Any, named: dict[str, Any]) -> Callable[[bytes, int], tuple[Any, int]]:
    """``(data, pos) -> (value, next pos)`` for a schema type; raises ValueError for a type this module
    does not read (``create`` then falls back to fastavro)."""
    if isinstance(typ, str):
        if typ in _PRIMITIVES:
            return _PRIMITIVES[typ]
        return reader(named[typ], named)
    if isinstance(typ, list):
        if len(typ) != 2 or "null" not in typ:
            raise ValueError(f"no fast reader for union {typ!r}")
        return _optional(typ, reader(next(t for t in typ if t != "null"), named))
    kind = typ.get("type")
    if kind == "record":
        named[typ["name"]] = typ
        return _record(typ, named)
    if kind == "array":
        return _array(typ["items"], named)
    if kind == "map":
        return map_reader(typ["values"], named)
    raise ValueError(f"no fast reader for type {typ!r}")


def _optional(union: list[Any], read: Callable[[bytes, int], tuple[Any, int]]
              ) -> Callable[[bytes, int], tuple[Any, int]]:
    """Reader of a two-branch ``null``/value union, in either order, any position encoding."""
    nulls = frozenset(p for p, i in _union(union).items() if union[i] == "null")

    def opt(data: bytes, pos: int) -> tuple[Any, int]:
        b = data[pos]
        idx, pos = (ZZ[b], pos + 1) if b < 0x80 else read_varint(data, pos)
        if idx in nulls:
            return None, pos
        if -2 <= idx < 2:
            return read(data, pos)
        raise Corrupt(f"union index {idx} out of range (2 branches) at offset {pos}")

    return opt


def null_byte(typ: Any) -> int:
    """The one-byte varint of the null position of a two-branch ``null`` union, else -1."""
    return 2 * typ.index("null") if isinstance(typ, list) and len(typ) == 2 and "null" in typ else -1


def _record(typ: dict[str, Any], named: dict[str, Any]) -> Callable[[bytes, int], tuple[dict[str, Any], int]]:
    """Reader of a nested record off the hot path (span events; schemas/avro_compiled.py inlines the rest)."""
    fields = [(f["name"], reader(f["type"], named)) for f in typ["fields"]]

    def record(data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        out = {}
        for name, read in fields:
            out[name], pos = read(data, pos)
        return out, pos

    return record


def _array(items: Any, named: dict[str, Any]) -> Callable[[bytes, int], tuple[list[Any], int]]:
    """Reader of an Avro array (blocks of items, ended by an empty block)."""
    read = reader(items, named)

    def block(data: bytes, pos: int, count: int) -> tuple[list[Any], int]:
        out = []
        for _ in range(count):
            v, pos = read(data, pos)
            out.append(v)
        return out, pos

    def read_array(data: bytes, pos: int) -> tuple[list[Any], int]:
        n, pos = _blocks(data, pos)
        out: list[Any] = []
        while n:
            more, pos = block(data, pos, n)
            out += more
            n, pos = _blocks(data, pos)
        return out, pos

    return read_array


def map_reader(values: Any, named: dict[str, Any]) -> Callable[[bytes, int], tuple[dict[str, Any], int]]:
    """Reader of an attribute map: string keys, values of a union of scalars and array records
    (the hot loop: strings and one-byte varints are read inline)."""
    if not isinstance(values, list):
        raise ValueError(f"no fast reader for map values {values!r}")
    kinds: dict[int, int] = {}
    arrays: list[tuple[str, Callable[[bytes, int], tuple[list[Any], int]]]] = []
    for p, i in _union(values).items():
        branch = values[i]
        if isinstance(branch, str) and branch in _SCALARS:
            kinds[p] = _SCALARS[branch]
            continue
        rec = branch if isinstance(branch, dict) else named[branch]
        named[rec["name"]] = rec
        (field,) = rec["fields"]
        kinds[p] = ARRAY + len(arrays)
        arrays.append((field["name"], reader(field["type"], named)))
    n_branches = len(values)
    read_double = _PRIMITIVES["double"]

    def read_map(data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        n, pos = _blocks(data, pos)
        lens = LEN
        while n:
            for _ in range(n):
                k = lens[data[pos]]
                if k < 0:
                    key, pos = read_string(data, pos)
                else:
                    pos += k + 1
                    key = data[pos - k:pos].decode()
                b = data[pos]
                idx, pos = (ZZ[b], pos + 1) if b < 0x80 else read_varint(data, pos)
                kind = kinds.get(idx)
                if kind == STRING:
                    k = lens[data[pos]]
                    if k < 0:
                        out[key], pos = read_string(data, pos)
                    else:
                        pos += k + 1
                        out[key] = data[pos - k:pos].decode()
                elif kind == NULL:
                    out[key] = None
                elif kind == LONG:
                    b = data[pos]
                    out[key], pos = (ZZ[b], pos + 1) if b < 0x80 else read_varint(data, pos)
                elif kind == BOOL:
                    out[key] = data[pos] != 0
                    pos += 1
                elif kind == DOUBLE:
                    out[key], pos = read_double(data, pos)
                elif kind is None:
                    raise Corrupt(f"union index {idx} out of range ({n_branches} branches) in map value {key!r}")
                else:
                    name, read = arrays[kind - ARRAY]
                    items, pos = read(data, pos)
                    out[key] = {name: items}
            n, pos = _blocks(data, pos)
        return out, pos

    return read_map
