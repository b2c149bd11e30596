"""OpenAI request validation and response shapes for /v1/chat/completions and /v1/completions.

Errors are OpenAI-style: every bad request gets ``{"error": {message, type,
param, code}}`` and a 4xx, which agents' OpenAI clients turn into typed
exceptions (BadRequestError, NotFoundError, ...).

Why strict validation: an RL worker must never silently ignore a parameter
that changes the sampling distribution (penalties, logit bias, top-k
alternatives): the recorded logprobs would no longer describe what was
sampled. Such parameters are refused with a 400 naming them; parameters that
do not affect sampling (user, metadata, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from boltstream.inference.backend import SamplingParams, cut_at_stop

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class ApiError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


MAX_N = 16
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (0), as vLLM does; the span records 0 then
MAX_STOP = 4
# Parameters that would change the sampling distribution, with the only value accepted (their no-op).
_NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "top_k": (-1, 0),
            "min_p": (0,)}


@dataclass
class ParsedRequest:
    """One validated completion request."""

    kind: str  # "chat" | "completion"
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    messages: list[Any] | None = None
    prompt_text: list[str] = field(default_factory=list)
    adapter: str | None = None  # the named adapter that answers (None: a worker without adapters)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"could not parse the JSON body of the request: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v > hi or v < lo or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be a number in {bound}, got {v!r}", param=name, code="invalid_value")
    return float(v)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be an integer {rng}, got {v!r}", param=name, code="invalid_value")
    return v


def check_model(body: Mapping[str, Any], served: tuple[str, ...], strict: bool = True) -> str:
    """The request's ``model``; with ``strict``, one of ``served`` (else 404 ``model_not_found``)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    if strict and model not in served:
        raise ApiError(404, f"The model '{model}' does not exist; this worker serves {', '.join(served)}",
                       param="model", code="model_not_found")
    return model


def parse_sampling(body: Mapping[str, Any], prompt_lens: list[int], max_context: int, default_max: int) -> SamplingParams:
    """Sampling parameters, with the context-length check OpenAI servers do."""
    for name, neutral in _NEUTRAL.items():
        if body.get(name) is not None and body.get(name) not in neutral:
            raise ApiError(400, f"'{name}' is not supported by this worker", param=name, code="unsupported_parameter")
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by this worker", param="logit_bias",
                       code="unsupported_parameter")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature < GREEDY_BELOW:  # logits / 5e-324 is inf in float32: sampling would fail the whole batch
        temperature = 0.0
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    n = _int(body, "n", 1, MAX_N) or 1
    seed = _int(body, "seed", -(2**63))
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, f"'stop' must be a string or up to {MAX_STOP} non-empty strings", param="stop",
                       code="invalid_value")
    longest = max(prompt_lens)
    param = "messages" if "messages" in body else "prompt"
    if longest >= max_context:
        raise ApiError(400, f"This model's maximum context length is {max_context} tokens; the prompt has "
                       f"{longest}.", param=param, code="context_length_exceeded")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    if max_tokens is not None and longest + max_tokens > max_context:
        raise ApiError(400, f"This model's maximum context length is {max_context} tokens; you requested "
                       f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} to generate).",
                       param="max_tokens", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default_max, max_context - longest)
    return SamplingParams(temperature, top_p, max_tokens, stops, seed, n)


def parse_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_value")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_value")
    return bool(stream), bool(opts.get("include_usage"))


def parse_logprobs(body: Mapping[str, Any], kind: str) -> bool:
    """Whether to return the sampled tokens' logprobs; top-k alternatives are not offered."""
    if kind == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise ApiError(400, "'logprobs' must be a boolean", param="logprobs", code="invalid_value")
        if _int(body, "top_logprobs", 0, 20):
            raise ApiError(400, "'top_logprobs' > 0 is not supported", param="top_logprobs",
                           code="unsupported_parameter")
        return bool(lp)
    lp = _int(body, "logprobs", 0, 5)
    if lp:
        raise ApiError(400, "'logprobs' > 0 (top alternatives) is not supported; use 0", param="logprobs",
                       code="unsupported_parameter")
    return lp == 0


def parse_prompts(body: Mapping[str, Any], tokenizer: Any) -> tuple[list[list[int]], list[str]]:
    """/v1/completions ``prompt``: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    ids: list[list[int]] = []
    texts: list[str] = []
    for p in items:
        if isinstance(p, str) and p:
            ids.append(list(tokenizer.encode(p, add_special_tokens=False)))
            texts.append(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if min(p) < 0 or max(p) >= len(tokenizer):
                raise ApiError(400, "'prompt' holds token ids outside the vocabulary", param="prompt",
                               code="invalid_value")
            ids.append(list(p))
            texts.append(tokenizer.decode(p))
        else:
            raise ApiError(400, "'prompt' must be a non-empty string, token ids, or a list of those",
                           param="prompt", code="invalid_value")
    if len(ids) * (_int(body, "n", 1, MAX_N) or 1) > MAX_N * 4:
        raise ApiError(400, "too many prompts x n in one request", param="prompt", code="invalid_value")
    return ids, texts


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, logprobs, strict=True):
        tok = tokenizer.decode([t])
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


def completion_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def envelope(kind: str, rid: str, model: str, version: int, chunk: bool = False) -> dict[str, Any]:
    obj = {"chat": "chat.completion", "completion": "text_completion"}[kind]
    return {"id": rid, "object": obj + (".chunk" if chunk and kind == "chat" else ""), "created": int(time.time()),
            "model": model, "system_fingerprint": f"boltstream-v{version}"}


class TextStream:
    """Incremental text of one streamed choice whose concatenated deltas equal the final text.

    Holds back an incomplete UTF-8 character (decodes to U+FFFD) and the last
    ``len(longest stop) - 1`` characters, so text that turns out to start a
    stop string is never sent.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        text, _ = cut_at_stop(text, self.stops)
        safe = text[: len(text) - self.hold] if self.hold else text
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final_text: str) -> str:
        delta = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return delta
