"""OTel attribute values -> the Span schema's attribute union, and tolerant parsers for what agents write.

Why a module of its own: every path into the ``spans`` topic (the exporter, OTLP
ingest, the normaliser's GenAI mapping) must agree on how a value looks in Avro,
or the same span read twice would differ. The Span schema's attribute map holds
``null | boolean | long | double | string`` or one of four wrapped arrays
(``{"bools": [...]}``, ``{"longs": [...]}``, ``{"doubles": [...]}``,
``{"strings": [...]}``). Anything else (a dict from OTLP ``kvlist``, a numpy
scalar, bytes, an arbitrary object smuggled in by an instrumentation) is
converted, never rejected: a span is worth more with a stringified attribute
than not at all.

The parsers (:func:`int_array`, :func:`float_array`, :func:`maybe_json`) exist
because token ids arrive as real sequences, as JSON strings (``"[1, 2]"``), as
Python reprs (``str(list)``, Agent Lightning's vLLM path) and nested one level
(``[[1, 2]]``, vLLM's ``response_token_ids`` per choice).
"""

from __future__ import annotations

import ast
import base64
import json
import math
import numbers
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from boltstream.schemas.errors import SchemaError
from boltstream.schemas.packed import F32, I32, as_array

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

AvroAttr = None | bool | int | float | str | dict[str, list[Any]]


def _scalar_text(x: Any) -> str:
    """One element of a mixed array as text: strings as-is, JSON for JSON-able values, str() otherwise."""
    if isinstance(x, str):
        return x
    try:
        return json.dumps(x, default=str, sort_keys=True)
    except (TypeError, ValueError):
        return str(x)


def _array(seq: Sequence[Any]) -> dict[str, list[Any]]:
    """Wrap a homogeneous sequence in the matching array record; mixed sequences become strings."""
    if not seq:
        return {"strings": []}
    kinds = {type(x) for x in seq}
    if kinds == {str}:
        return {"strings": list(seq)}
    if kinds == {bool}:
        return {"bools": list(seq)}
    if kinds == {int}:
        if all(INT64_MIN <= x <= INT64_MAX for x in seq):
            return {"longs": list(seq)}
        return {"strings": [str(x) for x in seq]}
    if kinds <= {int, float}:
        return {"doubles": [float(x) for x in seq]}
    return {"strings": [_scalar_text(x) for x in seq]}


def attr_value(v: Any) -> AvroAttr:
    """Convert one attribute value to the schema's union; never raises."""
    t = type(v)
    if v is None or t is str or t is bool or t is float:
        return v
    if t is int:
        return v if INT64_MIN <= v <= INT64_MAX else str(v)
    if t is list or t is tuple:
        return _array(v)
    try:
        if isinstance(v, str):
            return str(v)
        if isinstance(v, bool):
            return bool(v)
        if isinstance(v, numbers.Integral):
            return attr_value(int(v))
        if isinstance(v, numbers.Real):
            return float(v)
        if isinstance(v, bytes | bytearray | memoryview):
            raw = bytes(v)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return "base64:" + base64.b64encode(raw).decode("ascii")
        if isinstance(v, Mapping):
            return json.dumps(v, default=str, sort_keys=True)
        if isinstance(v, Sequence):
            return _array([_plain(x) for x in v])
        return str(v)
    except Exception:  # a hostile __str__/__iter__ must not lose the span
        return f"<unrepresentable {t.__name__}>"


def _plain(x: Any) -> Any:
    """Numpy-like scalars inside a sequence -> Python scalars, so typing the array works."""
    if isinstance(x, bool | str) or x is None:
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    return x


def convert_attributes(attrs: Mapping[str, Any] | None,
                       exclude: frozenset[str] | set[str] = frozenset()) -> dict[str, AvroAttr]:
    """A whole attribute mapping -> the schema's map (keys as str), leaving out the names in ``exclude``."""
    if not attrs:
        return {}
    scalars = _SCALARS
    try:  # keys are str (the SDK and OTLP guarantee it); most values need no conversion
        if exclude:
            return {k if type(k) is str else str(k): v if type(v) in scalars else attr_value(v)
                    for k, v in attrs.items() if k not in exclude}
        return {k if type(k) is str else str(k): v if type(v) in scalars else attr_value(v)
                for k, v in attrs.items()}
    except Exception:
        return _convert_slow(attrs, exclude)


def _convert_slow(attrs: Mapping[Any, Any], exclude: frozenset[str] | set[str]) -> dict[str, AvroAttr]:
    out: dict[str, AvroAttr] = {}
    for k, v in attrs.items():
        key = k if type(k) is str else str(k)
        if key not in exclude:
            out[key] = attr_value(v)
    return out


_SCALARS = frozenset((str, bool, float, type(None)))


def maybe_json(v: Any) -> Any:
    """Parse a string holding JSON (or a Python literal, as ``str(list)`` writes it); else return v."""
    if type(v) is not str:
        return v
    s = v.strip()
    if not s or s[0] not in "[{":
        return v
    try:
        return json.loads(s)
    except ValueError:
        pass
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return v


def _unwrap(v: Any) -> Any:
    """Attribute value as a plain Python value: JSON strings parsed, wrapped arrays unwrapped."""
    v = maybe_json(v)
    if isinstance(v, Mapping) and len(v) == 1:
        ((k, inner),) = v.items()
        if k in ("longs", "doubles", "strings", "bools"):
            return inner
    return v


def _packed(v: Any, kind: str) -> array | None:
    """The common case, checked in C: a list/tuple of numbers packed whole (struct refuses a str, a
    float for an int, an id beyond int32); None for anything else, or if a bool hides among them."""
    if type(v) not in (list, tuple):
        return None
    try:
        out = as_array(v, kind)
    except SchemaError:
        return None
    return None if bool in set(map(type, v)) else out


def int_array(v: Any) -> array | None:
    """Token ids in any of the shapes agents write -> ``array('i')`` (what the Span record packs
    without another pass), or None if it is not one."""
    fast = _packed(v, I32)
    if fast is not None:
        return fast
    v = _unwrap(v)
    if isinstance(v, str | bytes) or not isinstance(v, Sequence):
        return None
    if v and not isinstance(v[0], numbers.Number) and isinstance(v[0], Sequence) and not isinstance(v[0], str):
        v = v[0]  # one list per choice: the first choice is the sampled one
    out: list[int] = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            if isinstance(x, str) and x.strip().lstrip("-").isdigit():
                x = int(x)
            else:
                return None
        if isinstance(x, float) and not x.is_integer():
            return None
        i = int(x)
        if not INT32_MIN <= i <= INT32_MAX:
            return None
        out.append(i)
    return array("i", out)


def float_array(v: Any) -> array | None:
    """Logprobs in any of the shapes agents write -> ``array('f')`` (the Span record keeps logprobs
    as float32), or None."""
    fast = _packed(v, F32)
    if fast is not None:
        return fast
    v = _unwrap(v)
    if isinstance(v, str | bytes) or not isinstance(v, Sequence):
        return None
    out: list[float] = []
    for x in v:
        if isinstance(x, bool):
            return None
        if isinstance(x, str):
            try:
                x = float(x)
            except ValueError:
                return None
        if not isinstance(x, numbers.Real):
            return None
        out.append(float(x))
    return array("f", out)


def as_float(v: Any) -> float | None:
    """A finite number from a number or numeric string; None otherwise (bools are not numbers here)."""
    t = type(v)
    if t is float:  # fast paths: the ABC check below costs more than the rest together
        return v if math.isfinite(v) else None
    if t is int:
        try:
            return float(v)
        except OverflowError:
            return None
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            return None
    if isinstance(v, numbers.Real):
        f = float(v)
        return f if math.isfinite(f) else None
    return None


def as_int(v: Any, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int | None:
    """An integer in [lo, hi] from an int, an integral float or a numeric string; None otherwise."""
    if type(v) is int:
        return v if lo <= v <= hi else None
    f = as_float(v) if not isinstance(v, int) or isinstance(v, bool) else v
    if f is None or isinstance(f, bool):
        return None
    if isinstance(f, float):
        if not f.is_integer():
            return None
        f = int(f)
    return f if lo <= f <= hi else None


def as_str(v: Any) -> str | None:
    """A non-empty string id from a str or int attribute; None for anything else."""
    if isinstance(v, str):
        return v or None
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return None
