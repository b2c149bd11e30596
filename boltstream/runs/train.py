"""``boltstream train``: the whole loop for your own agent, and the engine behind ``boltstream demo``.

It evaluates the served policy on held-out tasks, trains through the real
pipeline (runners -> spans -> stream app -> batches -> learner -> checkpoints
-> worker reload) until the learner has taken ``--steps`` steps or the time
budget is spent, evaluates again with the same sampling settings, and writes
``summary.json``, ``metrics.jsonl`` and ``curve.png`` to ``--out``.
Progress: a live table on a terminal, one line per event elsewhere
(:mod:`boltstream.runs.progress`); ``--report-to`` sends the learners' steps, the held-out
scores and every component's config to experiment trackers under ``--out/tracking``
(:mod:`boltstream.monitoring.tracking`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from boltstream.config import DEFAULT_GROUP_SIZE, Settings, flags_from_dataclass, load
from boltstream.inference.cli import DTYPES
from boltstream.learner import hints, timeline
from boltstream.learner.config import LearnerConfig
from boltstream.monitoring.status import ENDPOINTS_FILE
from boltstream.monitoring.tracking import Trackers, open_trackers
from boltstream.processes import Processes, free_port, wait_until
from boltstream.runs.pipeline import (
    HOLD_FILE,
    TRAIN_TEMPERATURE,
    ZERO_CODE_ENV,
    ZERO_CODE_PROMPT_WINDOW_S,
    PipelineConfig,
    component_env,
    enough_tasks,
    evaluate,
    load_tasks,
    mean_and_se,
    read_jsonl,
    worker_version,
)
from boltstream.runs.progress import choose_display
from boltstream.streams.config import StreamConfig
from boltstream.weights.models import cpu_facts, resolve_dtype

log = logging.getLogger(__name__)



# Component settings `boltstream train` offers as its own flags; each keeps the component's name, help
# and default (the flags come from the component's config), and is passed on only when given.
LEARNER_SETTINGS = ("lr", "lr_warmup_steps", "kl_coef", "groups_per_step", "lora_targets", "seed", "report_to")
STREAM_SETTINGS = ("call_credit", "std_normalize", "agent_match", "air_rules_file")


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--steps", type=int, default=None, help="learner steps to train (default 8)")
    a("--time-budget", type=float, default=None, help="seconds for the whole run, evaluation included")
    a("--out", type=Path, default=None, help="output folder")
    a("--model", default=None, help="smollm2 | tiny | a model directory or .gguf")
    a("--full", action="store_true", help="full fine-tuning instead of LoRA")
    a("--serve-dtype", default=None, choices=DTYPES,
      help="the inference worker's dtype (default float32, the learner's; auto: bfloat16 on a CPU with native bf16, "
           "faster, else the checkpoint's)")
    a("--group-size", type=int, default=None,
      help=f"attempts per task (GRPO group), for the runner and the stream app (default {DEFAULT_GROUP_SIZE})")
    a("--train-temperature", type=_temperature, default=None, metavar="T|agent",
      help=f"the temperature every training rollout's calls sample at, whatever the agent asks (default "
           f"{TRAIN_TEMPERATURE}; 'agent': each call's own); the held-out evaluation samples at the agent's own")
    a("--eval-samples", type=int, default=None, help="attempts per held-out task")
    a("--eval-tasks", type=int, default=None, help="use only the first N held-out tasks")
    a("--tasks-per-version", type=int, default=None,
      help="runner starts at most N tasks per policy version (default: the learner's groups per step, which "
           "keeps every step on-policy and wastes no rollout; 0: no limit)")
    a("--external", action="store_true", help="use the broker/S3 from BOLTSTREAM_* instead of an embedded stack")
    a("--no-live", action="store_true",
      help="one progress line per event instead of the live table (the default when stdout is not a terminal)")
    a("--roles", type=_items, default=None, metavar="NAME[=REGEX],...",
      help="one LoRA adapter and one learner per role, training the calls of the agents REGEX matches (default "
           "^NAME$); the worker serves every role's adapter, the stream app keeps these roles' calls "
           "(instead of --agent-match)")
    a("--frozen-roles", type=_items, default=None, metavar="NAME[=REGEX],...",
      help="with --roles: roles that get an adapter but are never trained (it stays at the base weights)")
    flags_from_dataclass(p.add_argument_group("learner settings (boltstream learn)"), LearnerConfig,
                         only=LEARNER_SETTINGS)
    flags_from_dataclass(p.add_argument_group("stream app settings (boltstream stream worker)"), StreamConfig,
                         only=STREAM_SETTINGS)


def _temperature(text: str) -> float | str:
    if text.strip().lower() == "agent":
        return "agent"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a temperature or 'agent', got {text!r}") from None


def _items(text: str) -> tuple[str, ...]:
    return tuple(i.strip() for i in text.split(",") if i.strip())


def config_from_args(args: argparse.Namespace, default_out: Path, **given: Any) -> PipelineConfig:
    """The run the flags describe; ``given`` adds what the caller decides (agent, tasks, overrides)."""
    run_level = {"out": args.out or default_out, "model": args.model, "steps": args.steps,
                 "time_budget_s": args.time_budget, "group_size": args.group_size,
                 "eval_samples": args.eval_samples, "eval_tasks": args.eval_tasks,
                 "tasks_per_version": args.tasks_per_version, "lora": False if args.full else None,
                 "serve_dtype": args.serve_dtype,
                 "roles": args.roles, "frozen_roles": args.frozen_roles}
    learner = {**given.pop("learner", {}), **_given(args, LEARNER_SETTINGS)}
    stream = {**given.pop("stream", {}), **_given(args, STREAM_SETTINGS)}
    kwargs = {k: v for k, v in {**run_level, **given}.items() if v is not None}
    if args.train_temperature is not None:
        kwargs["train_temperature"] = None if args.train_temperature == "agent" else args.train_temperature
    return PipelineConfig(learner=learner, stream=stream, **kwargs)


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


@contextlib.contextmanager
def _stack(out: Path, external: bool, partitions: int | None) -> Iterator[tuple[Settings, Path | None]]:
    if external:
        yield load(Settings), None
        return
    from boltstream.stack import embedded_stack

    with embedded_stack(out / "stack", partitions=partitions) as settings:
        yield settings, Path(settings.state_file)


def _agent_callable(spec: str) -> Any:
    from boltstream.producers.agent import load_agent

    return load_agent(spec)


def run(cfg: PipelineConfig, external: bool = False, display: Any = None) -> dict[str, Any]:
    """Train ``cfg.agent`` end to end; returns the summary written to ``cfg.out/summary.json``."""
    started = time.monotonic()
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    metrics = cfg.metrics_paths(metrics_path)  # learner process -> its metrics file (one per trained role)
    for path in metrics.values():
        path.unlink(missing_ok=True)
    roles = {name: name.removeprefix("learner-") for name in metrics} if cfg.roles else {}
    agent_fn = _agent_callable(cfg.agent)
    test_tasks = load_tasks(cfg.test, cfg.eval_tasks)
    summary = _settings_summary(cfg, roles)
    group_size = summary["stream"]["group_size"]
    # The learners report their steps themselves (--report-to reaches them as a learner setting, their
    # trackers write under out/tracking too); this process adds the held-out scores and the run's settings.
    learner_cfg = cfg.learner_config()
    trackers = open_trackers(learner_cfg.report_to, out / "tracking", "pipeline", group=learner_cfg.run_name)
    trackers.log_params({k: summary[k] for k in ("settings", "stream", "learner")})
    if display is not None:
        display.plan(cfg.steps, cfg.time_budget_s, started)

    def phase(text: str) -> None:
        if display is not None:
            display.phase(text)

    def evaluate_held_out(label: str) -> dict[str, Any]:
        phase(f"evaluation {label}: {len(test_tasks)} held-out tasks x {cfg.eval_samples}")
        on_attempt = None if display is None else functools.partial(display.evaluation, label)
        return evaluate(agent_fn, test_tasks, base_url, cfg.eval_samples, on_attempt=on_attempt)

    if not external:  # a new embedded stack: spans spooled for an earlier run's broker mean nothing here
        shutil.rmtree(out / "spool", ignore_errors=True)
    phase("starting the embedded stack" if not external else "connecting to the broker")
    with trackers_closed(trackers), _stack(out, external, cfg.partitions) as (settings, state_file):
        env = component_env(settings, state_file, cfg.extra_env)
        procs = Processes(out / "logs", env)
        try:
            port = free_port()
            base_url = f"http://127.0.0.1:{port}/v1"
            argv = cfg.argv(port=port, base_url=base_url, metrics_path=metrics_path)
            # For `boltstream status --run OUT`: the addresses this run's components answer on.
            (out / ENDPOINTS_FILE).write_text(json.dumps({"workers": [f"http://127.0.0.1:{port}"]}) + "\n")
            # The stream app and the learners start beside the worker, held: their start-up shares the CPU
            # with the worker's and with the evaluation instead of following them, and no learner takes a
            # step (so no checkpoint reaches the worker) before the base policy is scored. The agents start
            # once the worker answers; their first rollouts (on the base policy too) run beside the evaluation.
            hold = out / HOLD_FILE
            hold.touch()
            try:
                procs.start("worker", *argv["worker"])
                _start_learning(procs, argv, metrics)
                phase(f"starting the inference worker ({cfg.model}), the stream app and the learners")
                wait_until(lambda: worker_version(port) is not None, 600, "the inference worker", procs)
                _start_agents(cfg, procs, argv)
                log.info("evaluating the base policy on %d held-out tasks", len(test_tasks))
                eval_started = time.monotonic()
                summary["before"] = evaluate_held_out("before")
                eval_s = time.monotonic() - eval_started
            finally:
                hold.unlink(missing_ok=True)
            log.info("before: %.3f ± %.3f", summary["before"]["score"], summary["before"]["se"])
            phase(f"before: {summary['before']['score']:.3f} ± {summary['before']['se']:.3f} held-out")
            trackers.log_metrics(_held_out(summary["before"]), 0)

            summary["train_s"] = _train(cfg, procs, metrics, port, (started, eval_s), display, group_size, summary)
            summary.update(_learners_summary(cfg, procs, metrics, roles, port))
            summary["after"] = evaluate_held_out("after")
            log.info("after: %.3f ± %.3f", summary["after"]["score"], summary["after"]["se"])
        finally:
            procs.stop_all()
        summary["wall_s"] = round(time.monotonic() - started, 1)
        # The same tasks are scored before and after: the per-task difference is the paired unit, and its
        # standard error is far smaller than either score's (task difficulty cancels out).
        diffs = [a - b for a, b in zip(summary["after"]["per_task"], summary["before"]["per_task"], strict=True)]
        summary["improvement"], summary["improvement_se"] = mean_and_se(diffs)
        phase(f"after: {summary['after']['score']:.3f} ± {summary['after']['se']:.3f} held-out, improvement "
              f"{summary['improvement']:+.3f} ± {summary['improvement_se']:.3f}")
        trackers.log_metrics({**_held_out(summary["after"]), "held_out/improvement": summary["improvement"],
                              "held_out/improvement_se": summary["improvement_se"],
                              "train_s": summary["train_s"], "wall_s": summary["wall_s"]},
                             summary["learner_steps"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot({roles.get(name, "training"): path for name, path in metrics.items()}, summary, out / "curve.png")
    return summary


def _start_learning(procs: Processes, argv: dict[str, list[str]], metrics: dict[str, Path]) -> None:
    """Start the stream app and the learners (they need the broker and S3, not the worker)."""
    for name in ("stream", *metrics):
        procs.start(name, *argv[name])


def _start_agents(cfg: PipelineConfig, procs: Processes, argv: dict[str, list[str]]) -> None:
    """Start the agents: the task publisher and the runner, or the agent program (they call the worker)."""
    if cfg.agent_program:  # a program the way its users run it: no runner, env vars only
        procs.start_command("agent", [sys.executable, *argv["agent"]], env=ZERO_CODE_ENV)
    else:
        for name in ("tasks", "runner"):
            procs.start(name, *argv[name])


def _train(cfg: PipelineConfig, procs: Processes, metrics: dict[str, Path], port: int,
           clock: tuple[float, float], display: Any, group_size: int, summary: dict[str, Any]) -> float:
    """Wait for the learners' steps (released from their hold) or the time budget, stop the agents and
    learners so that the last step is published; returns the seconds it took. ``clock``: when the run
    started and what the evaluation before took; the after-eval costs that, a little more while the last
    checkpoint loads and the other components stop: that is kept back, not more (every second is training)."""
    started, eval_s = clock
    deadline = started + cfg.time_budget_s - (1.5 * eval_s + 30.0)
    train_started = time.monotonic()
    if display is not None:
        display.phase(f"training: {cfg.steps} learner steps")
    agents = ("agent",) if cfg.agent_program else ("tasks", "runner")
    summary["hints"] = {}  # what stuck_hint said (each kind of hint once), and at which step it first did
    summary["stopped_by_time_budget"] = not _wait_for_learners(cfg, procs, metrics, port, deadline, display,
                                                               group_size, summary["hints"])
    if summary["stopped_by_time_budget"]:
        # said loudly: a slow or busy machine otherwise shows only "learner steps: 0" at the end
        log.warning("time budget: training stopped after %d of %d learner steps (%.0f s budget, the evaluation "
                    "before took %.0f s and as much is kept for the one after); raise --time-budget",
                    min(len(_steps(p)) for p in metrics.values()), cfg.steps, cfg.time_budget_s, eval_s)
    if display is not None:
        display.phase("stopping the agents and learners")
    for name in reversed(agents):
        procs.stop(name)
    # SIGTERM: the learner finishes the step it is in and publishes it. Left running, it went on
    # training on groups already in flight and the worker reloaded mid-evaluation.
    for name in metrics:
        procs.stop(name, timeout=300)
    return round(time.monotonic() - train_started, 1)


def _settings_summary(cfg: PipelineConfig, roles: dict[str, str]) -> dict[str, Any]:
    """What each component ran with, resolved by its own parser from the command line it was given."""
    stream_cfg = cfg.stream_config()
    summary: dict[str, Any] = {
        "settings": {k: str(v) for k, v in vars(cfg).items()},
        "stream": {"group_size": stream_cfg.group_size, "agent_match": stream_cfg.agent_match,
                   "air_rules_file": stream_cfg.air_rules_file, **dataclasses.asdict(stream_cfg.credit)},
        "learner": cfg.learner_config().to_dict() if not roles else
        {roles[name]: c.to_dict() for name, c in cfg.learner_configs().items()},
    }
    if roles:
        summary["frozen_roles"] = [r.name for r in cfg.role_specs()[1]]
    # what the run's speed and learning depend on: the CPU (native bf16 or not) and the weights' dtype served
    summary["machine"] = cpu_facts(with_torch=False)
    summary["serve_dtype_resolved"] = resolve_dtype(cfg.serve_dtype) or "the checkpoint's (float32 for smollm2)"
    return summary


def _wait_for_learners(cfg: PipelineConfig, procs: Processes, metrics: dict[str, Path], port: int,
                       deadline: float, display: Any, group_size: int, hint_steps: dict[str, int]) -> bool:
    """Wait (updating ``display``, and saying each kind of :func:`~boltstream.learner.hints.stuck_hint` once per
    learner, kept in ``hint_steps`` with the step it appeared at) until every learner logged ``cfg.steps``
    steps or ``deadline`` passes; whether they all did."""
    said: set[tuple[str, str]] = set()

    def learner_done() -> bool:
        rows = {name: _steps(path) for name, path in metrics.items()}
        if display is not None:
            display.update(rows=next(iter(rows.values())), version=worker_version(port), procs=procs,
                           worker_port=port, group_size=group_size)
        for name, steps in rows.items():
            hint = hints.stuck_hint(steps)
            if hint is not None and (name, hint.kind) not in said:
                said.add((name, hint.kind))
                text = f"{name}: {hint.text}" if len(rows) > 1 else hint.text
                hint_steps[text] = steps[-1]["step"]
                log.warning("not learning? %s", text)
                if display is not None:
                    display.hint(text)
        return all(r and r[-1]["step"] >= cfg.steps for r in rows.values())

    with contextlib.suppress(Exception):
        wait_until(learner_done, max(0.0, deadline - time.monotonic()), "the learner", procs)
    return learner_done()


def _learners_summary(cfg: PipelineConfig, procs: Processes, metrics: dict[str, Path], roles: dict[str, str],
                      port: int) -> dict[str, Any]:
    """Steps and peak memory of the stopped learners, once the worker serves each one's last version."""
    steps_of: dict[str, int] = {}
    rss_of: dict[str, float | None] = {}
    for name, path in metrics.items():
        rows = _steps(path)
        adapter = roles.get(name)  # None: the worker's one policy
        final_version = max((int(r.get("version", r["step"])) for r in rows), default=0)
        if final_version:
            wait_until(functools.partial(_serves, port, adapter, final_version), 120,
                       f"the worker to load {adapter or 'the'} policy version {final_version}", procs)
        steps_of[name] = len(rows)
        rss_of[name] = max((r.get("peak_rss_mb") or 0.0 for r in rows), default=None)
    first = next(iter(metrics.values()))
    summary: dict[str, Any] = {
        "learner_steps": min(steps_of.values()),  # the steps every learner took
        "learner_peak_rss_mb": max((m for m in rss_of.values() if m is not None), default=None),
        # where the (first) learner's steps spent their time, added up over the run
        "step_time": timeline.totals([r["timeline"] for r in _steps(first) if "timeline" in r]),
    }
    if roles:
        summary["roles"] = {roles[n]: {"learner_steps": steps_of[n], "learner_peak_rss_mb": rss_of[n]}
                            for n in metrics}
        summary["policy_version_served"] = {r.name: worker_version(port, r.name)
                                            for specs in cfg.role_specs() for r in specs}
    else:
        summary["policy_version_served"] = worker_version(port)
    return summary


def _held_out(result: dict[str, Any]) -> dict[str, float]:
    return {"held_out/score": result["score"], "held_out/se": result["se"]}


@contextlib.contextmanager
def trackers_closed(trackers: Trackers) -> Iterator[Trackers]:
    try:
        yield trackers
    finally:
        trackers.close()


def _serves(port: int, adapter: str | None, version: int) -> bool:
    return (worker_version(port, adapter) or 0) >= version


def _steps(metrics_path: Path) -> list[dict[str, Any]]:
    """The learner's step records (its JSONL also holds checkpoint and resume lines)."""
    return [r for r in read_jsonl(metrics_path) if r.get("event") == "step"]


def _plot(curves: dict[str, Path], summary: dict[str, Any], png: Path) -> None:
    """Training reward per step of each learner (label -> its metrics file), held-out scores before/after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    last = 1
    for label, path in curves.items():
        rows = _steps(path)
        last = max(last, len(rows))
        if rows:
            ax.plot([r["step"] for r in rows], [r.get("reward_mean", 0.0) for r in rows], marker="o",
                    label=f"{label} reward (mean per step)")
    for key, x, color in (("before", 0, "tab:red"), ("after", last, "tab:green")):
        s = summary.get(key)
        if s:
            ax.errorbar([x], [s["score"]], yerr=[s["se"]], fmt="s", color=color, capsize=4,
                        label=f"held-out {key}: {s['score']:.2f}")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def stop_on_sigterm() -> None:
    """``kill PID`` ends a run as Ctrl-C does: the children (own sessions) are stopped, not orphaned."""

    def interrupt(signum: int, frame: Any) -> None:
        # Why say so: a learner is given up to 300 s to publish the step it is in, and a run that
        # goes quiet after `kill` looks hung. A second signal interrupts that wait.
        log.warning("signal %d: stopping the run; a learner may take up to 300 s to publish the step it is in "
                    "(a second signal stops waiting for it)", signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream train", description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", required=True, help="module:function of your agent (see docs/producers.md)")
    p.add_argument("--train", type=Path, required=True, help="training tasks (JSONL)")
    p.add_argument("--test", type=Path, required=True, help="held-out tasks (JSONL)")
    p.add_argument("--agent-program", metavar="ARGS",
                   help="zero code: run the agent as a program of its own, `python ARGS` under "
                        "opentelemetry-instrument, instead of the runner calling --agent ({base_url}, {train} and "
                        "{tasks_per_version} are replaced; its rewards come back as feedback). --agent still scores the held-out "
                        "tasks; attempts are grouped by their first prompt (docs/zero-code.md)")
    add_arguments(p)
    return p


def zero_code(program: str | None, train: Path) -> dict[str, Any]:
    """What ``--agent-program`` adds to a run: the program's arguments, and a stream app that groups the
    attempts at one question by their first prompt for as long as a run takes (they carry no task id)."""
    if not program:
        return {}
    return {"agent_program": tuple(a.replace("{train}", str(train)) for a in shlex.split(program)),
            "stream": {"prompt_window_s": ZERO_CODE_PROMPT_WINDOW_S}}


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)

    def config(train: Path) -> PipelineConfig:
        return config_from_args(args, Path("out/train"), agent=args.agent, train=train, test=args.test,
                                **zero_code(args.agent_program, train))

    cfg = config(args.train)
    # every step's groups are tasks of their own: a file shorter than the run is taken several times
    needed = cfg.steps * cfg.learner_config().groups_per_step
    train = enough_tasks(args.train, needed, cfg.out / "data" / "train-repeated.jsonl")
    if train != args.train:
        cfg = config(train)
    stop_on_sigterm()
    with choose_display("boltstream train", args.no_live) as display:
        summary = run(cfg, external=args.external, display=display)
    print_summary(summary)
    return 0


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="boltstream: held-out score before and after training")
    for col in ("", "score", "std. error", "tasks x samples"):
        t.add_column(col)
    for key in ("before", "after"):
        s = summary[key]
        t.add_row(key, f"{s['score']:.3f}", f"{s['se']:.3f}", f"{s['tasks']} x {s['samples_per_task']}")
    Console().print(t)
    Console().print(f"improvement: {summary['improvement']:+.3f} ± {summary['improvement_se']:.3f} "
                    "(paired over the same held-out tasks)")
    # `boltstream evaluate` has no learner of its own: only the facts a summary holds are printed
    facts = {"learner steps": summary.get("learner_steps"),
             "policy version served": summary.get("policy_version_served"),
             "wall time": f"{summary['wall_s']} s",
             "learner peak RSS": None if summary.get("learner_peak_rss_mb") is None
             else f"{summary['learner_peak_rss_mb']} MiB"}
    Console().print(", ".join(f"{name}: {value}" for name, value in facts.items() if value is not None))
    if summary.get("step_time"):
        Console().print(f"time in learner steps: {timeline.format_timeline(summary['step_time'])}")
    for hint, step in summary.get("hints", {}).items():
        Console().print(f"[bold]not learning?[/bold] (from step {step}) {hint}")
    if summary.get("stopped_by_time_budget"):
        Console().print("[bold]the time budget ran out before the learner's last step: raise --time-budget[/bold]")
