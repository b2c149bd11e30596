"""``make suite``: every example agent trained by ``boltstream train`` at its defaults, and the single-call
agents by TRL's GRPOTrainer beside it, as one table.

    .venv/bin/python benchmarks/agent_suite.py [--agents calc,extract,choose,lookup,calc-zero-code,sql] [--seeds 0,1]
        [--trl-seeds 0] [--steps 8] [--eval-samples 4] [--out out/suite] [--update-readme]
    .venv/bin/python benchmarks/agent_suite.py --tabulate [--out out/suite] [--update-readme]

boltstream: ``boltstream train --agent <module:solve> --train/--test <the agent's seeded tasks> --steps 8
--seed S --eval-samples 4 --no-live``, as typed (the agent's own files, an AIR rules file or its roles, are the only
additions; the learner, stream and sampling settings are the defaults). TRL: ``GRPOTrainer`` on the
same base model, LoRA adapter (rank, alpha, targets), learning rate and warm-up, samples a step
(groups a step x group size), steps, temperature and clip range, no KL and no std scaling (boltstream's
defaults), on the same training tasks, with the agent's own ``messages`` and ``reward``. Both are scored
before and after on the same held-out tasks, each attempt sampled at the agent's temperature: boltstream
through its inference worker and the agent's ``solve``, TRL by ``generate`` on its own model with the
same messages and token limit. The improvement's standard error is paired by task.

Every run leaves OUT/<agent>/<system>-<seed>/summary.json; the table (printed, and written to
benchmarks/results/agent_suite.md and .json, ``--update-readme`` to the README between its
``agent-suite`` markers) is built from whatever summaries exist, so a suite cut short still tabulates.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demo_seeds import SIGNIFICANT_SE, replace_block

from boltstream.config import DEFAULT_GROUP_SIZE
from boltstream.examples.sql.tasks import KIND_SETS as SQL_KIND_SETS
from boltstream.runs.pipeline import mean_and_se
from boltstream.weights.models import cpu_facts, describe_cpu

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- agent-suite:begin -->", "<!-- agent-suite:end -->"
EXAMPLES = "boltstream.examples"
# Attempts per held-out task. The held-out sets are small (14-64 tasks) and most rewards binary, so the paired SE
# of an improvement is part sampling noise: at 2 attempts the same model on the same tasks scored 0.141 and 0.281
# in two runs. 4 attempts halve that part's variance (the rest is how much the tasks differ).
EVAL_SAMPLES = 4
INSTRUMENT = ("opentelemetry-instrument", "--traces_exporter", "none", "--metrics_exporter", "none",
              "--logs_exporter", "none")


@dataclasses.dataclass(frozen=True)
class Agent:
    """One example agent as the suite runs it."""

    name: str
    shape: str
    extra: tuple[str, ...] = ()  # the agent's own files: an AIR rules file, its roles
    env: tuple[tuple[str, str], ...] = ()
    single_call: bool = False  # TRL runs it too (a prompt and a reward: what GRPOTrainer takes)
    instrumented: bool = False  # the agent's own spans need opentelemetry-instrument (an LLM client per role)
    package: str = ""  # the example it runs, when not its name
    tasks: tuple[tuple[str, Any], ...] = ()  # arguments of the example's train_test besides the seed

    @property
    def module(self) -> str:
        return f"{EXAMPLES}.{self.package or self.name}"


SUITE = (
    Agent("calc", "multi-turn tool (calculator)", ("--air-rules-file", "examples/calc/air.yaml")),
    # The single-call agents are scored on 64 held-out tasks (their generators make any number): the comparison
    # with TRL is between two improvements of the same base model, and at 32 tasks the two systems' "before"
    # scores of that one model differed by up to 0.07. (96 tasks would take the suite past 90 minutes.)
    Agent("extract", "single call, JSON fields", single_call=True, tasks=(("n_test", 64),)),
    Agent("choose", "single call, choice with a distractor", single_call=True, tasks=(("n_test", 64),)),
    Agent("lookup", "multi-turn retrieval over a shipped corpus"),
    # Zero code: the calculator as a program of its own under opentelemetry-instrument, rewards sent back
    # later as feedback by completion id; as many attempts and questions per version as the defaults group.
    Agent("calc-zero-code", "zero code, delayed feedback (calculator program)",
          ("--agent-program", "-m boltstream.examples.calc.standalone --tasks {train} --base-url {base_url} "
           f"--attempts {DEFAULT_GROUP_SIZE} --tasks-per-version {{tasks_per_version}}"),
          package="calc"),
    # The single-table COUNT questions (examples/sql/README.md): the untrained model gets ~20-40 % of them;
    # of the default mixed set (joins, lookups by name) ~6 %, too rare a success for a group to learn from.
    Agent("sql", "two roles (writer trained, answerer frozen)",
          ("--air-rules-file", "examples/sql/air.yaml", "--roles", "writer=^sql_writer$",
           "--frozen-roles", "answerer=^answerer$"),
          (("SQL_MODEL_WRITER", "writer"), ("SQL_MODEL_ANSWERER", "answerer"),
           ("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "openai")), instrumented=True,
          tasks=(("kinds", SQL_KIND_SETS["counts"]), ("n_train", 30), ("n_test", 14))),
)


def write_tasks(agent: Agent, seed: int, data: Path) -> tuple[Path, Path]:
    """The agent's seeded train/test split as JSONL under ``data`` (``boltstream train`` takes a training file
    shorter than its run several times over; TRL's single-call agents have more tasks than 8 steps take)."""
    train, test = importlib.import_module(f"{agent.module}.tasks").train_test(seed=seed, **dict(agent.tasks))
    data.mkdir(parents=True, exist_ok=True)
    paths = data / "train.jsonl", data / "test.jsonl"
    for path, tasks in zip(paths, (train, test), strict=True):
        path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return paths


def run_boltstream(agent: Agent, seed: int, steps: int, out: Path, eval_samples: int, extra: Sequence[str] = ()
                   ) -> int:
    """``boltstream train`` at the defaults (or with ``extra`` flags), as typed; its log beside its summary."""
    train, test = write_tasks(agent, seed, out / "data")
    cmd = [*(INSTRUMENT if agent.instrumented else ()), "boltstream", "train", "--agent",
           f"{agent.module}.agent:solve", "--train", str(train), "--test", str(test), "--steps", str(steps),
           "--seed", str(seed), "--eval-samples", str(eval_samples), "--out", str(out), "--no-live",
           *agent.extra, *extra]
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, **dict(agent.env), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    print(f"$ {shlex.join(cmd)}", flush=True)
    with open(out / "train.log", "w") as log:
        return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=False).returncode


def run_trl(agent: Agent, seed: int, steps: int, out: Path, eval_samples: int) -> None:
    """TRL's GRPOTrainer with boltstream's defaults where the two share a knob; writes out/summary.json."""
    from trl_side import train_and_score

    train, test = write_tasks(agent, seed, out / "data")
    summary = train_and_score(importlib.import_module(f"{agent.module}.agent"), train, test, seed, steps, out,
                              eval_samples)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


@dataclasses.dataclass(frozen=True)
class Row:
    agent: str
    system: str
    seed: int
    before: float
    after: float
    improvement: float
    improvement_se: float
    steps: int
    wall_s: float
    step_s: float
    eval_samples: int = 0  # attempts per held-out task (0: not recorded)

    @property
    def significant(self) -> bool:
        return self.improvement > SIGNIFICANT_SE * self.improvement_se

    def line(self) -> str:
        se = f"{self.improvement / self.improvement_se:.1f} SE" if self.improvement_se else "no spread"
        mark = " ✓" if self.significant else ""
        return (f"| {self.agent} | {self.system} | {self.seed} | {self.before:.3f} | {self.after:.3f} | "
                f"{self.improvement:+.3f} ± {self.improvement_se:.3f} ({se}){mark} | {self.steps} | "
                f"{self.wall_s:.0f} s | {self.step_s:.1f} s |")


def row(agent: str, system: str, seed: int, summary: dict[str, Any]) -> Row:
    steps = int(summary.get("learner_steps") or 0)
    return Row(agent, system, seed, float(summary["before"]["score"]), float(summary["after"]["score"]),
               float(summary["improvement"]), float(summary["improvement_se"]), steps, float(summary["wall_s"]),
               float(summary.get("train_s", 0.0)) / max(steps, 1),
               int(summary["before"].get("samples_per_task", 0)))


def collect(out: Path) -> list[Row]:
    rows = []
    for agent in SUITE:
        for path in sorted((out / agent.name).glob("*-*/summary.json")):
            system, _, seed = path.parent.name.rpartition("-")
            rows.append(row(agent.name, system, int(seed), json.loads(path.read_text())))
    return rows


def side_by_side(rows: Sequence[Row]) -> list[str]:
    """boltstream (at the defaults) against TRL, per agent, on the seeds both ran: each system's improvement
    averaged over those seeds, the per-seed difference (mean ± SE across seeds: one run of either system is
    one draw of a noisy process, so only the spread over seeds says whether a gap is real) and s/step."""
    lines = []
    for agent in dict.fromkeys(r.agent for r in rows):
        ours = {r.seed: r for r in rows if r.agent == agent and r.system == "boltstream"}
        theirs = {r.seed: r for r in rows if r.agent == agent and r.system == "trl"}
        seeds = sorted(ours.keys() & theirs.keys())
        if not seeds:
            continue
        gap, gap_se = mean_and_se([ours[s].improvement - theirs[s].improvement for s in seeds])
        (mean_ours, _), (mean_theirs, _), (step_ours, _), (step_theirs, _) = (
            mean_and_se([getattr(runs[s], field) for s in seeds])
            for runs, field in ((ours, "improvement"), (theirs, "improvement"), (ours, "step_s"), (theirs, "step_s")))
        spread = f" ± {gap_se:.3f}" if len(seeds) > 1 else ""
        lines.append(f"| {agent} | {','.join(map(str, seeds))} | {mean_ours:+.3f} | {mean_theirs:+.3f} | "
                     f"{gap:+.3f}{spread} | {step_ours:.1f} s / {step_theirs:.1f} s "
                     f"({step_theirs / step_ours if step_ours else 0:.1f}x) |")
    if not lines:
        return []
    return ["", "| agent | seeds both ran | boltstream improvement | TRL improvement | boltstream − TRL | "
                "s/step boltstream / TRL |", "|---|---|---|---|---|---|", *lines]


def versions(out: Path) -> dict[str, str]:
    """The package versions TRL's runs under ``out`` recorded (trl, transformers, torch, peft)."""
    found: dict[str, str] = {}
    for path in sorted(out.glob("*/trl-*/summary.json")):
        found.update(json.loads(path.read_text()).get("versions", {}))
    return found


def table(rows: Sequence[Row], machine: str, packages: dict[str, str] | None = None) -> str:
    head = ("| agent | system | seed | before | after | improvement (paired) | steps | wall | s/step |\n"
            "|---|---|---|---|---|---|---|---|---|")
    shapes = "; ".join(f"{a.name}: {a.shape}" for a in SUITE)
    attempts = " / ".join(str(n) for n in sorted({r.eval_samples for r in rows if r.eval_samples}))
    scored = f" Each held-out task attempted {attempts} times before and after." if attempts else ""
    listed = f" Versions: {', '.join(f'{k} {v}' for k, v in sorted(packages.items()))}." if packages else ""
    return "\n".join([head, *(r.line() for r in rows), *side_by_side(rows), "",
                      f"✓: more than {SIGNIFICANT_SE:g} paired SE.{scored} Side by side: improvements averaged over "
                      f"the seeds both systems ran, their difference per seed as mean ± SE across seeds. "
                      f"Agents: {shapes}. Machine: {machine}.{listed}"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", default=",".join(a.name for a in SUITE))
    p.add_argument("--seeds", default="0,1", help="boltstream's seeds")
    p.add_argument("--trl-seeds", default="0", help="TRL's seeds, single-call agents only ('' for none)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=EVAL_SAMPLES, help="attempts per held-out task, both "
                                                                           "systems, before and after")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "suite")
    p.add_argument("--extra", default="", help="flags added to every `boltstream train` (settings to compare "
                                                "with the defaults); needs --label")
    p.add_argument("--label", default="", help="names the --extra settings in the table: boltstream[LABEL]")
    p.add_argument("--tabulate", action="store_true", help="only tabulate the summaries under --out")
    p.add_argument("--update-readme", action="store_true")
    args = p.parse_args(argv)
    if bool(args.extra) != bool(args.label):
        p.error("--extra and --label go together: the table must say which runs had other settings")
    system = f"boltstream[{args.label}]" if args.label else "boltstream"
    names = args.agents.split(",")
    unknown = set(names) - {a.name for a in SUITE}
    if unknown:
        p.error(f"unknown agents {sorted(unknown)}; the suite has {[a.name for a in SUITE]}")
    failed = []
    for agent in (a for a in SUITE if a.name in names and not args.tabulate):
        for seed in (int(s) for s in args.seeds.split(",") if s):
            t0 = time.monotonic()
            rc = run_boltstream(agent, seed, args.steps, args.out / agent.name / f"{system}-{seed}",
                                args.eval_samples, shlex.split(args.extra))
            print(f"{agent.name} {system} seed {seed}: rc {rc} in {time.monotonic() - t0:.0f} s", flush=True)
            if rc:
                failed.append(f"{agent.name} {system} {seed}")
        for seed in (int(s) for s in args.trl_seeds.split(",") if s and agent.single_call):
            t0 = time.monotonic()
            run_trl(agent, seed, args.steps, args.out / agent.name / f"trl-{seed}", args.eval_samples)
            print(f"{agent.name} trl seed {seed}: {time.monotonic() - t0:.0f} s", flush=True)
    machine = describe_cpu(cpu_facts())
    text = table(collect(args.out), machine, versions(args.out))
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "agent_suite.md").write_text(text + "\n")
    (RESULTS / "agent_suite.json").write_text(json.dumps(
        {"machine": machine, "rows": [dataclasses.asdict(r) for r in collect(args.out)], "failed": failed},
        indent=2) + "\n")
    if args.update_readme:
        README.write_text(replace_block(README.read_text(), text, markers=(BEGIN, END)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
