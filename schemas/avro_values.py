"""Values as fastavro writes them: union branches named up front, and a failed write explained.

fastavro picks a union branch by VALIDATING the value against each branch in turn. For a nested
record (a span's ``llm`` block with thousands of token ids) or an array attribute
(``{"strings": [...]}`` inside a map of unions) that costs far more than writing it: measured 17 us
per array attribute, against 3 us when the branch is named up front in fastavro's tuple notation
``(type_name, value)``. :func:`union_tagger` compiles, once per schema, a function that names the
branch for the two unambiguous shapes boltstream's schemas use; anything else is left for fastavro
to match (and to reject with its own validation). When a write fails, :func:`explain_invalid` runs
the slow validator to name the field that was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastavro.validation import ValidationError, validate

Tagger = Callable[[Any], Any]
_PRIMITIVE_BRANCH: dict[type, str] = {
    type(None): "null",
    bool: "boolean",
    int: "long",
    float: "double",
    str: "string",
    bytes: "bytes",
}


def union_tagger(parsed: dict[str, Any]) -> Tagger | None:
    """A function rewriting a record's union values into tuple notation, or None if it has none."""
    return _tagger(parsed, parsed.get("__named_schemas", {}), set())


def _tagger(schema: Any, named: dict[str, Any], seen: set[str]) -> Tagger | None:
    if isinstance(schema, str):
        if schema not in named or schema in seen:
            return None
        return _tagger(named[schema], named, seen)
    if isinstance(schema, list):
        return _union_tagger(schema, named, seen)
    kind = schema.get("type")
    if kind == "record":
        name = schema["name"]
        inner = {f["name"]: t for f in schema["fields"] if (t := _tagger(f["type"], named, seen | {name}))}
        return _record_tagger(inner) if inner else None
    if kind == "array":
        item = _tagger(schema["items"], named, seen)
        return None if item is None else (lambda v: [item(x) for x in v] if isinstance(v, list) else v)
    if kind == "map":
        value = _tagger(schema["values"], named, seen)
        return (
            None
            if value is None
            else (lambda v: {k: value(x) for k, x in v.items()} if isinstance(v, dict) else v)
        )
    return None


def _record_tagger(inner: dict[str, Tagger]) -> Tagger:
    items = tuple(inner.items())

    def tag(value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        out = None
        for name, fn in items:
            if name in value:
                if out is None:
                    out = dict(value)  # never mutate the caller's dict
                out[name] = fn(value[name])
        return value if out is None else out

    return tag


def _union_tagger(branches: list[Any], named: dict[str, Any], seen: set[str]) -> Tagger | None:
    records = []
    for branch in branches:
        resolved = named.get(branch, branch) if isinstance(branch, str) else branch
        if isinstance(resolved, dict) and resolved.get("type") == "record":
            records.append(resolved)
    if not records:
        return None
    # Shape 1: ["null", SomeRecord] -- a dict can only be the record.
    if len(records) == 1 and len(branches) == 2 and "null" in branches:
        name = records[0]["name"]
        inner = _tagger(records[0], named, seen)
        if inner is None:
            return lambda v: (name, v) if isinstance(v, dict) else v
        return lambda v: (name, inner(v)) if isinstance(v, dict) else v
    # Shape 2: wrapper records holding one array each, told apart by their field name
    # (Span attributes: {"strings": [...]} is a StringArray).
    by_key: dict[str, str] = {}
    for rec in records:
        fields = rec["fields"]
        if (
            len(fields) != 1
            or not isinstance(fields[0]["type"], dict)
            or fields[0]["type"].get("type") != "array"
        ):
            return None
        by_key[fields[0]["name"]] = rec["name"]
    if len(by_key) != len(records):
        return None

    # Scalars next to them (attribute values) are named by their exact Python type, saving
    # fastavro a validation per branch tried.
    by_type = {t: b for t, b in _PRIMITIVE_BRANCH.items() if b in branches}

    def tag(value: Any) -> Any:
        branch = by_type.get(type(value))
        if branch is not None:
            return (branch, value)
        if isinstance(value, dict) and len(value) == 1:
            key, inner = next(iter(value.items()))
            name = by_key.get(key)
            if name is not None and isinstance(inner, list | tuple):
                return (name, value)
        return value

    return tag


def _describe_type(schema: Any) -> str:
    if isinstance(schema, dict):
        return str(schema.get("name") or schema.get("type"))
    if isinstance(schema, list):
        return "one of " + ", ".join(_describe_type(s) for s in schema)
    return str(schema)


def explain_invalid(value: Any, schema: Any, exc: Exception) -> str:
    """Turn a fastavro write failure into one readable line that names the field.

    Runs only after a failure, so the slow validator costs nothing on the hot path.
    """
    if not isinstance(value, Mapping):
        return f"expected a dict, got {type(value).__name__}"
    try:
        validate(value, schema, raise_errors=True)
    except ValidationError as verr:
        errors = list(verr.errors)
        # A union reports one error per branch tried. "Is not null" is never the culprit, nor is a
        # field "missing" from a branch the value was not meant for; of the rest, a nested record's
        # errors come after its parent's, so the last field named is the deepest one.
        errors = [e for e in errors if e.schema != "null"] or errors
        errors = [e for e in errors if e.datum is not None] or errors
        by_field: dict[str, list[Any]] = {}
        data: dict[str, Any] = {}
        for err in errors:
            by_field.setdefault(str(err.field), []).append(err.schema)
            data[str(err.field)] = err.datum
        field = list(by_field)[-1]
        schemas = by_field[field]
        expected = _describe_type(schemas[0] if len(schemas) == 1 else schemas)
        datum = data[field]
        got = "missing/None" if datum is None else f"{type(datum).__name__} {datum!r:.80}"
        return f"field {field}: got {got}, expected {expected}"
    except Exception:  # the validator itself choked; fall back to the writer's message
        pass
    return f"{type(exc).__name__}: {exc}"[:400]
