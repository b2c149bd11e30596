"""The calculator agent as a program of its own: no runner, no boltstream API, rewards sent back later.

    OTEL_TRACES_EXPORTER=boltstream opentelemetry-instrument \\
        python -m boltstream.examples.calc.standalone --tasks train.jsonl --base-url http://127.0.0.1:8000/v1

What a deployed agent looks like to boltstream (docs/zero-code.md): it answers questions, here
the training tasks, each ``--attempts`` times, and learns which answers were right only
afterwards. Each attempt runs inside one OpenTelemetry span, so its calls share a trace; the
stream app keys the rollout by that trace and closes it when the span ends. The reward goes back
as delayed feedback by the last chat completion's ``id`` (``POST <base-url>/feedback``), which
is all a thumbs-up button would know. Attempts at one question have the same first prompt, so
the stream app groups them by its fingerprint. Nothing here names a rollout, a task or a group,
and the only thing imported from boltstream is the example's plain-openai agent logic.

``--tasks-per-version N`` paces the program to the policy the worker serves (its public
``/health``), as ``boltstream runner --tasks-per-version`` does: on 2 cores, rollouts the
learner would drop as stale cost as much as useful ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from opentelemetry import trace

from boltstream.examples.calc.agent import reward, run_agent

log = logging.getLogger(__name__)
tracer = trace.get_tracer("examples.calc.standalone")


class LastCompletion:
    """The openai client's ``chat.completions`` that remembers the id of the last answer it got."""

    def __init__(self, client: OpenAI) -> None:
        self._create = client.chat.completions.create
        self.chat = self.completions = self
        self.id: str | None = None

    def create(self, **kwargs: Any) -> Any:
        reply = self._create(**kwargs)
        self.id = reply.id
        return reply


def attempt(base_url: str, task: dict[str, Any], model: str, temperature: float) -> float:
    """One attempt at a task, then its reward sent as feedback for the attempt's last completion."""
    with httpx.Client(timeout=120.0) as http:
        client = LastCompletion(OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http))
        with tracer.start_as_current_span("calc.attempt"):
            answer = run_agent(client, task["question"], model=model, temperature=temperature)  # type: ignore[arg-type]
        value = reward(answer, task["answer"])
        if client.id is not None:
            r = http.post(f"{base_url}/feedback", json={"completion_id": client.id, "reward": value})
            if r.status_code != 202:
                log.warning("feedback for %s refused: %s %s", client.id, r.status_code, r.text[:300])
    return value


def policy_version(base_url: str) -> int:
    try:
        health = httpx.get(base_url.rsplit("/v1", 1)[0] + "/health", timeout=5.0).json()
        return int(health.get("policy_version") or 0)
    except (httpx.HTTPError, ValueError, TypeError):
        return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=Path, required=True, help="JSONL of {question, answer}")
    p.add_argument("--base-url", required=True, help="the inference worker's OpenAI base URL")
    p.add_argument("--model", default="policy")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--attempts", type=int, default=4, help="tries per question")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tasks-per-version", type=int, default=None,
                   help="start at most N questions per policy version the worker serves")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    first_version = policy_version(args.base_url)
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = []
        for i, task in enumerate(tasks):
            while args.tasks_per_version and i >= (policy_version(args.base_url) - first_version + 1) * args.tasks_per_version:
                time.sleep(0.5)  # pacing to the learner, not synchronisation
            futures += [pool.submit(attempt, args.base_url, task, args.model, args.temperature)
                        for _ in range(args.attempts)]
        rewards = [f.result() for f in futures]
    log.info("%d attempts, mean reward %.3f", len(rewards), sum(rewards) / max(1, len(rewards)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
