"""Acceptance: ``boltstream runner --run-id p2`` is a second pass over the same tasks with batches of its own.

Two passes of the CLI as typed over one tasks topic, a real ``boltstream serve --model tiny`` and a
stream worker: the second pass reads every task again (a consumer group of its own), its attempt ids
name the run, and the stream app forms its groups apart from the first pass's, so each pass yields
complete batches instead of the second arriving late to the first's groups.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boltstream.config import Settings
from boltstream.inference.launch import WorkerProcess
from tests.integration.streams.stream_helpers import WORKER_ENV
from tests.integration.streams.stream_helpers import WorkerProcess as StreamWorker

AGENT = '''
from openai import OpenAI


def agent(task, ctx):
    client = OpenAI(base_url=ctx.base_url, api_key="unused", default_headers=ctx.headers, max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": task["q"]}], max_tokens=3)
    return float(ctx.attempt)  # rewards that spread, so every group has non-zero advantages
'''
TASKS, GROUP = 2, 2


def test_a_run_id_second_pass_yields_its_own_complete_batches(
        settings: Settings, settings_env: dict[str, str], tmp_path: Path, boltstream_cmd: list[str],
        run_cli: Callable[..., Any], helpers: Any) -> None:
    (tmp_path / "pass_agent.py").write_text(AGENT)
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "q": f"question {i}"}) + "\n" for i in range(TASKS)))
    assert run_cli("tasks", "publish", str(data)).returncode == 0
    app_id = f"{settings.namespace}rp-{uuid.uuid4().hex[:6]}"
    stream = StreamWorker([*boltstream_cmd, "stream", "worker", "--app-id", app_id, "--group-size", str(GROUP)],
                          {**settings_env, **WORKER_ENV}, tmp_path / "stream.log")
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "512"], env=settings_env,
                           log_path=tmp_path / "worker.log")
    try:
        worker.start(90)
        env = {**settings_env, "PYTHONPATH": str(tmp_path)}
        for extra in ((), ("--run-id", "p2")):
            runner = run_cli("runner", "--agent", "pass_agent:agent", "--workers", "2", "--group-size", str(GROUP),
                             "--base-url", f"{worker.url}/v1", "--exit-when-idle-s", "4", "--spool-dir", "off",
                             *extra, env=env, timeout=180)
            assert runner.returncode == 0, runner.stderr[-3000:]
        batches = helpers.read_topic(settings, "batches", "TrainingBatch", count=2 * TASKS, timeout=90)
    finally:
        worker.stop()
        assert stream.stop() in (0, -15), stream.log_tail()
    by_pass: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for _, key, batch in batches:
        passes = {s["attempt_id"].split("/")[0] if "/" in s["attempt_id"] else "p1" for s in batch["samples"]}
        assert len(passes) == 1, f"one batch mixes passes: {[s['attempt_id'] for s in batch['samples']]}"
        assert batch["complete"], batch["group_id"]
        by_pass[passes.pop()].append(batch)
        assert key == batch["samples"][0]["task_id"].encode()  # batches stay keyed by task id
    assert sorted(by_pass) == ["p1", "p2"]
    for name, group in by_pass.items():
        attempts = sorted(s["attempt_id"] for b in group for s in b["samples"])
        prefix = "p2/" if name == "p2" else ""
        assert attempts == sorted(f"{prefix}t{t}:{k}" for t in range(TASKS) for k in range(GROUP)), attempts
        assert all(s["advantage"] != 0.0 for b in group for s in b["samples"])
