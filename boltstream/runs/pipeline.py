"""Run the whole loop for one agent: workers, stream app, learner, runners, evaluation.

Every component runs as its own ``boltstream ...`` process, exactly as a user
would run them by hand or in docker compose, so the demo exercises the real
topics, the real checkpoint path and the real reload. This module holds what a run
needs besides starting and stopping them (:mod:`boltstream.processes` does that):
evaluation, the components' environment, reading their outputs; no training logic.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boltstream.config import Settings
from boltstream.errors import BoltstreamError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """One training run of one agent."""

    agent: str
    train: Path
    test: Path
    out: Path
    model: str = "smollm2"
    lora: bool = True
    # Every linear layer of the decoder (attention and MLP), as in the reference loop: with it at
    # lr 1e-3 a bare loop lifted the calculator's held-out accuracy 0.25 -> 0.66 in 8 steps (docs/learner.md).
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    group_size: int = 4
    groups_per_step: int = 4
    steps: int = 8
    time_budget_s: float = 840.0
    runner_workers: int = 8
    eval_samples: int = 2
    eval_tasks: int | None = None
    lr: float = 2e-4
    # Linear ramp to lr over the first N learner steps. Adam's first update moves every weight by ~lr
    # whatever the gradient: at a full 1e-3, one step on 16 rollouts broke the calculator's CALC format
    # (a seed-0 demo run, training reward 0.53 -> 0.00).
    lr_warmup_steps: int = 3
    # KL penalty to the base model (with LoRA the base is the reference, no second copy): holds skills
    # whose groups are all-correct (zero advantage) in place while other groups move the policy.
    kl_coef: float = 0.0
    # The agent's sampling temperature: the learner must score tokens under the same
    # distribution the worker sampled from (log_softmax(logits / T)), or the PPO
    # ratio is off even on-policy.
    temperature: float = 0.7
    agent_match: str | None = None
    air_rules: Path | None = None
    # "return": a call's advantage from its own return G_t; "episode": every call of a rollout
    # shares the rollout's advantage (steadier when intermediate rewards are small; streams/credit.py).
    call_credit: str = "return"
    # False: advantage = return - group mean (Dr. GRPO). Dividing by the group's std blows a
    # group whose returns differ only by an intermediate reward up to the size of a right/wrong split:
    # paired bare loops (seed 0, 12 steps) went 0.20 -> 0.17 held-out with it, 0.20 -> 0.44 without.
    std_normalize: bool = False
    # Runner pacing: at most this many tasks per served policy version (None: run ahead freely).
    # groups_per_step keeps every step on-policy and spends no CPU on rollouts the learner would drop.
    tasks_per_version: int | None = None
    seed: int = 0  # the learner's (LoRA init, RNG); the demo also seeds its tasks with it
    extra_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("group_size", "groups_per_step", "steps", "runner_workers", "eval_samples"):
            if getattr(self, name) < 1:
                raise BoltstreamError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("train", "test"):
            if not Path(getattr(self, name)).is_file():
                raise BoltstreamError(f"--{name}: no such file {getattr(self, name)}")


def http_json(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def worker_version(port: int) -> int | None:
    health = http_json(f"http://127.0.0.1:{port}/health")
    if not health:
        return None
    v = health.get("policy_version")
    return int(v) if v is not None else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return rows


def load_tasks(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return tasks[:limit] if limit else tasks


def mean_and_se(per_task: list[float]) -> tuple[float, float]:
    """Mean over tasks and its standard error (tasks are the independent units)."""
    n = len(per_task)
    if n == 0:
        return 0.0, 0.0
    mean = sum(per_task) / n
    if n == 1:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in per_task) / (n - 1)
    return mean, math.sqrt(var / n)


def evaluate(agent_fn: Callable[..., Any], tasks: list[dict[str, Any]], base_url: str, samples: int,
             threads: int = 8) -> dict[str, Any]:
    """Held-out score: mean reward per task over ``samples`` attempts, then mean and SE over tasks."""
    from concurrent.futures import ThreadPoolExecutor

    from boltstream.producers.context import RolloutContext

    def one(task: dict[str, Any], k: int, failures: list[str]) -> float:
        ctx = RolloutContext(rollout_id=f"eval-{task.get('id')}-{k}", attempt_id=f"eval:{k}",
                             task_id=str(task.get("id")), attempt=k, task=task, base_url=base_url,
                             capture=False)  # held-out calls must never become training data
        try:
            value = agent_fn(task, ctx)
        except Exception as exc:  # an agent failure scores 0 in evaluation, and is logged
            log.warning("eval attempt failed on task %s: %s", task.get("id"), exc)
            failures.append(f"{type(exc).__name__}: {exc}")
            return 0.0
        if isinstance(value, dict):
            value = next(iter(value.values()), 0.0)
        return float(value or 0.0)

    jobs = [(t, k) for t in tasks for k in range(samples)]
    failures: list[str] = []
    with ThreadPoolExecutor(threads) as pool:
        scores = list(pool.map(lambda job: one(*job, failures), jobs))
    if failures and len(failures) == len(jobs):
        raise BoltstreamError(f"every evaluation attempt failed; first error: {failures[0]}")
    per_task = [sum(scores[i * samples:(i + 1) * samples]) / samples for i in range(len(tasks))]
    mean, se = mean_and_se(per_task)
    return {"score": mean, "se": se, "tasks": len(tasks), "samples_per_task": samples, "per_task": per_task}


def component_env(settings: Settings, state_file: Path | None, extra: tuple[tuple[str, str], ...]) -> dict[str, str]:
    from boltstream.stack import settings_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env.update(settings_env(settings, state_file))
    if settings.schema_registry_url:
        env["BOLTSTREAM_SCHEMA_REGISTRY_URL"] = settings.schema_registry_url
    env.update(dict(extra))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env
