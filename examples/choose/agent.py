"""A single-call choice agent written with the plain ``openai`` SDK: a comparison, a question and three
options in, ``{"answer": "<name>"}`` out.

Nothing here depends on boltstream: :func:`choose` runs against any OpenAI-compatible endpoint.
:func:`messages` and :func:`reward` are what a trainer needs besides the endpoint (the agent suite
hands the same two to TRL).
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import OpenAI

from .. import endpoint

SYSTEM = 'Answer the question with one of the options. Reply with one line of JSON: {"answer": "<option>"}.'
# One worked example (names the tasks never use): enough for the model to follow the format on most tasks.
EXAMPLE = [
    {"role": "user", "content": "Zed is shorter than Quin. Who is taller? Options: Ivo, Zed, Quin."},
    {"role": "assistant", "content": '{"answer": "Quin"}'},
]
TEMPERATURE = 1.0
MAX_TOKENS = 24
JSON_RE = re.compile(r"\{.*?\}", re.S)


def messages(task: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE,
            {"role": "user", "content": f"{task['question']} Options: {', '.join(task['options'])}."}]


def reward(task: dict[str, Any], text: str) -> float:
    """1 when the reply's JSON names the right option, else 0."""
    found = JSON_RE.search(text or "")
    try:
        got = json.loads(found.group(0)) if found else None
    except ValueError:
        return 0.0
    return float(isinstance(got, dict) and str(got.get("answer", "")).strip() == task["answer"])


def choose(client: OpenAI, task: dict[str, Any], model: str = "policy") -> str:
    return endpoint.reply(client, messages(task), model, TEMPERATURE, MAX_TOKENS)


def solve(task: dict[str, Any], ctx: Any) -> float:
    """Entry point for ``boltstream train --agent boltstream.examples.choose.agent:solve``."""
    return reward(task, choose(endpoint.client(ctx), task, endpoint.model_name()))
