"""``boltstream demo`` end to end with a tiny random model: every component is a real process.

The runner-driven pipeline's full assertions (warmup, staleness, reloads, summary) run on the
TLS stack in test_secure_pipeline.py."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boltstream.config import DEFAULT_GROUP_SIZE
from boltstream.learner.config import LearnerConfig
from boltstream.runs.pipeline import read_jsonl
from tests.tracking_readers import mlflow_runs, tensorboard_scalars, wandb_run_file


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
    # benchmarks/demo_seeds.py reads a real demo's summary.json (its unit tests use hand-made ones)
    table = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "demo_seeds.py"),
                            "--summaries", str(out), "--results", str(tmp_path / "results")],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert table.returncode == 0, table.stderr[-3000:]
    assert table.stdout.splitlines()[2].startswith("| 0 | "), table.stdout


GROUPS_PER_STEP = LearnerConfig().groups_per_step
PROGRESS = re.compile(r"^boltstream demo \[(\d+):(\d\d)\] (.*?)(?: \| budget left \d+:\d\d)?$")


def test_piped_demo_prints_progress_lines_and_reports_to_trackers(tmp_path: Path, boltstream_cmd: list[str]) -> None:
    """``boltstream demo > file`` as typed: one flushed line per event (evaluation k of n attempts, step k of
    n with its reward, policy versions served), never a minute apart, read while the run goes on; and with
    ``--report-to`` the learner's steps, the held-out scores and each component's config land in
    TensorBoard, MLflow and W&B (offline) under the run's output."""
    out = tmp_path / "demo"
    stdout = tmp_path / "stdout.txt"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    argv = [*boltstream_cmd, "demo", "--model", "tiny", "--steps", "2", "--eval-tasks", "2", "--eval-samples", "2",
            "--time-budget", "300", "--out", str(out), "--report-to", "tensorboard,mlflow,wandb"]
    arrived: list[tuple[float, str]] = []
    started = time.monotonic()
    with open(stdout, "w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                                text=True)
        stderr = ""
        try:
            seen = 0
            while True:  # sample the file as it grows: the lines must be flushed as they are said
                try:
                    _, stderr = proc.communicate(timeout=2.0)
                    finished = True
                except subprocess.TimeoutExpired:
                    finished = False
                lines = stdout.read_text().splitlines()
                arrived += [(time.monotonic(), line) for line in lines[seen:] if PROGRESS.match(line)]
                seen = len(lines)
                if finished:
                    break
                assert time.monotonic() - started < 480, "the demo did not finish in 480 s"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr[-3000:]
    said = [PROGRESS.match(line).group(3) for _, line in arrived]  # type: ignore[union-attr]
    assert "evaluation before: 1 of 4 attempts" in said and "evaluation before: 4 of 4 attempts" in said, said
    assert "evaluation after: 4 of 4 attempts" in said, said
    steps = [s for s in said if re.match(r"step \d+ of", s)]
    assert [s.split(":")[0] for s in steps] == ["step 1 of 2", "step 2 of 2"], said
    # each step's time, split: the worker's generation (from its /metrics), the learner's compute, publishing
    step_times = [s for s in said if re.match(r"step \d+ time: ", s)]
    assert [s.split(" time")[0] for s in step_times] == ["step 1", "step 2"], said
    assert re.search(r"generate \d+\.\ds \(\d+% busy, decode batch \d+\.\d", step_times[1]), step_times
    assert all(" learn " in s and " publish " in s for s in step_times), step_times
    assert "ETA" in steps[0] and re.search(r"reward \d\.\d{3}", steps[0]), steps[0]
    assert any(re.fullmatch(r"checkpoint v\d+ served", s) for s in said), said
    times = [started, *(t for t, _ in arrived)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= 60.0, f"a progress gap of {max(gaps):.0f} s: {said}"
    elapsed = [int(m.group(1)) * 60 + int(m.group(2)) for m in map(PROGRESS.match, (line for _, line in arrived))]
    assert all(b - a <= 60 for a, b in zip(elapsed, elapsed[1:], strict=False)), elapsed

    _assert_the_run_reported(out)


def _assert_the_run_reported(out: Path) -> None:
    """A finished demo's records: the trackers' steps, held-out scores and configs (TensorBoard, MLflow, W&B),
    each step's timeline, the step plan the learner ran, and the tasks each step held."""
    summary = json.loads((out / "summary.json").read_text())
    tracking = out / "tracking"
    learner_tb = tensorboard_scalars(tracking / "tensorboard" / "policy")
    records = read_jsonl(out / "metrics.jsonl")
    rows = [r for r in records if r.get("event") == "step"]
    # the learner planned its step once, and the tiny model takes every fast path the demo asks for
    assert [(r["mode"], r["fallbacks"]) for r in records if r.get("event") == "plan"] == [("tree+shared-prefix", {})]
    assert [s for s, _ in learner_tb["reward_mean"]] == [r["step"] for r in rows] == [1, 2]
    pipeline_tb = tensorboard_scalars(tracking / "tensorboard" / "pipeline")
    final = summary["learner_steps"]
    assert pipeline_tb["held_out/score"] == [(0, pytest.approx(summary["before"]["score"])),
                                             (final, pytest.approx(summary["after"]["score"]))]
    runs = mlflow_runs(tracking / "mlruns")
    assert set(runs) == {"policy", "pipeline"}
    assert runs["pipeline"].data.params["learner/lr"] == "0.001"
    assert runs["pipeline"].data.metrics["held_out/improvement"] == pytest.approx(summary["improvement"])
    assert runs["policy"].data.params["groups_per_step"] == str(GROUPS_PER_STEP)
    assert [r["lr"] for r in rows] == [pytest.approx(1e-3)] * 2  # no warm-up: train's lr from the first step
    for r in rows:
        t = r["timeline"]
        assert t["window_s"] == pytest.approx(r["wall_seconds"]) and t["learner_compute_s"] == r["seconds"], t
        assert t["idle_s"] >= 0 and 0 <= t["worker_busy_share"] <= 1, t
    # the first step's window starts when the learner is ready (rollouts may have started before): the
    # second's holds the whole cycle, the first checkpoint's publish and the worker's reload included
    t = rows[1]["timeline"]
    assert t["generation_busy_s"] > 0 and t["decode_steps"] > 0 and t["decode_tokens"] > 0, t
    # at most every rollout of one version decodes at once (a loaded machine lets more of them overlap)
    assert 1.0 <= t["mean_decode_batch"] <= GROUPS_PER_STEP * DEFAULT_GROUP_SIZE and t["prefill_tokens"] > 0, t
    assert t["checkpoint_publish_s"] > 0 and t["reload_s"] > 0, t
    assert summary["step_time"]["decode_steps"] == sum(r["timeline"]["decode_steps"] for r in rows), summary
    # one partition: the runner takes the tasks in the file's order, so every step holds each operation equally
    ops = {t["id"]: t["op"] for t in read_jsonl(out / "data" / "train.jsonl")}
    for r in rows:
        held = collections.Counter(ops[b.split(":")[0]] for b in r["batch_ids"])
        assert sorted(held.values()) == [GROUPS_PER_STEP // 4] * 4, (r["step"], held)
    wandb_files = sorted((tracking / "wandb").glob("offline-run-*/run-*.wandb"))
    by_name = {run["name"]: run for run in map(wandb_run_file, wandb_files)}
    assert set(by_name) == {"policy", "pipeline"}
    assert by_name["pipeline"]["history"][0]["held_out/score"] == pytest.approx(summary["before"]["score"])
    assert sorted(by_name["policy"]["history"]) == [1, 2]
