"""Flattened chat messages (OpenInference, legacy GenAI) -> the current GenAI semconv shape.

Why a module of its own: agents write a conversation as dozens of flat
attributes (``llm.input_messages.0.message.role``, ``gen_ai.prompt.1.content``,
tool calls nested one level deeper) and the ``spans`` topic carries it once, as
``gen_ai.input.messages`` / ``gen_ai.output.messages`` JSON. This runs for
every LLM span the exporter sees, so it is written for speed: attribute names
are classified once per name (they recur on every span of an agent) and the
JSON encoder is built once. Pure functions of an attribute mapping; the
mapping rules are listed in docs/producers.md ("Normalisation").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from .attributes import maybe_json


def _make_dumps() -> Callable[[Any], str]:
    """``json.dumps(o, default=str)``, built once. ``JSONEncoder.encode`` builds its C core on every
    call (~1 µs of the ~2.5 µs a message list costs); the core is reused when it is available and
    writes the same text (checked here), else the plain encoder is used."""
    plain = json.JSONEncoder(default=str).encode
    try:
        core = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
            None, str, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, True)

        def fast(o: Any) -> str:
            return "".join(core(o, 0))

        probe = [{"a": [1, 2.5, None, True, "\u00fc\n", float("nan"), object]}, "x"]
        return fast if fast(probe) == plain(probe) else plain
    except Exception:  # no C accelerator (PyPy) or another signature
        return plain


dumps = _make_dumps()


_BY_HEAD = {"llm.in": "llm.input_messages.", "llm.ou": "llm.output_messages.", "gen_ai": None}
_INDEXED: dict[str, tuple[str, int, str] | tuple[()]] = {}


def _parse_indexed(k: str) -> tuple[str, int, str] | tuple[()]:
    """``prefix.N.rest`` -> (prefix, N, rest), or () when ``k`` is not a flattened message field."""
    prefix = _BY_HEAD[k[:6]]
    if prefix is None:
        prefix = "gen_ai.prompt." if k.startswith("gen_ai.prompt.") else (
            "gen_ai.completion." if k.startswith("gen_ai.completion.") else None)
        if prefix is None:
            return ()
    elif not k.startswith(prefix):
        return ()
    idx, _, rest = k[len(prefix):].partition(".")
    return (prefix[:-1], int(idx), rest) if idx.isdigit() and rest else ()


def _indexed_groups(attrs: Mapping[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """``prefix.N.rest`` attributes grouped as {prefix: {N: {rest: value}}}, one pass over the keys.

    Attribute names recur on every span of an agent (``llm.input_messages.0.message.role`` ...),
    so each name is classified once and remembered (bounded): one dict lookup per attribute."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    cache = _INDEXED
    for k, v in attrs.items():
        spec = cache.get(k)
        if spec is None:
            if len(cache) >= 20_000:
                cache.clear()
            spec = cache[k] = _parse_indexed(k) if k[:6] in _BY_HEAD else ()
        if spec:
            prefix, idx, rest = spec
            group = groups.get(prefix)
            if group is None:
                group = groups[prefix] = {}
            fields = group.get(idx)
            if fields is None:
                fields = group[idx] = {}
            fields[rest] = v
    return groups


def _arguments(v: Any) -> Any:
    parsed = maybe_json(v)
    return parsed if isinstance(parsed, Mapping | list) else v


def _sub_indexed(fields: Mapping[str, Any], prefix: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for k, v in fields.items():
        if k.startswith(prefix):
            idx, _, rest = k[len(prefix):].partition(".")
            if idx.isdigit():
                out.setdefault(int(idx), {})[rest] = v
    return out


_FIELDS_OI = ("message.role", "message.content", "message.tool_call_id", "finish_reason")
_FIELDS_LEGACY = ("role", "content", "tool_call_id", "finish_reason")


def _message(fields: Mapping[str, Any], openinference: bool) -> tuple[dict[str, Any], list[str]]:
    """One flattened message (legacy GenAI or OpenInference names) -> (semconv message, field names used)."""
    names = _FIELDS_OI if openinference else _FIELDS_LEGACY
    used = [k for k in names if k in fields]
    more = len(used) < len(fields)  # contents, tool calls or unknown fields: only then scan for them
    role = fields.get(names[0]) or "user"
    parts: list[dict[str, Any]] = []
    content = fields.get(names[1])
    if openinference and content is None and more:
        texts = []
        for idx, c in sorted(_sub_indexed(fields, "message.contents.").items()):
            if c.get("message_content.type", "text") == "text" and isinstance(c.get("message_content.text"), str):
                texts.append(c["message_content.text"])
                used.extend(f"message.contents.{idx}.{k}" for k in c
                            if k in ("message_content.text", "message_content.type"))
        content = "".join(texts) or None
    if role == "tool" and content is not None:
        parts.append({"type": "tool_call_response", "id": fields.get(names[2]), "response": content})
    elif content is not None:
        parts.append({"type": "text", "content": content if isinstance(content, str) else dumps(content)})
    if more:
        tc_prefix = "message.tool_calls." if openinference else "tool_calls."
        tc_names = _TOOL_CALL_OI if openinference else _TOOL_CALL_LEGACY
        for idx, tc in sorted(_sub_indexed(fields, tc_prefix).items()):
            tid, name, args = (tc.get(k) for k in tc_names)
            parts.append({"type": "tool_call", "id": tid, "name": name, "arguments": _arguments(args)})
            used.extend(f"{tc_prefix}{idx}.{k}" for k in tc_names if k in tc)
    msg: dict[str, Any] = {"role": role, "parts": parts}
    finish = fields.get("finish_reason")
    if isinstance(finish, str):
        msg["finish_reason"] = finish
    return msg, used


_TOOL_CALL_OI = ("tool_call.id", "tool_call.function.name", "tool_call.function.arguments")
_TOOL_CALL_LEGACY = ("id", "name", "arguments")


def _rebuild(groups: Mapping[str, Mapping[int, Mapping[str, Any]]], current: str, legacy: str,
             consumed: list[str]) -> list[dict[str, Any]] | None:
    """The messages of one side (OpenInference names win over legacy GenAI ones), in index order."""
    src = groups.get(current)
    prefix, oi = current, True
    if src is None:
        src, prefix, oi = groups.get(legacy), legacy, False
        if src is None:
            return None
    out = []
    for idx, fields in sorted(src.items()) if len(src) > 1 else src.items():
        msg, used = _message(fields, oi)
        out.append(msg)
        base = f"{prefix}.{idx}."
        for k in used:
            consumed.append(base + k)
    return out


def messages(attrs: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None,
                                                 list[str]]:
    """(input, output, attribute names consumed): messages in the current semconv shape from any dialect.

    The consumed names are the flattened attributes (``llm.input_messages.0.message.role`` ...)
    whose content is now in the canonical messages; fields we do not understand are not listed.
    """
    cur_in, cur_out = attrs.get("gen_ai.input.messages"), attrs.get("gen_ai.output.messages")
    if cur_in is not None:
        cur_in = maybe_json(cur_in)
    if cur_out is not None:
        cur_out = maybe_json(cur_out)
    need_in, need_out = not isinstance(cur_in, list), not isinstance(cur_out, list)
    consumed: list[str] = []
    if not (need_in or need_out):
        return cur_in, cur_out, consumed
    groups = _indexed_groups(attrs)
    if need_in:
        cur_in = _rebuild(groups, "llm.input_messages", "gen_ai.prompt", consumed) if groups else None
    if need_out:
        cur_out = _rebuild(groups, "llm.output_messages", "gen_ai.completion", consumed) if groups else None
    return cur_in, cur_out, consumed
