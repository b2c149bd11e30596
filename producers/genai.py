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
  (which of these makes a span an LLM call, a tool, an agent is decided in
  :mod:`boltstream.schemas.genai_semantics`, shared with the stream app);
* Agent Lightning (``prompt_token_ids`` / ``response_token_ids``, also as
  ``llm.hosted_vllm.*`` Python-repr strings, ``agentlightning.reward.N.value``
  and ``.name`` on ``agentlightning.annotation`` spans, AgentOps'
  ``agentops.task.output`` reward JSON) and boltstream's own ``boltstream.llm.*``.

Everything here is a pure function of an attribute mapping. The result is
additive: derived attributes (``boltstream.span.kind``, canonical
``gen_ai.input.messages`` / ``gen_ai.output.messages`` JSON,
``boltstream.reward.*``) are added only when absent; the original attributes
stay, except token-id arrays, which move into the typed ``llm`` block.
Flattened messages are rebuilt by :mod:`boltstream.producers.messages`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from boltstream.schemas import genai_semantics
from boltstream.schemas.records import REWARD_NAME, REWARD_PRIMARY, REWARD_VALUE, SPAN_KIND

from .attributes import (
    INT32_MAX,
    as_float,
    as_int,
    as_str,
    float_array,
    int_array,
    maybe_json,
)
from .messages import dumps, messages

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


def first(attrs: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first key present (and not None)."""
    for k in keys:
        v = attrs.get(k)
        if v is not None:
            return v
    return None


def raw_span_kind(name: str, attrs: Mapping[str, Any]) -> str | None:
    """The kind :func:`~boltstream.schemas.genai_semantics.span_kind` gives, else what only raw
    attributes show (the normaliser moves them, so the stream app never sees them): an Agent
    Lightning / AgentOps reward is a reward, token ids make an LLM call."""
    kind = genai_semantics.span_kind(name, attrs)
    if kind is not None:
        return kind
    if _agl_reward(attrs) is not None:
        return genai_semantics.REWARD
    if first(attrs, PROMPT_IDS + RESPONSE_IDS) is not None or VLLM_CHOICES in attrs:
        return genai_semantics.LLM
    return None


_PARAMS_CACHE: dict[str, Mapping[str, Any]] = {}


def _invocation_params(attrs: Mapping[str, Any]) -> Mapping[str, Any]:
    """``llm.invocation_parameters`` as a mapping. An agent sends the same few JSON strings on every
    call, so parses are cached by the string (results are only read, never handed out)."""
    raw = attrs.get("llm.invocation_parameters")
    if type(raw) is str and len(raw) <= 4096:
        hit = _PARAMS_CACHE.get(raw)
        if hit is None:
            parsed = maybe_json(raw)
            hit = parsed if isinstance(parsed, Mapping) else {}
            if len(_PARAMS_CACHE) >= 1024:
                _PARAMS_CACHE.clear()
            _PARAMS_CACHE[raw] = hit
        return hit
    params = maybe_json(raw)
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
# llm field -> names to look for in the invocation parameters, in the block's field order
_PARAM_NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model",)), ("policy_version", ("policy_version",)),
    *((name, params) for name, (_, params) in SAMPLING.items()),
)
_TOKEN_OR_CHOICES = TOKEN_KEYS | {VLLM_CHOICES}


def _max_tokens(v: Any) -> int | None:
    return as_int(v, 0, INT32_MAX)


_CONVERT = {"model": lambda v: v if isinstance(v, str) and v else None, "temperature": as_float,
            "top_p": as_float, "max_tokens": _max_tokens, "seed": as_int}


def llm_block(attrs: Mapping[str, Any], output_messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Span record's typed ``llm`` block (every field present, schema defaults where unknown)."""
    found: dict[str, tuple[int, Any]] = {}
    has_tokens = False
    index = _KEY_INDEX
    for k, v in attrs.items():
        spec = index.get(k)
        if spec is not None:
            if v is not None:
                prev = found.get(spec[0])
                if prev is None or spec[1] < prev[0]:
                    found[spec[0]] = (spec[1], v)
        elif k in _TOKEN_OR_CHOICES:
            has_tokens = True
    prompt = response = logprobs = None
    if has_tokens:
        prompt = _first_parsed(attrs, PROMPT_IDS, int_array)
        response = _first_parsed(attrs, RESPONSE_IDS, int_array)
        if response is None and VLLM_CHOICES in attrs:
            response = _vllm_choice_ids(attrs)
        logprobs = _first_parsed(attrs, LOGPROBS, float_array)
    params = _invocation_params(attrs) if "llm.invocation_parameters" in attrs else None
    out: dict[str, Any] = {
        "prompt_token_ids": prompt or [],
        "response_token_ids": response or [],
        "response_logprobs": logprobs or [],
    }
    for fld, names in _PARAM_NAMES:
        hit = found.get(fld)
        raw = hit[1] if hit is not None else None
        if raw is None and params:
            for name in names:
                raw = params.get(name)
                if raw is not None:
                    break
        if fld == "policy_version":
            v = None if raw is None else as_int(raw)
            out[fld] = -1 if v is None else v
        else:
            out[fld] = None if raw is None else _CONVERT[fld](raw)
    out["finish_reason"] = _finish_reason(attrs, output_messages)
    for fld in ("input_tokens", "output_tokens"):
        hit = found.get(fld)
        out[fld] = None if hit is None else as_int(hit[1])
    return out


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
    kind = raw_span_kind(name, attrs)
    if kind and SPAN_KIND not in attrs:
        added[SPAN_KIND] = kind
    if kind == "reward" and REWARD_VALUE not in attrs:
        agl = _agl_reward(attrs)
        if agl is not None:
            added[REWARD_NAME], added[REWARD_VALUE] = agl
            added[REWARD_PRIMARY] = True
    llm = None
    if kind == "llm":
        msgs_in, msgs_out, consumed = messages(attrs)
        if msgs_in is not None and not isinstance(attrs.get("gen_ai.input.messages"), str):
            added["gen_ai.input.messages"] = dumps(msgs_in)
        if msgs_out is not None and not isinstance(attrs.get("gen_ai.output.messages"), str):
            added["gen_ai.output.messages"] = dumps(msgs_out)
        llm = llm_block(attrs, msgs_out)
    return added, llm, consumed
