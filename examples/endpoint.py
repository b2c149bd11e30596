"""The OpenAI client an example agent's ``solve(task, ctx)`` talks through: the endpoint and headers the
runner hands it (``ctx.base_url``, ``ctx.headers``: the rollout's ids), no retries (a failed call is the
attempt's failure, not a second sample)."""

from __future__ import annotations

import os
from typing import Any

from openai import OpenAI


def client(ctx: Any) -> OpenAI:
    return OpenAI(base_url=ctx.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"),
                  default_headers=ctx.headers, max_retries=0)


def model_name(default: str = "policy") -> str:
    """The served model the agent asks for (``AGENT_MODEL``; the worker's default name otherwise)."""
    return os.environ.get("AGENT_MODEL", default)


def reply(client: OpenAI, messages: list[dict[str, str]], model: str, temperature: float, max_tokens: int) -> str:
    """One chat completion's text (empty when the model said nothing)."""
    out = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                         max_tokens=max_tokens)
    return out.choices[0].message.content or ""
