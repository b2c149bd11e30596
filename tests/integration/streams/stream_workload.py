"""Synthetic rollouts as the producers would write them, plus an independent reference of their samples.

Why a generator of our own: the stream tests and ``benchmarks/bench_stream.py``
need many rollouts with known answers. Each rollout is a ``boltstream.rollout``
root span, 1-5 LLM spans with token ids and logprobs (what the inference
worker records), a tool span after some calls (some failing: AIR gives the
call before it -0.1), and a final reward span (none for failed rollouts).
Spans are listed in the order they END (children first, the root last), which
is the order the exporter produces them.

:func:`reference_samples` computes what the learner must receive WITHOUT the
pure core, by the closed form for gamma = 1: every call of a rollout gets its
episode return R + sum of its intermediate rewards (``call_credit="episode"``,
the stream app's default), or with ``"return"`` G_t = R + sum of intermediate
rewards at calls >= t; GRPO over the attempts of a task with the sample std
(n - 1) and eps = 1e-6.
"""

from __future__ import annotations

import math
import random
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

TOOL_ERROR_REWARD = -0.1
EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    """The LLM calls of a benchmark rollout: exactly ``calls`` calls of ``prompt`` + ``response`` token
    ids. With ``shared_prefix`` each call's prompt is the previous call's prompt + response + ``inserted``
    new tokens (a multi-turn agent: tool output appended), so prompts grow; without, every call has a
    fresh ``prompt``-token prompt. ``None`` instead of a Shape: the small random rollouts of the tests."""

    calls: int = 5
    prompt: int = 2000
    response: int = 200
    shared_prefix: bool = True
    inserted: int = 50

    def describe(self) -> str:
        share = f", shared prefixes (+{self.inserted} tokens per turn)" if self.shared_prefix else ""
        return f"{self.calls} calls of {self.prompt} prompt + {self.response} response tokens{share}"


def _ids(rng: random.Random, n: int) -> list[int]:
    # Fast enough for millions of ids: two random bytes per id (ids < 65536, a real vocabulary size).
    return array("H", rng.randbytes(2 * n)).tolist()


@dataclass
class Rollout:
    """One generated rollout attempt and what its spans should yield."""

    rollout_id: str
    attempt_id: str
    task_id: str
    spans: list[dict[str, Any]]
    calls: list[tuple[list[int], list[int]]]  # (prompt ids, response ids) per call
    step_rewards: list[float]
    final_reward: float | None
    status: str = "ok"
    root: dict[str, Any] = field(default_factory=dict)


def _span(
    trace_id: str,
    span_id: str,
    name: str,
    parent: str | None,
    start: int,
    end: int,
    ids: tuple[str, str, str],
    *,
    attrs: dict[str, Any] | None = None,
    status: str = "UNSET",
    message: str | None = None,
    llm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rollout_id, attempt_id, task_id = ids
    return {
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_span_id": parent,
        "name": name,
        "kind": "INTERNAL",
        "start_time_ns": start,
        "end_time_ns": end,
        "status": {"code": status, "message": message},
        "attributes": attrs or {},
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "task_id": task_id,
        "llm": llm,
    }


def make_rollout(rng: random.Random, task_id: str, attempt: int, run: str, t0: int = 1_000_000_000,
                 shape: Shape | None = None) -> Rollout:
    """One rollout with 1-5 calls (or as ``shape`` says); about 1 in 5 tools fails and about 1 in 10
    rollouts fails."""
    attempt_id = f"{task_id}:{attempt}"
    rollout_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{run}/{attempt_id}"))
    trace_id = uuid.uuid5(uuid.NAMESPACE_DNS, rollout_id).hex
    ids = (rollout_id, attempt_id, task_id)
    counter = iter(range(1, 1000))

    def sid() -> str:
        return f"{attempt:02x}{next(counter):014x}"

    root_id = sid()
    failed = rng.random() < 0.1
    n_calls = rng.randint(1, 5) if shape is None else shape.calls
    spans: list[dict[str, Any]] = []
    calls: list[tuple[list[int], list[int]]] = []
    steps: list[float] = []
    now = t0
    prompt = [rng.randrange(1, 32000) for _ in range(rng.randint(8, 24))] if shape is None else _ids(rng, shape.prompt)
    for _ in range(n_calls):
        if shape is None:
            response = [rng.randrange(1, 32000) for _ in range(rng.randint(4, 16))]
        else:
            response = _ids(rng, shape.response)
        llm = {
            "prompt_token_ids": list(prompt),
            "response_token_ids": response,
            "response_logprobs": [round(-rng.random(), 3) for _ in response],
            "model": "synthetic",
            "policy_version": 0,
        }
        spans.append(_span(trace_id, sid(), "chat synthetic", root_id, now + 10, now + 1000, ids, llm=llm))
        calls.append((list(prompt), response))
        steps.append(0.0)
        now += 1000
        tool_fails = rng.random() < 0.2
        if rng.random() < 0.7 or tool_fails:
            attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calc"}
            spans.append(
                _span(trace_id, sid(), "execute_tool calc", root_id, now + 10, now + 500, ids, attrs=attrs,
                      status="ERROR" if tool_fails else "OK", message="boom" if tool_fails else None)
            )
            if tool_fails:
                steps[-1] += TOOL_ERROR_REWARD
            now += 500
        if shape is None:
            prompt = prompt + response + [rng.randrange(1, 32000) for _ in range(3)]
        elif shape.shared_prefix:
            prompt = prompt + response + _ids(rng, shape.inserted)
        else:
            prompt = _ids(rng, shape.prompt)
    final: float | None = None
    if not failed:
        final = rng.choice([0.0, 0.25, 0.5, 1.0])
        attrs = {"boltstream.reward.name": "reward", "boltstream.reward.value": final,
                 "boltstream.reward.final": True, "boltstream.reward.primary": True}
        spans.append(_span(trace_id, sid(), "boltstream.reward", root_id, now + 10, now + 10, ids, attrs=attrs))
    status = "failed" if failed else "ok"
    root_attrs = {"boltstream.rollout_id": rollout_id, "boltstream.attempt_id": attempt_id,
                  "boltstream.task_id": task_id, "boltstream.status": status}
    root = _span(trace_id, root_id, "boltstream.rollout", None, t0, now + 100, ids, attrs=root_attrs,
                 status="ERROR" if failed else "OK", message="agent raised" if failed else None)
    spans.append(root)
    return Rollout(rollout_id, attempt_id, task_id, spans, calls, steps, final, status, root)


def make_workload(tasks: int, group_size: int = 4, seed: int = 7, run: str = "run",
                  shape: Shape | None = None) -> list[Rollout]:
    """``tasks`` x ``group_size`` rollouts, deterministic for a seed (and shape)."""
    rng = random.Random(seed)
    return [
        make_rollout(rng, f"task-{run}-{t:04d}", a, run, shape=shape)
        for t in range(tasks)
        for a in range(group_size)
    ]


def reference_samples(rollouts: list[Rollout], std_normalize: bool = False,
                      call_credit: str = "episode") -> dict[str, dict[str, Any]]:
    """sample_id -> {advantage, token_ids, reward} by the gamma = 1 closed form (no pure core).

    Advantage = G - group mean (the stream app's default), divided by the group's sample std
    with ``std_normalize`` (plain GRPO); G is the rollout's episode return, or with
    ``call_credit="return"`` the call's own return."""
    by_task: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_task.setdefault(r.task_id, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for group in by_task.values():
        episode = [(r.final_reward or 0.0) + sum(r.step_rewards) for r in group]
        n = len(episode)
        mean = sum(episode) / n
        std = math.sqrt(sum((g - mean) ** 2 for g in episode) / (n - 1)) if n > 1 else 0.0
        for r, g_0 in zip(group, episode, strict=True):
            for t, (prompt, response) in enumerate(r.calls):
                g = (r.final_reward or 0.0) + sum(r.step_rewards[t:]) if call_credit == "return" else g_0
                out[f"{r.attempt_id}:{t}"] = {
                    "advantage": (g - mean) / (std + EPS) if std_normalize else g - mean,
                    "reward": g,
                    "token_ids": prompt + response,
                    "rollout_id": r.rollout_id,
                }
    return out


def encoded_spans(codec: Any, topic: str, rollouts: list[Rollout]) -> list[tuple[bytes, bytes]]:
    """(key, value) records for the spans topic: keyed by rollout id, each rollout's spans in end order."""
    return [(r.rollout_id.encode(), codec.encode("Span", s, topic=topic)) for r in rollouts for s in r.spans]


def interleaved_spans(codec: Any, topic: str, rollouts: list[Rollout], width: int) -> list[tuple[bytes, bytes]]:
    """Like :func:`encoded_spans`, but ``width`` rollouts run at once: their spans alternate in the log.

    Each rollout's own spans keep their order (its root span last), as many
    concurrent agents sharing one exporter would produce them.
    """
    out: list[tuple[bytes, bytes]] = []
    for start in range(0, len(rollouts), width):
        window = [list(encoded_spans(codec, topic, [r])) for r in rollouts[start : start + width]]
        while any(window):
            for records in window:
                if records:
                    out.append(records.pop(0))
    return out
