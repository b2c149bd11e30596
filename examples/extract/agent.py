"""A single-call extraction agent written with the plain ``openai`` SDK: one sentence in, one JSON
object with four fields out.

Nothing here depends on boltstream: :func:`extract` runs against any OpenAI-compatible endpoint.
:func:`messages` and :func:`reward` are what a trainer needs besides the endpoint (the agent suite
hands the same two to TRL).
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import OpenAI

from .. import endpoint
from .tasks import FIELDS

SYSTEM = ("Extract the person's details from the sentence. Reply with one line of JSON with the keys "
          "name, age, city and job, and nothing else.")
# One worked example (a person and a job the tasks never use).
EXAMPLE = [
    {"role": "user", "content": "Bo Yang, a 52-year-old tailor, lives in Riga."},
    {"role": "assistant", "content": '{"name": "Bo Yang", "age": 52, "city": "Riga", "job": "tailor"}'},
]
TEMPERATURE = 1.0
MAX_TOKENS = 48
JSON_RE = re.compile(r"\{.*\}", re.S)


def messages(task: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": task["sentence"]}]


def reward(task: dict[str, Any], text: str) -> float:
    """The share of the four fields the reply got right (0 when it holds no JSON object)."""
    found = JSON_RE.search(text or "")
    try:
        got = json.loads(found.group(0)) if found else None
    except ValueError:
        got = None
    if not isinstance(got, dict):
        return 0.0
    expected = task["expected"]
    return sum(str(got.get(k, "")).strip().lower() == str(expected[k]).lower() for k in FIELDS) / len(FIELDS)


def extract(client: OpenAI, task: dict[str, Any], model: str = "policy") -> str:
    return endpoint.reply(client, messages(task), model, TEMPERATURE, MAX_TOKENS)


def solve(task: dict[str, Any], ctx: Any) -> float:
    """Entry point for ``boltstream train --agent boltstream.examples.extract.agent:solve``."""
    return reward(task, extract(endpoint.client(ctx), task, endpoint.model_name()))
