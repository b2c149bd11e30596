"""A record reader compiled from its schema into one straight-line Python function.

Why: on a small span (a few hundred bytes, ~17 fields) a loop over per-field readers spends more on
calls than on reading. The function generated here reads strings, integers and null union positions
inline, the common case first (a one-byte length or varint, a canonical union position), and hands
everything else to the readers of schemas/avro_readers.py: long strings and varints, negative or
non-canonical union positions, maps, arrays, bytes, floating point. Those readers decide every odd
or bad byte, so the compiled function reads exactly what they read (and fastavro reads).

The generated source is kept on the function (``__source__``) for reading and debugging; it is made
only of the schema's field names (as ``repr`` literals) and names defined here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from .avro_readers import LEN, ZZ, null_byte, read_string, read_varint, reader


def compile_record(schema: dict[str, Any]) -> Callable[[bytes, int], tuple[dict[str, Any], int]]:
    """``(data, pos) -> (record, next pos)`` for a record schema; ``ValueError`` for a type the readers
    do not read."""
    env: dict[str, Any] = {"LEN": LEN, "ZZ": ZZ, "read_string": read_string, "read_varint": read_varint}
    lines = ["def read(data, pos):"]
    value = _emit(schema, {}, env, lines, 1, itertools.count())
    lines.append(f"    return {value}, pos")
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<compiled reader of {schema.get('name')}>", "exec"), env)
    read = env["read"]
    read.__source__ = source
    return read  # type: ignore[no-any-return]


def _call(fn: Callable[..., Any], env: dict[str, Any]) -> str:
    """The name under which the generated code calls ``fn``."""
    name = f"R{len(env)}"
    env[name] = fn
    return name


def _emit(typ: Any, named: dict[str, Any], env: dict[str, Any], lines: list[str], depth: int,
          ids: Iterator[int]) -> str:
    """Append the code reading one value of ``typ`` at ``pos``; return the local holding it."""
    pad = "    " * depth
    v = f"v{next(ids)}"
    if isinstance(typ, str) and typ in named:  # a record defined earlier in the schema
        typ = named[typ]
    if typ == "string":
        lines += [f"{pad}n = LEN[data[pos]]",  # -1: a longer or a negative length, for read_string
                  f"{pad}if n < 0:",
                  f"{pad}    {v}, pos = read_string(data, pos)",
                  f"{pad}else:",
                  f"{pad}    pos += n + 1",  # cut short by the end of the data: the next read fails
                  f"{pad}    {v} = data[pos - n:pos].decode()"]
    elif typ in ("int", "long"):
        lines += [f"{pad}b = data[pos]",
                  f"{pad}if b < 0x80:",
                  f"{pad}    {v} = ZZ[b]",
                  f"{pad}    pos += 1",
                  f"{pad}else:",
                  f"{pad}    {v}, pos = read_varint(data, pos)"]
    elif isinstance(typ, dict) and typ.get("type") == "record":
        named[typ["name"]] = typ
        items = [f"{f['name']!r}: {_emit(f['type'], named, env, lines, depth, ids)}" for f in typ["fields"]]
        lines.append(f"{pad}{v} = {{{', '.join(items)}}}")
    elif null_byte(typ) != -1:
        nul = null_byte(typ)
        slow = _call(reader(typ, named), env)  # negative and non-canonical positions, out of range
        lines += [f"{pad}b = data[pos]",
                  f"{pad}if b == {nul}:",
                  f"{pad}    {v} = None",
                  f"{pad}    pos += 1",
                  f"{pad}elif b == {2 - nul}:",
                  f"{pad}    pos += 1"]
        inner = _emit(next(t for t in typ if t != "null"), named, env, lines, depth + 1, ids)
        lines += [f"{pad}    {v} = {inner}",
                  f"{pad}else:",
                  f"{pad}    {v}, pos = {slow}(data, pos)"]
    elif isinstance(typ, dict) and typ.get("type") in ("array", "map"):
        empty = "[]" if typ["type"] == "array" else "{}"
        fn = _call(reader(typ, named), env)
        lines += [f"{pad}if data[pos] == 0:",  # empty: one byte
                  f"{pad}    {v} = {empty}",
                  f"{pad}    pos += 1",
                  f"{pad}else:",
                  f"{pad}    {v}, pos = {fn}(data, pos)"]
    else:
        lines.append(f"{pad}{v}, pos = {_call(reader(typ, named), env)}(data, pos)")
    return v
