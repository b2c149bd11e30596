"""``boltstream tasks publish``: good lines reach the topic keyed by task id; bad lines are reported by number."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boltstream.config import Settings


def test_publish_reports_bad_lines_and_publishes_the_rest(
        settings: Settings, run_cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path,
        helpers: Any) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([
        json.dumps({"id": "q1", "question": "2+2?"}),
        "{broken json",
        json.dumps({"id": "q2", "question": "3+3?"}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"id": "q1", "question": "duplicate"}),
        json.dumps({"id": 3, "question": "integer ids are fine"}),
    ]) + "\n")
    proc = run_cli("tasks", "publish", str(data), "--split", "train", "--group-size", "2")
    assert proc.returncode == 1, proc.stderr
    assert f"{data}:2: invalid JSON" in proc.stderr
    assert f"{data}:4: a task must be a JSON object" in proc.stderr
    assert f"{data}:5: duplicate task id 'q1' (first on line 1)" in proc.stderr
    assert "3 bad line(s)" in proc.stderr and "published 3 tasks" in proc.stdout
    recs = helpers.read_topic(settings, "tasks", "Task", count=3)
    by_id = {r["task_id"]: (key, r) for _, key, r in recs}
    assert set(by_id) == {"q1", "q2", "3"}
    key, q1 = by_id["q1"]
    assert key == b"q1" and q1["split"] == "train" and q1["group_size"] == 2
    assert json.loads(q1["payload_json"]) == {"id": "q1", "question": "2+2?"}


def test_strict_and_dry_run_publish_nothing(
        settings: Settings, run_cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path,
        helpers: Any) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"id": "a"}\n{"id": ""}\n')
    strict = run_cli("tasks", "publish", str(data), "--strict")
    assert strict.returncode == 1 and "not published (--strict)" in strict.stdout
    assert f"{data}:2: 'id' is empty" in strict.stderr
    data.write_text('{"id": "a"}\n')
    dry = run_cli("tasks", "publish", str(data), "--dry-run")
    assert dry.returncode == 0 and "1 valid, 0 bad; dry run" in dry.stdout
    assert helpers.read_topic(settings, "tasks", "Task", count=1, timeout=2) == []
    missing = run_cli("tasks", "publish", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2
