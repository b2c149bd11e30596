"""The demo's pipeline end to end with a tiny random model: every component is a real process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from boltstream.examples.calc.tasks import train_test
from boltstream.runs.demo import CALC_AGENT, CALC_AIR_RULES
from boltstream.runs.pipeline import PipelineConfig, read_jsonl
from boltstream.runs.train import run


def test_two_learner_steps_reach_the_worker(tmp_path: Path) -> None:
    train, test = train_test(n_train=8, n_test=2, seed=3)
    for name, tasks in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    cfg = PipelineConfig(
        agent=CALC_AGENT, train=tmp_path / "train.jsonl", test=tmp_path / "test.jsonl",
        out=tmp_path / "out", model="tiny", lora=True, group_size=2, steps=2,
        time_budget_s=400, runner_workers=4, eval_samples=1, tasks_per_version=2,
        learner={"groups_per_step": 2, "lr_warmup_steps": 2},
        stream={"air_rules_file": CALC_AIR_RULES},
        extra_env=(("CALC_TEMPERATURE", "1.0"),),
    )
    summary = run(cfg)

    steps = [r for r in read_jsonl(cfg.out / "metrics.jsonl") if r.get("event") == "step"]
    assert [r["step"] for r in steps][:2] == [1, 2]
    assert all(r["samples"] > 0 for r in steps)
    assert steps[0]["lr"] * 2 == steps[1]["lr"] == cfg.learner_config().lr  # --lr-warmup-steps 2 reached it
    # paced runner: 2 tasks per policy version, so each step trained on the version just served
    assert all(set(r["staleness"]) == {"0"} for r in steps)
    # the worker reloaded the learner's checkpoints: the served policy version moved on
    assert summary["policy_version_served"] >= 2
    # adapters on every linear layer (the learner's default), MLP included
    learner_config = (cfg.out / "logs" / "learner.log").read_text().split("learner config:")[1].splitlines()[0]
    assert "'gate_proj', 'up_proj', 'down_proj'" in learner_config
    assert "std_normalize=False" in (cfg.out / "logs" / "stream.log").read_text()  # the stream app's default
    assert abs(summary["improvement"] - (summary["after"]["score"] - summary["before"]["score"])) < 1e-9
    assert summary["improvement_se"] >= 0
    assert (cfg.out / "curve.png").stat().st_size > 0
    saved = json.loads((cfg.out / "summary.json").read_text())
    assert {"before", "after"} <= saved.keys() and "se" in saved["after"]


def test_zero_code_demo_trains_a_standalone_agent(tmp_path: Path, boltstream_cmd: list[str]) -> None:
    """``boltstream demo --zero-code`` as typed: the calculator agent as a program under
    ``opentelemetry-instrument``, no runner and no task ids, its rewards sent back as feedback by
    completion id; the stream app groups attempts by their first prompt and the learner steps."""
    out = tmp_path / "zc"
    proc = subprocess.run([*boltstream_cmd, "demo", "--zero-code", "--model", "tiny", "--steps", "2", "--no-live",
                           "--eval-tasks", "2", "--eval-samples", "1", "--time-budget", "300", "--out", str(out)],
                          capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "step"]
    assert [r["step"] for r in steps][:2] == [1, 2] and all(r["samples"] > 0 for r in steps)
    assert not (out / "logs" / "runner.log").exists(), "no runner in a zero-code run"
    counters = [line for line in (out / "logs" / "stream.log").read_text().splitlines() if "stream counters" in line]
    assert "'rollout.dropped_calls': 0" in counters[-1], counters[-1]
    assert "refused" not in (out / "logs" / "agent.log").read_text(), "every feedback was accepted (202)"
    assert json.loads((out / "summary.json").read_text())["learner_peak_rss_mb"] > 0
