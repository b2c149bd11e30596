"""Make an encoded Span fit the broker's message size: shrink it, mark it, never drop it silently.

Why here and not in the broker: a record over ``max.message.bytes`` is
rejected for the whole batch and the producer would retry it forever or drop
it. A span carrying a huge prompt is still useful (its ids, timing, status,
token counts and the reward chain survive), so we remove the biggest things
first and say so in-band: ``boltstream.truncated=true`` plus
``boltstream.truncated.fields`` listing what went. Order of sacrifice:

1. events (largest first; exception stack traces live here),
2. attributes other than boltstream's own, largest first (prompt/response
   JSON, tool outputs),
3. token arrays of the ``llm`` block: prompt ids, then logprobs, then
   response ids (the response is what training needs most),
4. resource attributes, then the status message and name are cut to 256 chars.

Sizes are estimated from the encoded form once and the record re-encoded only
a few times, so a pathological span costs milliseconds, not seconds.

Before that, every span passes :func:`cap_attributes`: no single attribute
value (a string, or an array's elements together) may exceed
``max_attribute_bytes`` (``BOLTSTREAM_EXPORTER_MAX_ATTRIBUTE_BYTES``, default
:data:`DEFAULT_MAX_ATTRIBUTE_BYTES`; 0 turns it off). A longer string keeps
its first bytes, an array its first elements, and the span carries the same
markers with ``cut:attribute:<name>``. So one runaway attribute (a 10 MB tool
output) costs that attribute's tail, not the span's other attributes, and the
spans topic never carries it whole.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from boltstream.schemas import records

TRUNCATED = records.TRUNCATED
TRUNCATED_FIELDS = records.TRUNCATED_FIELDS
_KEEP_PREFIX = "boltstream."
# Large enough for the prompt/tool JSON of ordinary agents (AIR parses tool arguments: a cut JSON
# reads as invalid), small enough that one runaway value cannot crowd a span out of the broker.
DEFAULT_MAX_ATTRIBUTE_BYTES = 262_144


def _size(v: Any) -> int:
    """Cheap estimate of a value's encoded size (exactness is not needed, order is)."""
    if v is None or isinstance(v, bool):
        return 1
    if isinstance(v, int | float):
        return 8
    if isinstance(v, str):
        return len(v) + 2
    if isinstance(v, dict):
        return sum(_size(x) + (len(k) if isinstance(k, str) else 0) for k, x in v.items()) + 2
    if isinstance(v, list | tuple):
        return sum(_size(x) for x in v) + 2
    return 16


def _cut(value: Any, limit: int) -> Any:
    """``value`` cut to about ``limit`` encoded bytes, or None when it is within the limit."""
    if isinstance(value, str):
        if len(value) * 4 <= limit:  # cheap test first: UTF-8 takes at most 4 bytes a character
            return None
        data = value.encode("utf-8")
        return data[:limit].decode("utf-8", "ignore") if len(data) > limit else None
    if isinstance(value, dict) and len(value) == 1:  # an array: {"strings": [...]} and the like
        (kind, items), = value.items()
        if not isinstance(items, list) or _size(items) <= limit:
            return None
        kept, size = [], 2
        for item in items:
            size += _size(item)
            if size > limit:
                break
            kept.append(item)
        return {kind: kept}
    return None


def cap_attributes(record: dict[str, Any], limit: int) -> tuple[dict[str, Any], list[str]]:
    """``record`` with no attribute value over ``limit`` bytes, and what was cut (see the module docstring).

    Returns the record itself when nothing is over the limit (the common case costs
    one pass over the attribute values); otherwise a copy. ``limit`` <= 0: no cap.
    """
    if limit <= 0:
        return record, []
    attributes = record.get("attributes") or {}
    short = limit // 4  # a string this short fits whatever its characters (UTF-8: at most 4 bytes each)
    cuts = {}
    for k, v in attributes.items():  # the common case (numbers, short strings) costs a type check
        t = type(v)
        if (t is str and len(v) <= short) or (t is not str and t is not dict):
            continue
        if k not in (TRUNCATED, TRUNCATED_FIELDS) and (c := _cut(v, limit)) is not None:
            cuts[k] = c
    if not cuts:
        return record, []
    removed = [f"cut:attribute:{k}" for k in cuts]
    rec = dict(record)
    rec["attributes"] = {**attributes, **cuts, TRUNCATED: True, TRUNCATED_FIELDS: {"strings": removed[-200:]}}
    return rec, removed


def fit(
    record: dict[str, Any], encode: Callable[[dict[str, Any]], bytes], limit: int, already: list[str] | None = None
) -> tuple[bytes, list[str]]:
    """Encode ``record``; if over ``limit`` bytes, shrink a copy until it fits.

    Returns (encoded bytes, names of what was removed); the list is empty when
    the record fit as it was. The caller's record is never modified. ``already``:
    what an earlier step (:func:`cap_attributes`) removed, kept in the marker.
    """
    data = encode(record)
    if len(data) <= limit:
        return data, list(already or ())
    rec = copy.copy(record)
    rec["attributes"] = dict(record["attributes"])
    rec["events"] = list(record["events"])
    removed: list[str] = list(already or ())

    def attempt() -> bytes:
        rec["attributes"][TRUNCATED] = True
        rec["attributes"][TRUNCATED_FIELDS] = {"strings": removed[-200:]}
        return encode(rec)

    excess = len(data) - limit
    steps: list[tuple[str, Callable[[], None], int]] = []
    for i, ev in sorted(enumerate(rec["events"]), key=lambda p: -_size(p[1])):
        steps.append((f"event:{ev['name']}", lambda i=i: rec["events"].__setitem__(i, None), _size(ev)))
    big = sorted(
        ((k, v) for k, v in rec["attributes"].items() if not k.startswith(_KEEP_PREFIX)),
        key=lambda kv: -_size(kv[1]),
    )
    for k, v in big:
        steps.append((f"attribute:{k}", lambda k=k: rec["attributes"].pop(k, None), _size(v) + len(k)))
    if rec.get("llm"):
        rec["llm"] = dict(rec["llm"])
        for fld in ("prompt_token_ids", "response_logprobs", "response_token_ids"):
            n = len(rec["llm"][fld])
            if n:
                steps.append((f"llm.{fld}", lambda f=fld: rec["llm"].__setitem__(f, []), n * 4))  # packed
    for k, v in sorted(record["resource"].items(), key=lambda kv: -_size(kv[1])):
        steps.append((f"resource:{k}", lambda k=k: rec.__setitem__(
            "resource", {rk: rv for rk, rv in rec["resource"].items() if rk != k}), _size(v) + len(k)))

    planned = 0
    for label, apply, est in steps:
        apply()
        removed.append(label)
        planned += est
        if planned >= excess:  # the estimate says it fits: check for real, keep going if not
            rec["events"] = [e for e in rec["events"] if e is not None]
            data = attempt()
            excess = len(data) - limit
            if excess <= 0:
                return data, removed
            planned = 0
    rec["events"] = [e for e in rec["events"] if e is not None]
    status = dict(rec["status"])
    if status.get("message"):
        status["message"] = status["message"][:256]
    rec["status"] = status
    rec["name"] = rec["name"][:256]
    rec["attributes"] = {k: v[:1024] if isinstance(v, str) else v for k, v in rec["attributes"].items()}
    removed.append("cut:name,status.message,long strings")
    return attempt(), removed
