"""Run the whole loop for one agent: workers, stream app, learner, runners, evaluation.

Every component runs as its own ``boltstream ...`` process, exactly as a user
would run them by hand or in docker compose, so the demo exercises the real
topics, the real checkpoint path and the real reload. This module holds what a run
needs besides starting and stopping them (:mod:`boltstream.processes` does that):
evaluation, the components' environment, reading their outputs; no training logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from boltstream.config import Settings, load, to_argv
from boltstream.errors import BoltstreamError
from boltstream.inference.cli import ServeConfig, valid_rollout_temperature
from boltstream.learner.cli import parser as learner_parser
from boltstream.learner.config import LearnerConfig
from boltstream.learner.roles import Role, parse_role
from boltstream.producers.tasks import read_rows, validate
from boltstream.streams.cli import parser as stream_parser
from boltstream.streams.config import StreamConfig
from boltstream.weights.models import resolve_dtype

log = logging.getLogger(__name__)

# Sequences the inference worker decodes together (``serve --max-batch-size``, its default). Agents and
# evaluation attempts run this many at a time: one wave of rollouts fills one decode batch, where half as
# many took two waves of the same per-step cost on CPU.
CONCURRENT_AGENTS = next(f.default for f in dataclasses.fields(ServeConfig) if f.name == "max_batch_size")

# The name the worker serves and the learner publishes checkpoints under; agents ask for it.
MODEL_NAME = "policy"
# What a training rollout samples at unless told otherwise: the temperature the model was trained to
# produce its distribution at, the default of TRL's and verl's rollouts too.
TRAIN_TEMPERATURE = 1.0
# ``opentelemetry-instrument`` of this interpreter, run by it (a copied venv's shebangs may name another).
INSTRUMENT = str(Path(sys.executable).with_name("opentelemetry-instrument"))
# What an agent under ``opentelemetry-instrument`` needs to export its traces to boltstream, plus the
# standard exclusion that keeps the program's own plumbing (pacing polls, feedback posts) off the log.
# A zero-code agent's attempts carry no task id: the stream app groups them by their first prompt, within
# a window as long as a run (the default minute suits live traffic, not a training run's paced questions).
ZERO_CODE_PROMPT_WINDOW_S = 600.0
# The stream app's wait for late spans after a rollout's root span. A run's rollouts have every span in the
# log before their root: the worker acks each LLM span before it answers, and the runner (or the agent
# program's span processor) exports a rollout's spans in the order they end, the root last, all under the
# rollout's key (one partition). So a run's stream app closes a rollout when its root arrives, not the
# stream app's 3 s later (kept for exporters it knows nothing of, and a worker spooling through an outage).
# A wait of 1 s cost a step ~1.5 s of idle (the wait and the close timer's tick).
RUN_GRACE_S = 0.0
# The file (in the run's folder) that holds the run's learners while it evaluates the base policy
# (``learn --hold-file``): the agents already roll out on that policy meanwhile.
HOLD_FILE = "hold-learners"
ZERO_CODE_ENV = {"OTEL_TRACES_EXPORTER": "boltstream", "OTEL_PYTHON_EXCLUDED_URLS": "/health,/feedback"}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """One training run of one agent: what the run itself decides, and overrides of component settings.

    The components' settings are NOT copied here: ``stream`` and ``learner`` name only what this run
    changes (field name -> value), everything else keeps the component's own default, the same one it
    has when started by hand or by docker compose. That is what keeps ``boltstream train`` and a
    hand-run pipeline training the same way.
    """

    agent: str
    train: Path
    test: Path
    out: Path
    model: str = "smollm2"
    lora: bool = True
    # The inference worker's ``--dtype``: float32, the learner's, so the policy sampled and scored is the
    # one trained. ``auto`` (bfloat16 on a CPU that computes it natively) generates ~1.3x faster but rounds
    # each merged adapter into bf16 weights: on the agent suite's extraction agent it learned less in every
    # run (docs/learner.md, Defaults).
    serve_dtype: str | None = "float32"
    # The temperature every training rollout's calls sample at (the worker's ``--rollout-temperature``;
    # None: each call's own). Held-out evaluations sample at the agent's own. At the calculator's 0.7 one
    # seed of two gained +0.109, up to 75 % of its groups alike; at 1.0 both learned (docs/learner.md, Defaults).
    train_temperature: float | None = TRAIN_TEMPERATURE
    # Partitions per topic of the embedded stack (None: the stack's default). With one, the runner takes
    # the tasks in the training file's order.
    partitions: int | None = None
    group_size: int | None = None  # runner and stream app (default: theirs, DEFAULT_GROUP_SIZE)
    steps: int = 8
    time_budget_s: float = 840.0
    runner_workers: int = CONCURRENT_AGENTS
    eval_samples: int = 2
    eval_tasks: int | None = None
    # Runner pacing: at most this many tasks per served policy version (None: the learner's groups a step,
    # 0: run ahead freely). groups_per_step keeps every step on-policy and spends no CPU on rollouts the
    # learner would drop; run ahead, a fast agent's samples reached the learner 4 versions old.
    tasks_per_version: int | None = None
    stream: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # StreamConfig overrides
    learner: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # LearnerConfig overrides
    extra_env: tuple[tuple[str, str], ...] = ()
    # A program that plays the agent instead of the runner (zero code: the program runs under
    # ``opentelemetry-instrument`` with env vars only, no tasks topic, no runner). ``{base_url}``
    # in it is replaced by the worker's URL, ``{tasks_per_version}`` by the run's pacing.
    agent_program: tuple[str, ...] = ()
    # One LoRA adapter per role (docs/multi-agent.md), NAME[=REGEX] over agent names: each trained role gets
    # a learner of its own (`learn --role`); a frozen role only an adapter, which stays at the base weights.
    roles: tuple[str, ...] = ()
    frozen_roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("group_size", "steps", "runner_workers", "eval_samples", "partitions"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BoltstreamError(f"{name} must be >= 1, got {value}")
        if self.train_temperature is not None and not valid_rollout_temperature(self.train_temperature):
            raise BoltstreamError(f"--train-temperature must be in (0, 2] or 'agent', got {self.train_temperature}")
        for name in ("train", "test"):
            if not Path(getattr(self, name)).is_file():
                raise BoltstreamError(f"--{name}: no such file {getattr(self, name)}")
        trained, frozen = self.role_specs()
        names = [r.name for r in (*trained, *frozen)]
        if len(set(names)) != len(names):
            raise BoltstreamError(f"--roles / --frozen-roles: a role is named twice ({', '.join(names)})")
        if frozen and not trained:
            raise BoltstreamError("--frozen-roles needs --roles: with no trained role nothing would learn")
        if trained and self.stream.get("agent_match") is not None:
            raise BoltstreamError("--agent-match with --roles: the stream app trains the agents of the --roles")
        if trained and not self.lora:
            raise BoltstreamError("--roles trains one LoRA adapter per role: not with --full")
        self.stream_config()  # a typo or a bad value fails here, not in a child process
        self.learner_configs()

    def role_specs(self) -> tuple[tuple[Role, ...], tuple[Role, ...]]:
        """(trained, frozen) roles, parsed; a bad item raises ConfigError naming it."""
        return tuple(parse_role(r) for r in self.roles), tuple(parse_role(r) for r in self.frozen_roles)

    def learner_names(self) -> list[str]:
        """The learner processes of the run: ``learner``, or ``learner-<role>`` per trained role."""
        return [f"learner-{r.name}" for r in self.role_specs()[0]] or ["learner"]

    def metrics_paths(self, metrics_path: Path) -> dict[str, Path]:
        """Each learner's metrics file: ``metrics_path`` itself, or ``<stem>-<role><suffix>`` per role."""
        if not self.roles:
            return {"learner": metrics_path}
        return {f"learner-{r.name}": metrics_path.with_name(f"{metrics_path.stem}-{r.name}{metrics_path.suffix}")
                for r in self.role_specs()[0]}

    def argv(self, *, port: int = 8000, base_url: str = "http://127.0.0.1:8000/v1",
             metrics_path: Path | None = None) -> dict[str, list[str]]:
        """The command line of every component of the run (after ``boltstream``).

        The single description of what each component is told: ``stream_config``/``learner_config``
        parse these very lines, and a test compares them with the same components started by hand,
        by env or by docker compose.
        """
        group = ["--group-size", str(self.group_size)] if self.group_size else []
        lora = ["--lora"] if self.lora else ["--no-lora"]
        dtype = ["--dtype", self.serve_dtype] if self.serve_dtype else []
        explore = [] if self.train_temperature is None else ["--rollout-temperature", str(self.train_temperature)]
        pacing = ["--tasks-per-version", str(self.pacing())] if self.pacing() else []
        trained, frozen = self.role_specs()
        stream = {"grace_s": RUN_GRACE_S, **self.stream}
        adapters: list[str] = []
        if trained:  # the worker serves every role's adapter; the stream app keeps the trained roles' calls
            every = (*trained, *frozen)
            adapters = ["--adapters", ",".join(r.name for r in every),
                        "--adapter-agents", ",".join(f"{r.name}={r.agents.pattern}" for r in every)]
            stream["agent_match"] = "|".join(f"(?:{r.agents.pattern})" for r in trained)
        paths = self.metrics_paths(metrics_path) if metrics_path else {}
        program = [a.replace("{base_url}", base_url).replace("{tasks_per_version}", str(self.pacing()))
                   for a in self.agent_program]

        def learner(name: str, *role: str) -> list[str]:
            metrics = ["--metrics-path", str(paths[name])] if name in paths else []
            return ["learn", "--model", self.model, *role, "--max-steps", str(self.steps), "--checkpoint-every", "1",
                    "--hold-file", str(self.out / HOLD_FILE), *metrics,
                    "--worker-metrics", base_url.removesuffix("/v1"), *lora, *self.learner_dtype(),
                    *to_argv(LearnerConfig, self.learner)]

        learners = ({f"learner-{r.name}": learner(f"learner-{r.name}", "--role", f"{r.name}={r.agents.pattern}")
                     for r in trained} if trained else
                    {"learner": learner("learner", "--model-name", MODEL_NAME)})
        # Each run spools in its own folder: a user-wide spool would replay another run's spans into
        # this run's broker (the embedded stack is new every run).
        return {
            "worker": ["serve", "--model", self.model, "--served-model-name", MODEL_NAME, "--port", str(port),
                       "--spool-dir", str(self.out / "spool" / "worker"), *lora, *adapters, *dtype,
                       *explore],
            "stream": ["stream", "worker", *group, *to_argv(StreamConfig, stream)],
            **learners,
            "tasks": ["tasks", "publish", str(self.train), "--split", "train", *group],
            "runner": ["runner", "--agent", self.agent, "--workers", str(self.runner_workers), *group,
                       "--base-url", base_url, "--spool-dir", str(self.out / "spool" / "runner"), *pacing],
            "agent": [INSTRUMENT, sys.executable, *program],
        }

    def learner_dtype(self) -> list[str]:
        """The learner's ``--dtype``: bfloat16 where the worker serves bfloat16 and the learner trains a
        LoRA adapter, else the checkpoint's (float32). The frozen base weights then multiply on the CPU's
        bf16 units (a learner step ~1.3x shorter, ``benchmarks/bench_learner_dtype.py``) while the adapter
        and its optimizer state stay float32 (PEFT keeps a bf16 model's adapters in float32). Its log-probs
        agree with the bf16 worker's about as well as a float32 learner's do (docs/learner.md, Defaults).
        Full-weight training stays float32: AdamW on bf16 weights loses small updates."""
        if self.lora and resolve_dtype(self.serve_dtype) == "bfloat16":
            return ["--dtype", "bfloat16"]
        return []

    def pacing(self) -> int:
        """Tasks the runner starts per served policy version (0: no limit)."""
        if self.tasks_per_version is not None:
            return self.tasks_per_version
        default = next(f.default for f in dataclasses.fields(LearnerConfig) if f.name == "groups_per_step")
        return int(self.learner.get("groups_per_step", default))

    def stream_config(self) -> StreamConfig:
        """What the stream app of this run runs with (broker settings aside)."""
        return load(StreamConfig, _parsed(stream_parser(), self.argv()["stream"][1:]), env={},
                    state_file=os.devnull)

    def learner_configs(self) -> dict[str, LearnerConfig]:
        """What each learner of this run runs with (broker settings aside), by process name."""
        argv = self.argv()
        return {name: load(LearnerConfig, _parsed(learner_parser(), argv[name][1:]), env={}, state_file=os.devnull)
                for name in self.learner_names()}

    def learner_config(self) -> LearnerConfig:
        """What the (first) learner of this run runs with."""
        return next(iter(self.learner_configs().values()))


def _parsed(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    try:
        return vars(parser.parse_args(argv))
    except SystemExit as exc:  # argparse has said why on stderr (an invalid choice, say)
        raise BoltstreamError(f"invalid settings for {parser.prog}: {' '.join(argv)}") from exc


def http_json(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def worker_version(port: int, adapter: str | None = None) -> int | None:
    """The policy version the worker serves (of one ``adapter``); None while it does not answer."""
    health = http_json(f"http://127.0.0.1:{port}/health")
    if not health:
        return None
    v = health.get("policy_version") if adapter is None else health.get("adapters", {}).get(adapter, {}).get(
        "policy_version")
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


def repeat_tasks(tasks: list[dict[str, Any]], needed: int) -> list[dict[str, Any]]:
    """``tasks`` taken whole, again and again, until there are at least ``needed``. The runner takes each
    published task once and the publisher refuses a duplicate id, so pass k > 0 suffixes ``id`` (and
    ``task_id``) with ``~k``; a task without an id gets ``<its line>~k`` (the publisher hashes the first
    pass's payloads)."""
    passes = max(1, -(-needed // max(len(tasks), 1)))
    out = list(tasks)
    for k in range(1, passes):
        for line, t in enumerate(tasks):
            ids = {f: f"{t[f]}~{k}" for f in ("id", "task_id") if f in t}
            out.append({**t, **(ids or {"id": f"{line}~{k}"})})
    return out


def enough_tasks(path: Path, needed: int, out: Path) -> Path:
    """The training file a run of ``needed`` tasks reads: ``path`` when it holds that many valid tasks (or
    none: the task publisher then says why), else ``out``, JSONL written with :func:`repeat_tasks` of its
    valid tasks (a short task file otherwise ends a run before its last step: the learner waits for groups
    nobody will start, until the time budget). Read as the publisher reads it: JSONL or Parquet, the
    publisher's reasons for each line it would skip logged."""
    good, bad = validate(read_rows(Path(path)))
    if not good or len(good) >= needed:
        return path
    for b in bad:
        log.warning("%s line %d skipped: %s", path, b.line, b.reason)
    tasks = [json.loads(t.payload_json) for t in good]
    repeated = repeat_tasks(tasks, needed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(t) + "\n" for t in repeated))
    log.info("%s holds %d training tasks and the run takes %d: training on %d passes over them (%s)", path,
             len(tasks), needed, len(repeated) // len(tasks), out)
    return out


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
             threads: int = CONCURRENT_AGENTS, on_attempt: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Held-out score: mean reward per task over ``samples`` attempts, then mean and SE over tasks.

    ``on_attempt(done, total)`` is called as each attempt finishes (a run's progress lines).
    """
    import threading
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
    done = [0]
    lock = threading.Lock()

    def attempt(job: tuple[dict[str, Any], int]) -> float:
        score = one(*job, failures)
        if on_attempt is not None:
            with lock:
                done[0] += 1
                on_attempt(done[0], len(jobs))
        return score

    with ThreadPoolExecutor(threads) as pool:
        scores = list(pool.map(attempt, jobs))
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
