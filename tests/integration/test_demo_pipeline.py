"""``boltstream demo`` end to end with a tiny random model: every component is a real process.

The runner-driven pipeline's full assertions (warmup, staleness, reloads, summary) run on the
TLS stack in test_secure_pipeline.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from boltstream.runs.pipeline import read_jsonl


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
