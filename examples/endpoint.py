"""The OpenAI client an example agent's ``solve(task, ctx)`` talks through: the endpoint and headers the
runner hands it (``ctx.base_url``, ``ctx.headers``: the rollout's ids), no retries (a failed call is the
attempt's failure, not a second sample)."""

from __future__ import annotations

import os
import threading
from typing import Any

from openai import OpenAI

_shared: dict[tuple[str, str], OpenAI] = {}
_shared_lock = threading.Lock()


def shared_client(base_url: str, api_key: str) -> OpenAI:
    """One client per endpoint, its connection pool shared by every rollout's thread (httpx's client is
    thread-safe). Why: a new ``OpenAI()`` builds a TLS context, ~70 ms of CPU on a slow core even for
    plain http, and a step's 32 rollouts starting at once paid it in turn before their first call."""
    with _shared_lock:  # built once even when every rollout of a step asks at the same moment
        if (base_url, api_key) not in _shared:
            _shared[base_url, api_key] = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        return _shared[base_url, api_key]


def client(ctx: Any) -> OpenAI:
    """The shared client with this rollout's headers (``with_options`` keeps the shared pool: 0.2 ms)."""
    base = shared_client(ctx.base_url, os.environ.get("OPENAI_API_KEY", "unused"))
    return base.with_options(default_headers=ctx.headers)


def model_name(default: str = "policy") -> str:
    """The served model the agent asks for (``AGENT_MODEL``; the worker's default name otherwise)."""
    return os.environ.get("AGENT_MODEL", default)


def reply(client: OpenAI, messages: list[dict[str, str]], model: str, temperature: float, max_tokens: int) -> str:
    """One chat completion's text (empty when the model said nothing)."""
    out = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                         max_tokens=max_tokens)
    return out.choices[0].message.content or ""
