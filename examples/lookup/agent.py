"""A retrieve-then-answer agent written with the plain ``openai`` SDK, over the corpus in
:mod:`.corpus`.

The model writes ``LOOKUP: <island>``, the agent answers with the corpus entry (traced as an
OpenTelemetry tool span, status ERROR when there is no such island), then the model writes
``ANSWER: <value>``. Nothing here depends on boltstream: :func:`run_agent` runs against any
OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import OpenAI
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from .. import endpoint
from .corpus import entry

tracer = trace.get_tracer("examples.lookup")

SYSTEM = ("You answer questions about islands with a lookup tool. First write one line 'LOOKUP: <island>'. "
          "You will receive the island's entry. Then write 'ANSWER: <value>'.")
# One worked example, about an island that is not in the corpus.
EXAMPLE = [
    {"role": "user", "content": "What is the main export of the island of Pelora?"},
    {"role": "assistant", "content": "LOOKUP: Pelora"},
    {"role": "user", "content": "Pelora is an island. Its capital is Vintaro. Its main export is marble."},
    {"role": "assistant", "content": "ANSWER: marble"},
]
TEMPERATURE = 1.0
LOOKUP_RE = re.compile(r"LOOKUP:\s*([A-Za-z]+)")
ANSWER_RE = re.compile(r"ANSWER:\s*([A-Za-z]+)")


def lookup(name: str) -> str:
    with tracer.start_as_current_span("execute_tool lookup") as span:
        span.set_attribute("gen_ai.operation.name", "execute_tool")
        span.set_attribute("gen_ai.tool.name", "lookup")
        span.set_attribute("gen_ai.tool.call.arguments", json.dumps({"island": name}))
        found = entry(name)
        if found is None:
            span.set_status(Status(StatusCode.ERROR, f"no island named {name!r}"))
            return f"ERROR: no island named {name}"
        span.set_attribute("gen_ai.tool.call.result", found)
        return found


def run_agent(client: OpenAI, question: str, model: str = "policy", max_turns: int = 3) -> str | None:
    """Talk to the model until it answers; returns the answer or None."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, temperature=TEMPERATURE,
                                               max_tokens=16, stop=["\n"])
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answer = ANSWER_RE.search(text)
        if answer:
            return answer.group(1)
        asked = LOOKUP_RE.search(text)
        if not asked:
            return None
        messages.append({"role": "user", "content": lookup(asked.group(1))})
    return None


def reward(task: dict[str, Any], answer: str | None) -> float:
    return float(answer is not None and answer.strip().lower() == task["answer"].lower())


def solve(task: dict[str, Any], ctx: Any) -> float:
    """Entry point for ``boltstream train --agent boltstream.examples.lookup.agent:solve``."""
    return reward(task, run_agent(endpoint.client(ctx), task["question"], endpoint.model_name()))
