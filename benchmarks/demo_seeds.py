"""``make seeds``: the calculator demo on several seeds, one after the other, as the README's table.

    .venv/bin/python benchmarks/demo_seeds.py [--seeds 0,1,2,3] [--extra="--steps 12"] [--out out/seeds]
                                              [--update-readme]
    .venv/bin/python benchmarks/demo_seeds.py --summaries out/seeds/0 out/seeds/1 ... [--update-readme]

Each seed S runs ``boltstream demo --no-live --seed S --out OUT/S EXTRA`` and leaves OUT/S/summary.json.
The runs go in turn, never side by side: one demo already keeps both cores of the reference machine
busy, and two would time each other. ``--summaries`` (folders or summary.json files) only tabulates
runs that exist. The table (seed | before | after | improvement (paired) | steps | wall | learner peak
RSS, then a mean row: the mean over seeds with its standard error across seeds, and how many seeds
improved by more than 3 paired standard errors) is printed and written to
benchmarks/results/demo_seeds.md and .json; ``--update-readme`` also replaces the README's table between
its ``demo-seeds`` markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from boltstream.weights.models import describe_cpu

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- demo-seeds:begin -->", "<!-- demo-seeds:end -->"
HEADER = ("| seed | before | after | improvement (paired) | steps | wall | learner peak RSS |\n"
          "|---|---|---|---|---|---|---|")
SIGNIFICANT_SE = 3.0  # an improvement counts when it exceeds this many paired standard errors


@dataclasses.dataclass(frozen=True)
class SeedResult:
    """What the table shows of one run's summary.json (written by ``boltstream.runs.train.run``)."""

    seed: str
    before: float
    before_se: float
    after: float
    after_se: float
    improvement: float
    improvement_se: float
    steps: int
    wall_s: float
    peak_rss_mb: float | None
    stopped_by_time_budget: bool = False
    machine: str = "not recorded"  # the CPU and its native bf16 (boltstream.weights.models.describe_cpu)
    serve_dtype: str = "not recorded"  # the dtype the worker served in

    @property
    def significant(self) -> bool:
        return self.improvement > SIGNIFICANT_SE * self.improvement_se

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "significant": self.significant}


def seed_result(summary: Mapping[str, Any], fallback_seed: str, source: str = "summary") -> SeedResult:
    """The row of one summary; a summary that lacks a field (an interrupted run) is an error naming it.
    The seed is the learner's (``learner.seed``), else ``fallback_seed`` (the run folder's name)."""
    def number(*keys: str) -> float:
        value: Any = summary
        for key in keys:
            if not isinstance(value, Mapping) or key not in value:
                raise ValueError(f"{source}: no {'.'.join(keys)} (did the run finish?)")
            value = value[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{source}: {'.'.join(keys)} is {value!r}, not a number")
        return float(value)

    learner = summary.get("learner")
    seed = learner.get("seed") if isinstance(learner, Mapping) else None
    rss = None if summary.get("learner_peak_rss_mb") is None else number("learner_peak_rss_mb")
    return SeedResult(
        seed=str(seed if seed is not None else fallback_seed),
        before=number("before", "score"), before_se=number("before", "se"),
        after=number("after", "score"), after_se=number("after", "se"),
        improvement=number("improvement"), improvement_se=number("improvement_se"),
        steps=int(number("learner_steps")), wall_s=number("wall_s"), peak_rss_mb=rss,
        stopped_by_time_budget=bool(summary.get("stopped_by_time_budget", False)),
        machine=describe_cpu(summary["machine"]) if isinstance(summary.get("machine"), Mapping) else "not recorded",
        serve_dtype=str(summary.get("serve_dtype_resolved", "not recorded")),
    )


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error across seeds (sample std / sqrt(n); 0 for one value)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _wall(seconds: float) -> str:
    return f"{seconds:,.0f} s"


def _rss(mb: float | None) -> str:
    return "–" if mb is None else f"{mb:,.0f} MiB"


def row(r: SeedResult) -> str:
    steps = f"{r.steps} (time budget)" if r.stopped_by_time_budget else str(r.steps)
    return (f"| {r.seed} | {r.before:.3f} ± {r.before_se:.3f} | {r.after:.3f} ± {r.after_se:.3f} | "
            f"{r.improvement:+.3f} ± {r.improvement_se:.3f} | {steps} | {_wall(r.wall_s)} | {_rss(r.peak_rss_mb)} |")


def mean_row(results: Sequence[SeedResult]) -> str:
    """Means over seeds ± their standard error across seeds; steps and wall averaged, RSS the largest."""
    before, before_se = mean_and_se([r.before for r in results])
    after, after_se = mean_and_se([r.after for r in results])
    improvement, improvement_se = mean_and_se([r.improvement for r in results])
    significant = sum(r.significant for r in results)
    steps = mean_and_se([r.steps for r in results])[0]
    rss = [r.peak_rss_mb for r in results if r.peak_rss_mb is not None]
    return (f"| mean of {len(results)} | {before:.3f} ± {before_se:.3f} | {after:.3f} ± {after_se:.3f} | "
            f"{improvement:+.3f} ± {improvement_se:.3f} ({significant}/{len(results)} seeds > 3 SE) | "
            f"{steps:g} | {_wall(mean_and_se([r.wall_s for r in results])[0])} | {_rss(max(rss, default=None))} |")


def table(results: Sequence[SeedResult]) -> str:
    """The Markdown table: one row per seed, then the mean row (from two seeds on), then what it means."""
    if not results:
        raise ValueError("no runs to tabulate")
    lines = [HEADER, *(row(r) for r in results)]
    if len(results) > 1:
        lines += [mean_row(results), "",
                  "Mean row: the mean over seeds ± its standard error across seeds; an improvement counts "
                  f"(> 3 SE) when it exceeds {SIGNIFICANT_SE:g} times its own paired standard error."]
    lines += ["", "Served in " + " / ".join(sorted({r.serve_dtype for r in results})) + " on "
              + " / ".join(sorted({r.machine for r in results})) + "."]
    return "\n".join(lines)


def replace_block(text: str, content: str, source: str = "README.md", markers: tuple[str, str] = (BEGIN, END)
                  ) -> str:
    """``text`` with what lies between the markers replaced by ``content`` (the markers stay)."""
    begin, end = markers
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{source}: needs exactly one {begin} followed by one {end} around the table")
    return text[:text.index(begin) + len(begin)] + "\n" + content + "\n" + text[text.index(end):]


def summary_path(path: Path) -> Path:
    """A run folder's summary.json, or the file itself (a name ending in .json)."""
    return path if path.suffix == ".json" else path / "summary.json"


def load_result(path: Path) -> SeedResult:
    file = summary_path(path)
    try:
        summary = json.loads(file.read_text())
    except OSError as exc:
        raise ValueError(f"{file}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not JSON ({exc})") from None
    if not isinstance(summary, Mapping):
        raise ValueError(f"{file}: not a JSON object")
    folder = file.parent.name
    return seed_result(summary, folder, str(file))


def run_demo(seed: int, out: Path, extra: Sequence[str]) -> int:
    """One demo run in its own process, its output streaming through; the exit code."""
    argv = ["demo", "--no-live", "--seed", str(seed), "--out", str(out), *extra]
    print(f"=== boltstream {shlex.join(argv)}", flush=True)
    started = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "boltstream.cli", *argv], cwd=ROOT)
    print(f"=== seed {seed}: exit {rc} in {time.monotonic() - started:,.0f} s", flush=True)
    return rc


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"distinct integers, at least one, got {text!r}")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=parse_seeds, default=[0, 1, 2, 3], help="comma-separated (default 0,1,2,3)")
    p.add_argument("--extra", default="", help='more demo arguments, e.g. --extra="--steps 12"')
    p.add_argument("--out", type=Path, default=ROOT / "out" / "seeds", help="each seed's run goes to OUT/SEED")
    p.add_argument("--summaries", type=Path, nargs="+", default=None, metavar="DIR",
                   help="tabulate these runs' summary.json (folders or files) instead of running the demo")
    p.add_argument("--update-readme", action="store_true", help="replace the README's table between its markers")
    p.add_argument("--results", type=Path, default=RESULTS, help="where demo_seeds.md and .json go")
    p.add_argument("--readme", type=Path, default=README, help="the README --update-readme edits")
    args = p.parse_args(argv)
    if args.update_readme:  # before hours of runs, not after
        try:
            replace_block(args.readme.read_text(), "", str(args.readme))
        except (OSError, ValueError) as exc:
            p.error(f"--update-readme: {exc}")
    failed: list[str] = []
    if args.summaries:
        paths = list(args.summaries)
        command = shlex.join(["python", "benchmarks/demo_seeds.py", "--summaries", *map(str, paths)])
    else:
        extra = shlex.split(args.extra)
        paths = []
        for seed in args.seeds:
            if run_demo(seed, args.out / str(seed), extra):
                failed.append(f"seed {seed}: demo failed")
            else:
                paths.append(args.out / str(seed))
        command = shlex.join(["python", "benchmarks/demo_seeds.py", "--seeds", ",".join(map(str, args.seeds)),
                              *(["--extra", args.extra] if args.extra else [])])
    results = []
    for path in paths:
        try:
            results.append(load_result(path))
        except ValueError as exc:
            failed.append(str(exc))
    for problem in failed:
        print(f"not in the table: {problem}", file=sys.stderr)
    if not results:
        return 1
    text = table(results)
    print(text)
    args.results.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (args.results / "demo_seeds.md").write_text(f"Command: `{command}` ({when})\n\n{text}\n")
    means = {k: mean_and_se([getattr(r, k) for r in results]) for k in ("before", "after", "improvement")}
    (args.results / "demo_seeds.json").write_text(json.dumps({
        "command": command, "date": when, "seeds": [r.to_dict() for r in results],
        "mean": {**{k: v[0] for k, v in means.items()}, **{f"{k}_se_across_seeds": v[1] for k, v in means.items()},
                 "significant": sum(r.significant for r in results), "runs": len(results)},
        "not_tabulated": failed}, indent=2) + "\n")
    if args.update_readme and failed:
        print(f"{args.readme} left as it was: not every run is in the table", file=sys.stderr)
    elif args.update_readme:
        args.readme.write_text(replace_block(args.readme.read_text(), text, str(args.readme)))
        print(f"updated {args.readme}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
