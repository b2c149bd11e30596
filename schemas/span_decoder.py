"""A hand-written Avro binary reader for the ``Span`` record: the stream worker's hot path.

Why not just fastavro: ``schemaless_reader`` interprets the schema for every value it reads, about
34 µs for a small span of ~330 bytes, 17 % of the stream worker's CPU on small spans. Reading the
known layout directly, with single-byte varints from a table, costs a fraction of that.

The mirror of :mod:`boltstream.producers.span_encoder`, with the same safety: the layout is the
Span schema with the packed token payloads (schemas/packed.py); union branch orders, the attribute
array records and the ``llm`` fields are derived from the schema the codec actually uses, and on
construction both sample spans of the encoder are read both ways; unless the results are equal,
:meth:`FastSpanDecoder.create` returns ``None`` and the codec keeps fastavro. Only single-object
records written with the newest Span schema come here (the codec's fingerprint fast path); older
writers need schema resolution and stay with fastavro.

Bad bytes raise ``SchemaError`` wherever fastavro would fail, and nowhere else: integers are read as
fastavro's C reader reads them (64-bit wrap-around, shift count modulo 64, non-canonical varints
accepted), a negative union index counts from the end of the union (fastavro indexes a Python list),
booleans are any non-zero byte, strings are strict UTF-8.
"""

from __future__ import annotations

import logging
import math
import struct
from array import array
from collections.abc import Callable
from typing import Any

from .errors import SchemaError
from .packed import TOKEN_FIELDS, as_array, has_packed_fields, unpack, wire_name

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_ZZ = tuple((b >> 1) ^ -(b & 1) for b in range(128))  # one-byte varints, zig-zag decoded
# One-byte string lengths (0..63); -1 for a longer or a negative length (read by _string).
_LEN = tuple(b >> 1 if b < 0x80 and not b & 1 else -1 for b in range(256))
_HIGH: dict[bytes, int] = {}  # bytes 4-8 of a 9-byte varint -> their bits (see _varint)
_unpack_d = struct.Struct("<d").unpack_from
_unpack_f = struct.Struct("<f").unpack_from
# Attribute value kinds, in the order the map reader tests them (strings are the common case).
STRING, NULL, LONG, BOOL, DOUBLE, ARRAY = range(6)
_SCALARS = {"string": STRING, "null": NULL, "long": LONG, "boolean": BOOL, "double": DOUBLE}


_TOP_FIELDS = ("trace_id", "span_id", "parent_span_id", "name", "kind", "start_time_ns", "end_time_ns", "status",
               "attributes", "events", "resource", "scope", "rollout_id", "attempt_id", "task_id", "llm")


class _Corrupt(Exception):
    """Internal: the reason a record cannot be read (the codec adds the label and the topic)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of a zig-zag varint, read as fastavro's C ``read_long`` reads it.

    Nanosecond timestamps (two 9-byte varints per span, ~4 µs each with the byte loop on this box)
    take a fast path, the encoder's in reverse: bytes 4-8 (bits 28-62) are shared by every timestamp
    of a ~0.13 s window, so their value comes from a small cache keyed by those bytes, and the low
    28 bits are gathered from bytes 0-3 arithmetically."""
    b = data[pos]
    if b < 0x80:
        return _ZZ[b], pos + 1
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


def _string(data: bytes, pos: int) -> tuple[str, int]:
    n = _LEN[data[pos]]
    if n >= 0:  # a one-byte length; a string cut short by the end of the data fails the next read
        pos += n + 1
        return data[pos - n:pos].decode(), pos
    n, pos = _varint(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise _Corrupt(f"string of {n} bytes at offset {pos}, {len(data) - pos} left")
    return data[pos:end].decode(), end


def _bytes(data: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = _varint(data, pos)
    end = pos + n
    if n < 0 or end > len(data):
        raise _Corrupt(f"bytes of length {n} at offset {pos}, {len(data) - pos} left")
    return data[pos:end], end


def _blocks(data: bytes, pos: int) -> tuple[int, int]:
    """(item count, position) of the next array/map block; 0 at the end. A negative count is followed
    by the block's size in bytes, unused; fastavro's C negation leaves ``-2**63`` negative, so that
    block has no items and the next count follows."""
    n, pos = _varint(data, pos)
    while n < 0:
        _, pos = _varint(data, pos)
        if n != -(1 << 63):
            return -n, pos
        n, pos = _varint(data, pos)
    return n, pos


def _union(branches: list[Any]) -> dict[int, int]:
    """Branch position -> index into ``branches``, negative positions too (fastavro indexes a list)."""
    k = len(branches)
    return {i: i % k for i in range(-k, k)}


def _fixed(typ: str) -> Callable[[bytes, int], tuple[float, int]]:
    size, unpack_from = (8, _unpack_d) if typ == "double" else (4, _unpack_f)

    def number(data: bytes, pos: int) -> tuple[float, int]:
        if pos + size > len(data):
            raise _Corrupt(f"{typ} at offset {pos}, {len(data) - pos} bytes left")
        return unpack_from(data, pos)[0], pos + size

    return number


def _boolean(data: bytes, pos: int) -> tuple[bool, int]:
    return data[pos] != 0, pos + 1  # fastavro: any non-zero byte is true


def _null(data: bytes, pos: int) -> tuple[None, int]:
    return None, pos


_PRIMITIVES: dict[str, Callable[[bytes, int], tuple[Any, int]]] = {
    "string": _string, "int": _varint, "long": _varint, "bytes": _bytes, "double": _fixed("double"),
    "float": _fixed("float"), "boolean": _boolean, "null": _null}


def _reader(typ: Any, named: dict[str, Any]) -> Callable[[bytes, int], tuple[Any, int]]:
    """``(data, pos) -> (value, next pos)`` for a schema type; raises ValueError for a type this module
    does not read (``create`` then falls back to fastavro)."""
    if isinstance(typ, str):
        if typ in _PRIMITIVES:
            return _PRIMITIVES[typ]
        return _reader(named[typ], named)
    if isinstance(typ, list):
        if len(typ) != 2 or "null" not in typ:
            raise ValueError(f"no fast reader for union {typ!r}")
        return _optional(typ, _reader(next(t for t in typ if t != "null"), named))
    kind = typ.get("type")
    if kind == "record":
        named[typ["name"]] = typ
        return _record(typ, named)
    if kind == "array":
        return _array(typ["items"], named)
    if kind == "map":
        return _map(typ["values"], named)
    raise ValueError(f"no fast reader for type {typ!r}")


def _optional(union: list[Any], read: Callable[[bytes, int], tuple[Any, int]]
              ) -> Callable[[bytes, int], tuple[Any, int]]:
    """Reader of a two-branch ``null``/value union, in either order."""
    nulls = frozenset(p for p, i in _union(union).items() if union[i] == "null")
    null_byte = _null_byte(union)
    value_byte = 2 - null_byte  # positions 0 and 1 are one-byte varints: 0x00 and 0x02

    def opt(data: bytes, pos: int) -> tuple[Any, int]:
        b = data[pos]
        if b == null_byte:
            return None, pos + 1
        if b == value_byte:
            if read is _string and (n := _LEN[data[pos + 1]]) >= 0:  # inline: most optionals are strings
                pos += n + 2
                return data[pos - n:pos].decode(), pos
            return read(data, pos + 1)
        idx, pos = _varint(data, pos)  # a negative or a non-canonical position: as fastavro reads it
        if idx in nulls:
            return None, pos
        if -2 <= idx < 2:
            return read(data, pos)
        raise _Corrupt(f"union index {idx} out of range (2 branches) at offset {pos}")

    return opt


def _null_byte(typ: Any) -> int:
    """The one-byte varint of the null position of a two-branch ``null`` union, else -1."""
    return 2 * typ.index("null") if isinstance(typ, list) and len(typ) == 2 and "null" in typ else -1


def _record(typ: dict[str, Any], named: dict[str, Any]) -> Callable[[bytes, int], tuple[dict[str, Any], int]]:
    # (name, reader, the byte of a null union position or -1): most optional fields are null, and
    # testing one byte costs less than a call.
    fields = [(f["name"], _reader(f["type"], named), _null_byte(f["type"])) for f in typ["fields"]]

    def record(data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        out = {}
        for name, read, null in fields:
            if null != -1 and data[pos] == null:
                out[name] = None
                pos += 1
            else:
                out[name], pos = read(data, pos)
        return out, pos

    return record


def _array(items: Any, named: dict[str, Any]) -> Callable[[bytes, int], tuple[list[Any], int]]:
    """Reader of an Avro array (blocks of items, ended by an empty block)."""
    read = _reader(items, named)

    def block(data: bytes, pos: int, count: int) -> tuple[list[Any], int]:
        out = []
        for _ in range(count):
            v, pos = read(data, pos)
            out.append(v)
        return out, pos

    def read_array(data: bytes, pos: int) -> tuple[list[Any], int]:
        if data[pos] == 0:  # empty: the legacy token arrays of every record written today
            return [], pos + 1
        n, pos = _blocks(data, pos)
        out: list[Any] = []
        while n:
            more, pos = block(data, pos, n)
            out += more
            n, pos = _blocks(data, pos)
        return out, pos

    return read_array


def _map(values: Any, named: dict[str, Any]) -> Callable[[bytes, int], tuple[dict[str, Any], int]]:
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
        arrays.append((field["name"], _reader(field["type"], named)))
    n_branches = len(values)
    read_double = _PRIMITIVES["double"]

    def read_map(data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        n, pos = _blocks(data, pos)
        lens = _LEN
        while n:
            for _ in range(n):
                k = lens[data[pos]]
                if k < 0:
                    key, pos = _string(data, pos)
                else:
                    pos += k + 1
                    key = data[pos - k:pos].decode()
                b = data[pos]
                idx, pos = (_ZZ[b], pos + 1) if b < 0x80 else _varint(data, pos)
                kind = kinds.get(idx)
                if kind == STRING:
                    k = lens[data[pos]]
                    if k < 0:
                        out[key], pos = _string(data, pos)
                    else:
                        pos += k + 1
                        out[key] = data[pos - k:pos].decode()
                elif kind == NULL:
                    out[key] = None
                elif kind == LONG:
                    b = data[pos]
                    out[key], pos = (_ZZ[b], pos + 1) if b < 0x80 else _varint(data, pos)
                elif kind == BOOL:
                    out[key] = data[pos] != 0
                    pos += 1
                elif kind == DOUBLE:
                    out[key], pos = read_double(data, pos)
                elif kind is None:
                    raise _Corrupt(f"union index {idx} out of range ({n_branches} branches) in map value {key!r}")
                else:
                    name, read = arrays[kind - ARRAY]
                    items, pos = read(data, pos)
                    out[key] = {name: items}
            n, pos = _blocks(data, pos)
        return out, pos

    return read_map


class FastSpanDecoder:
    """``decode(data, offset) -> dict``: exactly what ``Codec.decode(data, expect="Span")`` returns for
    a record written with the schema this decoder was built from."""

    def __init__(self, schema: dict[str, Any], label: str, packed: bool) -> None:
        fields = {f["name"]: f["type"] for f in schema["fields"]}
        if tuple(fields) != _TOP_FIELDS or [f["name"] for f in fields["status"]["fields"]] != ["code", "message"]:
            raise ValueError(f"Span fields {tuple(fields)} are not the layout this module reads")
        named: dict[str, Any] = {}
        self._attributes = _map(fields["attributes"]["values"], named)  # defines the array records
        self._events = _reader(fields["events"], named)
        self._resource = _map(fields["resource"]["values"], named)
        self._parent, self._rollout, self._attempt, self._task = (
            _reader(fields[f], named) for f in ("parent_span_id", "rollout_id", "attempt_id", "task_id"))
        self._message = _reader(fields["status"]["fields"][1]["type"], named)
        self._scope = _reader(fields["scope"], named)
        self._llm = _reader(fields["llm"], named)
        self.label = label
        self._packed = packed

    def _span(self, data: bytes, pos: int) -> tuple[dict[str, Any], int]:
        """The record in schema order, the top level written out: on a small span a loop over field
        readers costs more than the reading."""
        string = _string
        trace_id, pos = string(data, pos)
        span_id, pos = string(data, pos)
        parent, pos = self._parent(data, pos)
        name, pos = string(data, pos)
        kind, pos = string(data, pos)
        start, pos = _varint(data, pos)
        end, pos = _varint(data, pos)
        code, pos = string(data, pos)
        message, pos = self._message(data, pos)
        attributes, pos = self._attributes(data, pos)
        events, pos = ([], pos + 1) if data[pos] == 0 else self._events(data, pos)
        resource, pos = ({}, pos + 1) if data[pos] == 0 else self._resource(data, pos)
        scope, pos = self._scope(data, pos)
        rollout_id, pos = self._rollout(data, pos)
        attempt_id, pos = self._attempt(data, pos)
        task_id, pos = self._task(data, pos)
        llm, pos = self._llm(data, pos)
        return {"trace_id": trace_id, "span_id": span_id, "parent_span_id": parent, "name": name, "kind": kind,
                "start_time_ns": start, "end_time_ns": end, "status": {"code": code, "message": message},
                "attributes": attributes, "events": events, "resource": resource, "scope": scope,
                "rollout_id": rollout_id, "attempt_id": attempt_id, "task_id": task_id, "llm": llm}, pos

    @classmethod
    def create(cls, codec: Any) -> FastSpanDecoder | None:
        """A decoder for the newest Span schema of ``codec``, verified against fastavro; None (keep
        fastavro) if the schema has a shape this module does not read or any result differs."""
        from boltstream.producers.span_encoder import sample_record  # the encoder's self-check records

        try:
            latest = codec.catalog.latest("Span")
            dec = cls(latest.raw, f"Span v{latest.version}", has_packed_fields("Span", latest.parsed))
            for sample in (sample_record(), sample_record(empty=True)):
                data, offset, reference = codec.reference_roundtrip("Span", sample)
                if not same(dec.decode(data, offset), reference):
                    log.warning("fast Span decoder disagrees with fastavro; using fastavro (slower)")
                    return None
            return dec
        except Exception as exc:  # a schema we do not know how to read: never fatal
            log.warning("fast Span decoder unavailable (%s); using fastavro (slower)", exc)
            return None

    def decode(self, data: bytes, offset: int) -> dict[str, Any]:
        """The record whose Avro body starts at ``offset``; ``SchemaError`` (without a topic) where
        fastavro would fail, with the codec's wording."""
        try:
            record, pos = self._span(data, offset)
        except IndexError:
            reason = f"ran past the end of the record ({len(data)} bytes)"
        except _Corrupt as exc:
            reason = str(exc)
        except Exception as exc:  # UnicodeDecodeError, struct.error: whatever the bytes provoke
            reason = f"{type(exc).__name__}: {exc}"[:300]
        else:
            if pos > len(data):
                raise SchemaError(f"truncated {self.label} record: {len(data)} bytes, {pos} read")
            if pos != len(data):
                raise SchemaError(f"corrupt {self.label} record: {len(data) - pos} bytes left over after the record")
            llm = record.get("llm")
            if self._packed and llm is not None:
                try:
                    for field, kind in TOKEN_FIELDS:
                        raw = llm.pop(wire_name(field, kind))
                        llm[field] = unpack(raw, kind, field) if raw else as_array(llm.get(field) or (), kind)
                except SchemaError as exc:
                    raise SchemaError(f"corrupt {self.label} record: {exc.reason}") from None
            return record
        raise SchemaError(f"truncated or corrupt {self.label} record ({len(data)} bytes): {reason}")


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types, NaN equal to NaN (a decoded record compared with fastavro's)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, array):  # array.array: compared as bytes, so NaN payloads count too
        return a.typecode == b.typecode and a.tobytes() == b.tobytes()
    return a == b
