"""benchmarks/agent_suite.py's table from run summaries on disk: rows per agent, system and seed, the paired
significance mark, and the command line each boltstream run is, as a user types it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_script("demo_seeds")  # agent_suite imports it as the benchmarks folder's sibling
suite = _script("agent_suite")


def summary(before: float, after: float, improvement_se: float, steps: int = 8) -> dict[str, Any]:
    return {"before": {"score": before, "samples_per_task": 4}, "after": {"score": after}, "improvement": after - before,
            "improvement_se": improvement_se, "learner_steps": steps, "wall_s": 120.0, "train_s": 80.0}


def test_the_table_holds_every_summary_found(tmp_path: Path) -> None:
    runs = {("extract", "boltstream-0"): summary(0.25, 0.5, 0.05), ("extract", "trl-0"): summary(0.25, 0.3, 0.05),
            ("extract", "boltstream[demo]-1"): summary(0.2, 0.2, 0.0)}
    for (agent, run), data in runs.items():
        (tmp_path / agent / run).mkdir(parents=True)
        (tmp_path / agent / run / "summary.json").write_text(json.dumps(data))
    trl = json.loads((tmp_path / "extract" / "trl-0" / "summary.json").read_text())
    (tmp_path / "extract" / "trl-0" / "summary.json").write_text(json.dumps({**trl, "versions": {"trl": "1.16.0"}}))
    assert suite.versions(tmp_path) == {"trl": "1.16.0"}
    assert suite.table([], "m", suite.versions(tmp_path)).endswith("Machine: m. Versions: trl 1.16.0.")
    rows = suite.collect(tmp_path)
    assert [(r.system, r.seed) for r in rows] == [("boltstream", 0), ("boltstream[demo]", 1), ("trl", 0)]
    assert [r.significant for r in rows] == [True, False, False]  # +0.25 is 5 SE; +0.05 is 1 SE
    text = suite.table(rows, "a machine")
    assert "| extract | boltstream | 0 | 0.250 | 0.500 | +0.250 ± 0.050 (5.0 SE) ✓ | 8 | 120 s | 10.0 s |" in text
    assert "(no spread)" in text and "Machine: a machine." in text
    assert "Each held-out task attempted 4 times before and after." in text


def test_side_by_side_compares_the_seeds_both_systems_ran() -> None:
    def r(system: str, seed: int, improvement: float, step_s: float) -> Any:
        return suite.Row("choose", system, seed, 0.2, 0.2 + improvement, improvement, 0.05, 8, 100.0, step_s)

    rows = [r("boltstream", 0, 0.10, 10.0), r("boltstream", 1, 0.30, 12.0), r("boltstream", 2, 0.9, 11.0),
            r("trl", 0, 0.20, 30.0), r("trl", 1, 0.10, 36.0), r("boltstream[lr]", 0, 0.5, 1.0)]
    lines = suite.side_by_side(rows)
    # seeds 0 and 1 only (TRL never ran seed 2; other settings are not "boltstream"): means 0.2 and 0.15,
    # differences -0.1 and +0.2 -> mean +0.05, SE = sd / sqrt(2) = 0.2121 / 1.414 = 0.15; s/step 11 vs 33
    assert lines[-1] == "| choose | 0,1 | +0.200 | +0.150 | +0.050 ± 0.150 | 11.0 s / 33.0 s (3.0x) |"
    assert suite.side_by_side([r("trl", 0, 0.2, 30.0), r("boltstream", 1, 0.2, 10.0)]) == []
    one = suite.side_by_side([r("trl", 0, 0.2, 30.0), r("boltstream", 0, 0.25, 10.0)])[-1]
    assert "| +0.050 |" in one  # one seed: no spread to show
    assert "| boltstream − TRL |" in suite.table(rows, "m")


def test_each_boltstream_run_is_the_train_command_at_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(suite.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or type("P", (), {"returncode": 0}))
    sql = next(a for a in suite.SUITE if a.name == "sql")
    assert suite.run_boltstream(sql, 1, 8, tmp_path / "run", 4, ["--lr", "1e-3"]) == 0
    cmd = ran[0]
    assert cmd[:len(suite.INSTRUMENT)] == list(suite.INSTRUMENT)  # its roles' spans need the instrumentation
    assert cmd[cmd.index("train") + 1:][:2] == ["--agent", "boltstream.examples.sql.agent:solve"]
    assert cmd[cmd.index("--eval-samples") + 1] == "4"  # both systems score each held-out task as often
    assert cmd[-2:] == ["--lr", "1e-3"] and "--roles" in cmd and (tmp_path / "run" / "data" / "train.jsonl").is_file()


def test_the_sql_split_is_written_whole_for_train_to_take_again(tmp_path: Path) -> None:
    sql = next(a for a in suite.SUITE if a.name == "sql")  # its 30 COUNT questions: `train` repeats them
    train, test = suite.write_tasks(sql, 0, tmp_path)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 30 and {r["kind"] for r in rows} <= set(suite.SQL_KIND_SETS["counts"])
    assert len(test.read_text().splitlines()) == 14
