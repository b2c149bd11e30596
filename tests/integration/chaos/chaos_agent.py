"""The agent of the chaos runner's agent-path scenarios, run by ``boltstream runner --agent <this file>:agent``.

It is what a user writes: the plain ``openai`` SDK against the inference worker, the rollout's
headers as ``default_headers``, a number returned as the reward; the runner's exporter (env vars
only) carries its spans. Each task says how many LLM calls to make (``calls``); a think time before
each call keeps the load steady and spread over the runner's workers. A call the worker cannot answer
(it was killed mid-request, it is restarting) is tried again, as an agent with a retrying client
would, until ``CHAOS_AGENT_RETRY_S``. Every call start, answer and retry is appended to
``CHAOS_AGENT_LOG`` (one short O_APPEND write per line) so the scenario can see what was in flight.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import openai

MODEL = "policy"
THINK_S = float(os.environ.get("CHAOS_AGENT_THINK_S", "0.8"))
RETRY_S = float(os.environ.get("CHAOS_AGENT_RETRY_S", "120"))
MAX_TOKENS = 12


def _log(ctx: Any, call: int, event: str, **extra: Any) -> None:
    line = json.dumps({"attempt_id": ctx.attempt_id, "call": call, "event": event, "pid": os.getpid(),
                       "t": time.time(), **extra})
    with open(os.environ["CHAOS_AGENT_LOG"], "a") as fh:
        fh.write(line + "\n")


def _complete(client: openai.OpenAI, ctx: Any, call: int, prompt: str) -> str:
    deadline = time.monotonic() + RETRY_S
    while True:
        _log(ctx, call, "start")
        try:
            out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=MAX_TOKENS, temperature=1.0)
        except (openai.APIConnectionError, openai.InternalServerError) as exc:
            _log(ctx, call, "retry", error=type(exc).__name__)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # the agent's own back-off before it tries again
            continue
        _log(ctx, call, "ok", completion_id=out.id)
        return out.choices[0].message.content or ""


def agent(task: dict[str, Any], ctx: Any) -> float:
    client = openai.OpenAI(base_url=ctx.base_url, api_key="unused", default_headers=ctx.headers, max_retries=0,
                           timeout=30.0)
    text = f"task {task['id']}"
    for call in range(int(task["calls"])):
        time.sleep(THINK_S)  # think time: the steady pace of the load
        text = _complete(client, ctx, call, f"{text} / step {call}")[:200]
    return float(ctx.attempt % 2)  # two rewards per group: every sample has a non-zero advantage
