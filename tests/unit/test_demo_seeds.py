"""benchmarks/demo_seeds.py without running a demo: rows, the mean row and the README block, from
summary dicts shaped like the ones ``boltstream.runs.train.run`` writes. Expected cells are worked out
by hand in the comments."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from boltstream.runs.pipeline import PipelineConfig, mean_and_se

README_ROW_0 = "| 0 | 0.188 ± 0.054 | 0.609 ± 0.077 | +0.422 ± 0.087 | 8 | 1,415 s | 2,430 MiB |"


def _script() -> Any:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_seeds.py"
    spec = importlib.util.spec_from_file_location("demo_seeds", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_seeds"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


seeds = _script()


def score(value: float, se: float, tasks: int = 32) -> dict[str, Any]:
    """An evaluation as ``pipeline.evaluate`` returns it."""
    return {"score": value, "se": se, "tasks": tasks, "samples_per_task": 2, "per_task": [value] * tasks}


def summary(before: dict, after: dict, improvement: float, improvement_se: float, *, seed: int | None = 0,
            steps: int = 8, wall_s: float = 1415.3, rss: float | None = 2430.4, budget: bool = False) -> dict:
    """A summary.json with the keys ``train.run`` writes, in its order."""
    return {
        "settings": {"steps": "8"}, "stream": {"group_size": 4},
        "learner": {"lr": 0.001, "seed": seed} if seed is not None else {"lr": 0.001},
        "before": before, "stopped_by_time_budget": budget, "train_s": wall_s - 300,
        "learner_steps": steps, "learner_peak_rss_mb": rss, "policy_version_served": steps,
        "after": after, "wall_s": wall_s, "improvement": improvement, "improvement_se": improvement_se,
        "machine": MACHINE, "serve_dtype_resolved": "float32",
    }


MACHINE = {"cpu": "Some Xeon", "cores": 2, "native_bf16": False, "flags": ["avx2", "avx512f"]}


SEED_0 = summary(score(0.188, 0.054), score(0.609, 0.077), 0.422, 0.087)
SEED_1 = summary(score(0.25, 0.05), score(0.251, 0.06), 0.001, 0.04, seed=1, steps=6, wall_s=1501.0, rss=None,
                 budget=True)


def test_a_row_is_the_readmes_format() -> None:
    assert seeds.row(seeds.seed_result(SEED_0, "x")) == README_ROW_0
    # a run the time budget cut short says so; no RSS reading is a dash
    assert seeds.row(seeds.seed_result(SEED_1, "x")) == (
        "| 1 | 0.250 ± 0.050 | 0.251 ± 0.060 | +0.001 ± 0.040 | 6 (time budget) | 1,501 s | – |")


def test_the_row_of_a_summary_built_by_the_runs_own_code(tmp_path: Path) -> None:
    """Scores from ``pipeline.mean_and_se`` over per-task scores, the learner settings from a real config."""
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text("{}\n")
    cfg = PipelineConfig(agent="m:f", train=tmp_path / "train.jsonl", test=tmp_path / "test.jsonl", out=tmp_path,
                         learner={"seed": 3, "lr": 1e-3})
    before, after = [0.0, 0.5, 0.5, 1.0], [1.0, 1.0, 0.5, 1.0]
    s = summary({"score": 0, "se": 0}, {"score": 0, "se": 0}, 0, 0)
    s["learner"] = cfg.learner_config().to_dict()
    s["before"]["score"], s["before"]["se"] = mean_and_se(before)  # 0.5, sqrt(0.5 / 3 / 4) = 0.204
    s["after"]["score"], s["after"]["se"] = mean_and_se(after)  # 0.875, sqrt(0.1875 / 3 / 4) = 0.125
    # diffs 1, 0.5, 0, 0: 0.375, sqrt(0.6875 / 3 / 4) = 0.239
    s["improvement"], s["improvement_se"] = mean_and_se([a - b for a, b in zip(after, before, strict=True)])
    result = seeds.seed_result(json.loads(json.dumps(s)), "folder")
    assert seeds.row(result) == "| 3 | 0.500 ± 0.204 | 0.875 ± 0.125 | +0.375 ± 0.239 | 8 | 1,415 s | 2,430 MiB |"
    assert result.significant is False  # 0.375 < 3 x 0.239


def test_mean_row_averages_over_seeds_and_counts_the_significant_ones() -> None:
    results = [seeds.seed_result(SEED_0, "x"), seeds.seed_result(SEED_1, "x")]
    # before (0.188 + 0.25) / 2 = 0.219, SE across two seeds = |difference| / 2 = 0.031;
    # after (0.609 + 0.251) / 2 = 0.430 ± 0.179; improvement (0.422 + 0.001) / 2 = 0.2115 ± 0.2105;
    # seed 0: 0.422 > 3 x 0.087, seed 1: 0.001 < 3 x 0.04; steps (8 + 6) / 2; wall 1458.15; the larger RSS
    assert seeds.mean_row(results) == (
        "| mean of 2 | 0.219 ± 0.031 | 0.430 ± 0.179 | +0.211 ± 0.210 (1/2 seeds > 3 SE) | 7 | 1,458 s | 2,430 MiB |")
    lines = seeds.table(results).splitlines()
    assert lines[:2] == seeds.HEADER.splitlines()
    assert lines[2] == README_ROW_0 and lines[4].startswith("| mean of 2 |")
    assert lines[5] == "" and lines[6].startswith("Mean row: ")
    # what the numbers depend on: the serving dtype and the CPU's native bf16
    served = "Served in float32 on Some Xeon, 2 cores, native bf16 no (flags: avx2 avx512f)."
    assert lines[7:] == ["", served]
    assert seeds.table(results[:1]).splitlines() == [*seeds.HEADER.splitlines(), README_ROW_0, "", served]
    old = seeds.seed_result({k: v for k, v in SEED_0.items() if k not in ("machine", "serve_dtype_resolved")}, "x")
    assert seeds.table([old]).splitlines()[-1] == "Served in not recorded on not recorded."


def test_the_seed_falls_back_to_the_run_folder() -> None:
    assert seeds.seed_result(summary(score(0.1, 0.01), score(0.2, 0.01), 0.1, 0.01, seed=None), "7").seed == "7"


@pytest.mark.parametrize(("broken", "message"), [
    ({k: v for k, v in SEED_0.items() if k != "after"}, "no after.score (did the run finish?)"),
    ({**SEED_0, "improvement_se": "0.1"}, "improvement_se is '0.1', not a number"),
    ({**SEED_0, "learner_steps": None}, "learner_steps is None, not a number"),
])
def test_an_unfinished_summary_names_what_it_lacks(broken: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(f'out/seeds/2/summary.json: {message}')}$"):
        seeds.seed_result(broken, "2", "out/seeds/2/summary.json")


def test_replace_block_swaps_what_lies_between_the_markers() -> None:
    text = f"intro\n\n{seeds.BEGIN}\n| old |\n{seeds.END}\n\nmore\n"
    new = seeds.replace_block(text, "| new |\n| rows |")
    assert new == f"intro\n\n{seeds.BEGIN}\n| new |\n| rows |\n{seeds.END}\n\nmore\n"
    assert seeds.replace_block(new, "| new |\n| rows |") == new
    for bad in ("no markers", f"{seeds.END}\n{seeds.BEGIN}", f"{seeds.BEGIN}\n{seeds.BEGIN}\n{seeds.END}"):
        with pytest.raises(ValueError, match="README.md: needs exactly one"):
            seeds.replace_block(bad, "x")


def test_the_repositorys_readme_has_the_markers() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme[readme.index(seeds.BEGIN):readme.index(seeds.END)]
    assert seeds.HEADER in block


def test_summaries_mode_writes_the_results_and_the_readme(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for seed, s in ((0, SEED_0), (1, SEED_1)):
        (tmp_path / "seeds" / str(seed)).mkdir(parents=True)
        (tmp_path / "seeds" / str(seed) / "summary.json").write_text(json.dumps(s))
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{seeds.BEGIN}\nold\n{seeds.END}\nafter\n")
    rc = seeds.main(["--summaries", str(tmp_path / "seeds" / "0"), str(tmp_path / "seeds" / "1" / "summary.json"),
                     "--results", str(tmp_path / "results"), "--readme", str(readme), "--update-readme"])
    assert rc == 0
    table = seeds.table([seeds.seed_result(SEED_0, "0"), seeds.seed_result(SEED_1, "1")])
    assert table in capsys.readouterr().out
    assert readme.read_text() == f"before\n{seeds.BEGIN}\n{table}\n{seeds.END}\nafter\n"
    assert (tmp_path / "results" / "demo_seeds.md").read_text().endswith(f"\n\n{table}\n")
    saved = json.loads((tmp_path / "results" / "demo_seeds.json").read_text())
    assert [s["seed"] for s in saved["seeds"]] == ["0", "1"] and [s["significant"] for s in saved["seeds"]] == [True,
                                                                                                               False]
    assert saved["mean"]["after"] == pytest.approx(0.43) and saved["mean"]["significant"] == 1


def test_a_missing_run_leaves_the_readme_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps(SEED_0))
    readme = tmp_path / "README.md"
    readme.write_text(f"{seeds.BEGIN}\nold\n{seeds.END}\n")
    rc = seeds.main(["--summaries", str(tmp_path / "0"), str(tmp_path / "1"), "--results", str(tmp_path / "r"),
                     "--readme", str(readme), "--update-readme"])
    assert rc == 1
    assert readme.read_text() == f"{seeds.BEGIN}\nold\n{seeds.END}\n"
    err = capsys.readouterr().err
    assert f"not in the table: {tmp_path / '1' / 'summary.json'}: cannot read it" in err


def test_update_readme_without_markers_fails_before_any_run(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no table here\n")
    with pytest.raises(SystemExit) as exc:  # argparse's error: exit 2, before a single demo would start
        seeds.main(["--seeds", "0", "--readme", str(readme), "--update-readme", "--results", str(tmp_path)])
    assert exc.value.code == 2


@pytest.mark.parametrize("bad", ["0,x", "", "1,1"])
def test_seeds_must_be_distinct_integers(bad: str) -> None:
    with pytest.raises(SystemExit):
        seeds.main(["--seeds", bad, "--summaries", "x"])
