"""Baselines for traffic without task groups: prompt-fingerprint groups, else a per-agent running mean.

Why: GRPO's baseline is the mean return of the other attempts at the same task.
Production traffic and runnerless agents name no task, so there is no group.
Two fall-backs, in this order (docs/zero-code.md, "Which baseline applies"):

1. **Prompt fingerprint.** Trajectories whose first call had the same prompt
   token ids (same system prompt and first user message under the same chat
   template) ARE attempts at the same task: they are grouped under the key
   ``"prompt:<16 hex>"`` within a window (``prompt_window_s``) and get the
   ordinary group baseline when at least two arrive.
2. **Per-agent running mean.** A fingerprint group of one has no peers: its
   baseline is the mean (and sample std) of the last ``baseline_window``
   returns of trajectories of the same agent, the trajectory itself excluded
   (leave-one-out, as RLOO), so a return is never compared with itself. With no
   history yet the baseline is the return itself: advantage 0, nothing learned
   rather than a guess.

Why this default: a repeated prompt is the only evidence of "the same task" in
traffic, and a per-task baseline removes prompt difficulty from the advantage,
which a per-agent mean cannot; the running mean only keeps singletons from
being wasted. The window state lives in the group stage's memory: after a
restart the history starts empty (advantages are 0 until it refills).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

PROMPT_PREFIX = "prompt:"
NO_AGENT = ""


def prompt_fingerprint(trajectory: Mapping[str, Any]) -> str | None:
    """16 hex digits of sha1 over the first turn's prompt token ids; None for a trajectory without turns."""
    turns = trajectory.get("turns") or []
    if not turns:
        return None
    tokens = ",".join(map(str, turns[0]["prompt_token_ids"]))
    return hashlib.sha1(tokens.encode("ascii")).hexdigest()[:16]


def partition_key(trajectory: Mapping[str, Any]) -> str:
    """The ``trajectories`` topic key: the task id, else ``"prompt:<fingerprint>"`` (``"prompt:"`` without turns)."""
    if trajectory["task_id"]:
        return str(trajectory["task_id"])
    return PROMPT_PREFIX + (prompt_fingerprint(trajectory) or "")


def agent_of(trajectory: Mapping[str, Any]) -> str:
    """The agent a trajectory's baseline is kept for: its first trained turn's agent name ("" when unnamed)."""
    turns = trajectory.get("turns") or []
    return (turns[0].get("agent_name") or NO_AGENT) if turns else NO_AGENT


def window_baseline(history: Sequence[float], own_return: float) -> tuple[float, float]:
    """(mean, sample std) of ``history``; ``(own_return, 0.0)`` when it is empty (advantage 0)."""
    if not history:
        return own_return, 0.0
    mean = math.fsum(history) / len(history)
    if len(history) < 2:
        return mean, 0.0
    var = math.fsum((g - mean) ** 2 for g in history) / (len(history) - 1)
    return mean, math.sqrt(var)


class AgentBaselines:
    """Recent episode returns per agent, a bounded window each (the group stage's in-memory state)."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"baseline window: must be >= 1, got {window}")
        self.window = window
        self.returns: dict[str, deque[float]] = {}

    def baseline(self, agent: str, own_return: float) -> tuple[float, float]:
        """The baseline for a new return of ``agent`` (its own return not yet in the history)."""
        return window_baseline(tuple(self.returns.get(agent, ())), own_return)

    def add(self, agent: str, episode_return: float) -> None:
        self.returns.setdefault(agent, deque(maxlen=self.window)).append(float(episode_return))
