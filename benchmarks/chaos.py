"""``make chaos``: every fault scenario on the real pipeline, reconciled, as a table.

    .venv/bin/python benchmarks/chaos.py [--scenarios a,b,...] [--tasks 16] [--out docs/reliability.md]
                                         [--keep DIR] [--memory]

Starts a private embedded stack with durable broker storage (``stack up --durable``: the broker
scenario needs its log to survive; ``--memory`` for a faster one without it), runs each scenario of
``tests/integration/chaos/chaos_scenarios.py`` and ``agent_scenarios.py`` in a namespace of its own
(fresh topics), prints the table (scenario, load held, faults, rollouts in, samples trained, lost,
duplicated, deduped, recovery time) and writes it, with this command, between the markers of
``--out``: a run of some scenarios replaces their rows and keeps the others.
The fast form (two scenarios, asserting lost = duplicated = 0) runs in ``make test`` as
``tests/integration/chaos/test_chaos_fast.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from boltstream import s3  # noqa: E402
from boltstream.broker.topics import ensure_topics  # noqa: E402
from boltstream.stack import embedded_stack, run_sync, settings_env  # noqa: E402
from tests.integration.chaos import chaos_scenarios  # noqa: E402
from tests.integration.chaos.agent_scenarios import AGENT_SCENARIOS, run_agent_scenario  # noqa: E402
from tests.integration.chaos.chaos_scenarios import HEADER, Result, run_scenario  # noqa: E402

BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"
SCENARIOS = {**chaos_scenarios.SCENARIOS, **AGENT_SCENARIOS}


def merge_block(old: str, rows: dict[str, str], command_line: str, full: bool) -> str:
    """The table block after a run: a full run replaces it; a partial run replaces the rows of the
    scenarios it ran, keeps the others (and the command lines that produced them), in SCENARIOS order."""
    commands, kept = [], {}
    if not full:
        for line in old.splitlines():
            if line.startswith("Command: "):
                commands.append(line)
            elif line.startswith("| ") and not line.startswith("| scenario "):
                kept[line.split("|")[1].strip()] = line
    kept.update(rows)
    order = [n for n in SCENARIOS if n in kept] + [n for n in kept if n not in SCENARIOS]
    return "\n".join([BEGIN, *commands, command_line, "", HEADER, *(kept[n] for n in order), END])


def write_table(out: Path, results: list[Result], command: str, full: bool = True) -> None:
    load = os.getloadavg()[0]
    command_line = (f"Command: `{command}` ({platform.node() or 'host'}, {os.cpu_count()} cores, load {load:.1f} "
                    f"at the end, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    text = out.read_text() if out.exists() else ""
    has_block = BEGIN in text and END in text
    old = text[text.index(BEGIN):text.index(END)] if has_block else ""
    block = merge_block(old, {r.scenario: r.row() for r in results}, command_line, full)
    if has_block:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text + ("\n" if text else "") + block + "\n"
    out.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: " + ", ".join(SCENARIOS))
    p.add_argument("--tasks", type=int, default=16, help="GRPO groups of 4 rollouts per scenario")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    p.add_argument("--keep", type=Path, default=None, help="run in this folder and keep it (logs, spools, metrics)")
    p.add_argument("--memory", action="store_true",
                   help="in-memory broker storage (faster; sigkill-broker needs durable storage)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    results: list[Result] = []
    failed = False
    scratch = (contextlib.nullcontext(str(args.keep)) if args.keep
               else tempfile.TemporaryDirectory(prefix="boltstream-chaos-"))
    with scratch as tmp, embedded_stack(tmp, durable=not args.memory) as base:
        for i, name in enumerate(names):
            settings = dataclasses.replace(base, namespace=f"chaos{i}.")
            env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
            env.update(settings_env(settings, base.state_file), XDG_STATE_HOME=str(Path(tmp) / name / "state"))
            try:
                run_sync(ensure_topics(settings))
                s3.ensure_bucket(s3.make_client(settings), settings.s3_bucket)
                run = run_agent_scenario if name in AGENT_SCENARIOS else run_scenario
                result = asyncio.run(run(name, settings, env, Path(tmp) / name, tasks=args.tasks))
            except Exception as exc:  # report the scenario as failed, go on with the others
                print(f"{name}: FAILED: {str(exc)[:2000]}", flush=True)
                failed = True
                continue
            results.append(result)
            print(f"{result.row()}  ({result.seconds:.0f}s)", flush=True)
            failed |= bool(result.lost or result.duplicated or result.unexpected or result.dead_letters != result.poison)
    print(HEADER)
    for r in results:
        print(r.row())
    full = set(names) == set(SCENARIOS)
    command = "make chaos" if full else " ".join(["benchmarks/chaos.py", *sys.argv[1:]])
    write_table(args.out, results, command, full=full)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
