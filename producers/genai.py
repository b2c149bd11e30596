"""Read the four attribute dialects agents speak and derive boltstream's view of an LLM call.

Why: boltstream promises to train any agent with no code change, so it must
read what the agent's instrumentation already writes. The dialects, with the
names confirmed against their sources:

* OpenTelemetry GenAI semantic conventions, current (``gen_ai.input.messages``,
  ``gen_ai.output.messages``, ``gen_ai.usage.input_tokens``,
  ``gen_ai.request.*``, ``gen_ai.response.finish_reasons``,
  ``gen_ai.operation.name``) and legacy (``gen_ai.prompt.N.role/content``,
  ``gen_ai.completion.N.*``, ``gen_ai.usage.prompt_tokens``);
* OpenInference (``openinference.span.kind``, ``llm.input_messages.N.message.*``,
  ``llm.token_count.prompt/completion``, ``llm.model_name``,
  ``llm.invocation_parameters`` JSON);
* OpenLLMetry (``traceloop.span.kind``, ``llm.request.type``; it writes the
  legacy ``gen_ai.*`` names for messages and usage);
* Agent Lightning (``prompt_token_ids`` / ``response_token_ids``, also as
  ``llm.hosted_vllm.*`` Python-repr strings, ``agentlightning.reward.N.value``
  and ``.name`` on ``agentlightning.annotation`` spans, AgentOps'
  ``agentops.task.output`` reward JSON) and boltstream's own ``boltstream.llm.*``.

Everything here is a pure function of an attribute mapping. The result is
additive: derived attributes (``boltstream.span.kind``, canonical
``gen_ai.input.messages`` / ``gen_ai.output.messages`` JSON,
``boltstream.reward.*``) are added only when absent; the original attributes
stay, except token-id arrays, which move into the typed ``llm`` block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .attributes import (
    INT32_MAX,
    as_float,
    as_int,
    as_str,
    float_array,
    int_array,
    maybe_json,
)

PROMPT_IDS = ("boltstream.llm.prompt_token_ids", "prompt_token_ids", "llm.hosted_vllm.prompt_token_ids")
RESPONSE_IDS = ("boltstream.llm.response_token_ids", "response_token_ids", "llm.hosted_vllm.response_token_ids")
LOGPROBS = ("boltstream.llm.response_logprobs", "response_logprobs", "llm.hosted_vllm.response_logprobs")
VLLM_CHOICES = "llm.hosted_vllm.choices"
TOKEN_KEYS = frozenset(PROMPT_IDS + RESPONSE_IDS + LOGPROBS)

MODEL = ("boltstream.llm.model", "gen_ai.response.model", "llm.response.model_name", "llm.model_name",
         "gen_ai.request.model", "llm.request.model_name", "llm.hosted_vllm.model")
INPUT_TOKENS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt",
                "llm.usage.prompt_tokens")
OUTPUT_TOKENS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens", "llm.token_count.completion",
                 "llm.usage.completion_tokens")
SAMPLING = {  # llm field -> (attribute names, invocation-parameter names)
    "temperature": (("gen_ai.request.temperature", "llm.request.temperature"), ("temperature",)),
    "top_p": (("gen_ai.request.top_p", "llm.request.top_p"), ("top_p",)),
    "max_tokens": (("gen_ai.request.max_tokens", "llm.request.max_tokens"), ("max_tokens", "max_completion_tokens")),
    "seed": (("gen_ai.request.seed", "gen_ai.openai.request.seed"), ("seed",)),
}
_LLM_OPERATIONS = {"chat", "text_completion", "completion", "generate_content", "responses"}
_KIND_BY_OPERATION = {"execute_tool": "tool", "invoke_agent": "agent", "create_agent": "agent",
                      "embeddings": "embedding"}
_dumps = json.JSONEncoder(default=str).encode  # one encoder: json.dumps(default=...) builds one per call


def first(attrs: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first key present (and not None)."""
    for k in keys:
        v = attrs.get(k)
        if v is not None:
            return v
    return None


def span_kind(name: str, attrs: Mapping[str, Any]) -> str | None:
    """boltstream's coarse span kind: rollout, reward, llm, tool, agent, chain, ... or None if unknown."""
    if name == "boltstream.rollout":
        return "rollout"
    if name == "boltstream.reward":
        return "reward"
    oi = attrs.get("openinference.span.kind")
    if isinstance(oi, str) and oi:
        return oi.lower()
    op = attrs.get("gen_ai.operation.name")
    if isinstance(op, str) and op:
        return "llm" if op in _LLM_OPERATIONS else _KIND_BY_OPERATION.get(op, op)
    tl = attrs.get("traceloop.span.kind")
    if isinstance(tl, str) and tl:
        return tl.lower()
    if isinstance(attrs.get("llm.request.type"), str):
        return "llm"
    if _agl_reward(attrs) is not None:
        return "reward"
    if first(attrs, PROMPT_IDS + RESPONSE_IDS) is not None or VLLM_CHOICES in attrs:
        return "llm"
    return None


def _invocation_params(attrs: Mapping[str, Any]) -> Mapping[str, Any]:
    params = maybe_json(attrs.get("llm.invocation_parameters"))
    return params if isinstance(params, Mapping) else {}


def _finish_reason(attrs: Mapping[str, Any], output_messages: list[dict[str, Any]] | None) -> str | None:
    v = first(attrs, ("gen_ai.response.finish_reasons", "llm.finish_reason", "gen_ai.completion.0.finish_reason"))
    v = maybe_json(v)
    if isinstance(v, list | tuple):
        v = v[0] if v else None
    if isinstance(v, Mapping):  # a wrapped string array from OTLP
        inner = v.get("strings") or []
        v = inner[0] if inner else None
    if isinstance(v, str) and v:
        return v
    for m in output_messages or ():
        if isinstance(m, Mapping) and isinstance(m.get("finish_reason"), str):
            return m["finish_reason"]
    return None


def _vllm_choice_ids(attrs: Mapping[str, Any]) -> list[int] | None:
    choices = maybe_json(attrs.get(VLLM_CHOICES))
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return int_array(choices[0].get("token_ids"))
    return None


def _first_parsed(attrs: Mapping[str, Any], keys: tuple[str, ...], parse: Any) -> Any:
    for k in keys:
        v = attrs.get(k)
        if v is not None:
            parsed = parse(v)
            if parsed is not None:
                return parsed
    return None


_FIELD_KEYS: dict[str, tuple[str, ...]] = {
    "model": MODEL, "input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS,
    **{name: keys for name, (keys, _) in SAMPLING.items()},
    "policy_version": ("boltstream.llm.policy_version",),
}
# attribute name -> (llm field, priority): one dict lookup per attribute instead of ~40 probes per span
_KEY_INDEX: dict[str, tuple[str, int]] = {
    k: (fld, prio) for fld, keys in _FIELD_KEYS.items() for prio, k in enumerate(keys)
}
_CONVERT = {"temperature": as_float, "top_p": as_float, "max_tokens": lambda v: as_int(v, 0, INT32_MAX)}


def llm_block(attrs: Mapping[str, Any], output_messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Span record's typed ``llm`` block (every field present, schema defaults where unknown)."""
    found: dict[str, tuple[int, Any]] = {}
    has_tokens = False
    for k, v in attrs.items():
        spec = _KEY_INDEX.get(k)
        if spec is not None:
            if v is not None and (spec[0] not in found or spec[1] < found[spec[0]][0]):
                found[spec[0]] = (spec[1], v)
        elif k in TOKEN_KEYS or k == VLLM_CHOICES:
            has_tokens = True
    prompt = response = logprobs = None
    if has_tokens:
        prompt = _first_parsed(attrs, PROMPT_IDS, int_array)
        response = _first_parsed(attrs, RESPONSE_IDS, int_array)
        if response is None and VLLM_CHOICES in attrs:
            response = _vllm_choice_ids(attrs)
        logprobs = _first_parsed(attrs, LOGPROBS, float_array)
    params = _invocation_params(attrs) if "llm.invocation_parameters" in attrs else {}
    out: dict[str, Any] = {
        "prompt_token_ids": prompt or [],
        "response_token_ids": response or [],
        "response_logprobs": logprobs or [],
    }
    for fld in ("model", "policy_version", "temperature", "top_p", "max_tokens", "seed"):
        raw = found[fld][1] if fld in found else None
        if raw is None and params:
            raw = next((params[p] for p in SAMPLING[fld][1] if params.get(p) is not None), None) \
                if fld in SAMPLING else params.get(fld)
        if fld == "model":
            out[fld] = raw if isinstance(raw, str) and raw else None
        elif fld == "policy_version":
            v = as_int(raw) if raw is not None else None
            out[fld] = -1 if v is None else v
        else:
            out[fld] = None if raw is None else _CONVERT.get(fld, as_int)(raw)
    out["finish_reason"] = _finish_reason(attrs, output_messages)
    for fld in ("input_tokens", "output_tokens"):
        out[fld] = as_int(found[fld][1]) if fld in found else None
    return out




_BY_HEAD = {"llm.in": "llm.input_messages.", "llm.ou": "llm.output_messages.", "gen_ai": None}


def _indexed_groups(attrs: Mapping[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """``prefix.N.rest`` attributes grouped as {prefix: {N: {rest: value}}}, one pass over the keys."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    by_head = _BY_HEAD
    for k, v in attrs.items():
        head = k[:6]
        if head not in by_head:
            continue  # the common case: one slice and one dict lookup per attribute
        prefix = by_head[head]
        if prefix is None:
            prefix = "gen_ai.prompt." if k.startswith("gen_ai.prompt.") else (
                "gen_ai.completion." if k.startswith("gen_ai.completion.") else None)
            if prefix is None:
                continue
        elif not k.startswith(prefix):
            continue
        idx, _, rest = k[len(prefix):].partition(".")
        if idx.isdigit() and rest:
            groups.setdefault(prefix[:-1], {}).setdefault(int(idx), {})[rest] = v
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


def _message(fields: Mapping[str, Any], openinference: bool) -> tuple[dict[str, Any], list[str]]:
    """One flattened message (legacy GenAI or OpenInference names) -> (semconv message, field names used)."""
    p = "message." if openinference else ""
    used = [k for k in (f"{p}role", f"{p}content", f"{p}tool_call_id", "finish_reason") if k in fields]
    role = fields.get(f"{p}role") or "user"
    parts: list[dict[str, Any]] = []
    content = fields.get(f"{p}content")
    if openinference and content is None:
        texts = []
        for idx, c in sorted(_sub_indexed(fields, "message.contents.").items()):
            if c.get("message_content.type", "text") == "text" and isinstance(c.get("message_content.text"), str):
                texts.append(c["message_content.text"])
                used.extend(f"message.contents.{idx}.{k}" for k in c
                            if k in ("message_content.text", "message_content.type"))
        content = "".join(texts) or None
    call_id = fields.get(f"{p}tool_call_id")
    if role == "tool" and content is not None:
        parts.append({"type": "tool_call_response", "id": call_id, "response": content})
    elif content is not None:
        parts.append({"type": "text", "content": content if isinstance(content, str) else _dumps(content)})
    tc_prefix = f"{p}tool_calls."
    names = _TOOL_CALL_OI if openinference else _TOOL_CALL_LEGACY
    for idx, tc in sorted(_sub_indexed(fields, tc_prefix).items()):
        tid, name, args = (tc.get(k) for k in names)
        parts.append({"type": "tool_call", "id": tid, "name": name, "arguments": _arguments(args)})
        used.extend(f"{tc_prefix}{idx}.{k}" for k in names if k in tc)
    msg: dict[str, Any] = {"role": role, "parts": parts}
    finish = fields.get("finish_reason")
    if isinstance(finish, str):
        msg["finish_reason"] = finish
    return msg, used


_TOOL_CALL_OI = ("tool_call.id", "tool_call.function.name", "tool_call.function.arguments")
_TOOL_CALL_LEGACY = ("id", "name", "arguments")


def messages(attrs: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None,
                                                 list[str]]:
    """(input, output, attribute names consumed): messages in the current semconv shape from any dialect.

    The consumed names are the flattened attributes (``llm.input_messages.0.message.role`` ...)
    whose content is now in the canonical messages; fields we do not understand are not listed.
    """
    cur_in = maybe_json(attrs.get("gen_ai.input.messages"))
    cur_out = maybe_json(attrs.get("gen_ai.output.messages"))
    need_in, need_out = not isinstance(cur_in, list), not isinstance(cur_out, list)
    consumed: list[str] = []
    if not (need_in or need_out):
        return cur_in, cur_out, consumed
    groups = _indexed_groups(attrs)

    def build(current: str, legacy: str) -> list[dict[str, Any]] | None:
        prefix, oi = (current, True) if current in groups else (legacy, False)
        src = groups.get(prefix)
        if not src:
            return None
        out = []
        for idx, fields in sorted(src.items()):
            msg, used = _message(fields, oi)
            out.append(msg)
            consumed.extend(f"{prefix}.{idx}.{k}" for k in used)
        return out

    if need_in:
        cur_in = build("llm.input_messages", "gen_ai.prompt")
    if need_out:
        cur_out = build("llm.output_messages", "gen_ai.completion")
    return cur_in, cur_out, consumed


def _agl_reward(attrs: Mapping[str, Any]) -> tuple[str, float] | None:
    """(name, value) of an Agent Lightning / AgentOps reward carried by these attributes, if any."""
    v = as_float(attrs.get("agentlightning.reward.0.value"))
    if v is not None:
        return as_str(attrs.get("agentlightning.reward.0.name")) or "reward", v
    for key in ("agentlightning.reward.primary", "agentlightning.reward"):
        v = as_float(attrs.get(key))
        if v is not None:
            return "reward", v
    out = maybe_json(attrs.get("agentops.task.output"))
    if isinstance(out, Mapping) and out.get("type") == "reward":
        v = as_float(out.get("value"))
        if v is not None:
            return "reward", v
    return None


def derived_attributes(name: str, attrs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None,
                                                                     list[str]]:
    """(attributes to add, llm block or None, attributes now redundant) for one span's raw attributes.

    Redundant: the flattened message attributes whose content moved into the canonical
    ``gen_ai.input.messages`` / ``gen_ai.output.messages`` JSON (so the record carries it once).
    """
    added: dict[str, Any] = {}
    consumed: list[str] = []
    kind = attrs.get("boltstream.span.kind") or span_kind(name, attrs)
    if kind and "boltstream.span.kind" not in attrs:
        added["boltstream.span.kind"] = kind
    if kind == "reward" and "boltstream.reward.value" not in attrs:
        agl = _agl_reward(attrs)
        if agl is not None:
            added["boltstream.reward.name"], added["boltstream.reward.value"] = agl
            added["boltstream.reward.primary"] = True
    llm = None
    if kind == "llm":
        msgs_in, msgs_out, consumed = messages(attrs)
        if msgs_in is not None and not isinstance(attrs.get("gen_ai.input.messages"), str):
            added["gen_ai.input.messages"] = _dumps(msgs_in)
        if msgs_out is not None and not isinstance(attrs.get("gen_ai.output.messages"), str):
            added["gen_ai.output.messages"] = _dumps(msgs_out)
        llm = llm_block(attrs, msgs_out)
    return added, llm, consumed
