"""Acceptance: ``boltstream runner`` processes in one group against real topics.

What "no attempt ran twice" can mean with at-least-once: a task whose offset
was committed is never run again; a task that was IN FLIGHT in a runner when
it was SIGKILLed is run again by whoever gets its partition, with the SAME
deterministic attempt ids, so downstream dedupe by attempt id counts it once.
So we assert: every (task, attempt) completed; any attempt completed twice had
one completion in the killed process; duplicates never differ in ids; and the
spans topic holds one successful root span per attempt id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from boltstream.broker.kafka import producer_kwargs
from boltstream.config import Settings
from boltstream.producers.context import ROLLOUT_NAMESPACE
from boltstream.stack import run_sync

AGENT = '''
import json, os, threading, time

LOG = os.environ["ATTEMPT_LOG"]


def _log(ctx, status):
    line = json.dumps({"task": ctx.task_id, "attempt": ctx.attempt, "attempt_id": ctx.attempt_id,
                       "rollout_id": ctx.rollout_id, "pid": os.getpid(), "status": status})
    with open(LOG, "a") as fh:  # one short O_APPEND write per line: safe across processes
        fh.write(line + "\\n")


def agent(task, ctx):
    time.sleep(task.get("sleep", 0.15))
    _log(ctx, "done")
    return 1.0


def tricky(task, ctx):
    kind = task["kind"]
    if kind == "raise":
        raise ValueError("boom " + ctx.task_id)
    if kind == "hang":
        threading.Event().wait(60)  # a hung tool call; the runner must give up on it
    if kind == "text":
        return "not a number"
    return 0.5
'''


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ok_roots(records: list[Any]) -> set[str]:
    """Attempt ids with a successful root span among (key, headers, span) records."""
    return {r["attempt_id"] for _, _, r in records
            if r["name"] == "boltstream.rollout" and r["attributes"]["boltstream.status"] == "ok"}


def start_runner(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        return subprocess.Popen([*cmd, "runner", *args], env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def test_two_runners_kill_one_and_restart(settings: Settings, settings_env: dict[str, str], tmp_path: Path,
                                          boltstream_cmd: list[str],
                                          run_cli: Callable[..., subprocess.CompletedProcess[str]],
                                          helpers: Any) -> None:
    group, tasks = 3, 20
    (tmp_path / "runner_agent.py").write_text(AGENT)
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i:02d}", "sleep": 0.15}) + "\n" for i in range(tasks)))
    assert run_cli("tasks", "publish", str(data)).returncode == 0
    attempts_log = tmp_path / "attempts.jsonl"
    env = dict(settings_env, ATTEMPT_LOG=str(attempts_log), PYTHONPATH=str(tmp_path))
    args = ("--agent", "runner_agent:agent", "--workers", "3", "--group-size", str(group),
            "--rollout-timeout-s", "30", "--revoke-grace-s", "3", "--base-url", "http://127.0.0.1:9/v1")
    logs = [tmp_path / f"runner{i}.log" for i in range(3)]
    a = start_runner(boltstream_cmd, env, tmp_path, logs[0], *args)
    b = start_runner(boltstream_cmd, env, tmp_path, logs[1], *args)
    restarted = None
    try:
        helpers.poll(lambda: sum(1 for r in read_log(attempts_log) if r["pid"] == b.pid) >= 3
                     and len(read_log(attempts_log)) >= 12, 90, "both runners to make progress")
        b.send_signal(signal.SIGKILL)
        b.wait(timeout=10)
        restarted = start_runner(boltstream_cmd, env, tmp_path, logs[2], *args)
        expected = {(f"t{i:02d}", k) for i in range(tasks) for k in range(group)}
        wanted = {f"{t}:{k}" for t, k in expected}
        helpers.poll(lambda: expected <= {(r["task"], r["attempt"]) for r in read_log(attempts_log)}, 120,
                     "every attempt of every task to complete")
        # An attempt the killed runner logged may have lost its spans with it; its task's offset was not
        # committed, so it runs again once the group hands its partition on. Done means its spans are out.
        roots = helpers.read_topic(settings, "spans", "Span", until=lambda recs: ok_roots(recs) >= wanted,
                                   timeout=120)
    finally:
        codes = [helpers.stop_process(p) for p in (a, restarted) if p is not None]
        helpers.stop_process(b, signal.SIGKILL)
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]

    done = read_log(attempts_log)
    assert {(r["task"], r["attempt"]) for r in done} == expected
    runs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in done:
        runs[(r["task"], r["attempt"])].append(r)
    for (task, attempt), rs in runs.items():
        assert {r["attempt_id"] for r in rs} == {f"{task}:{attempt}"}
        assert {r["rollout_id"] for r in rs} == {str(uuid.uuid5(ROLLOUT_NAMESPACE, f"{task}:{attempt}"))}
        if len(rs) > 1:
            assert any(r["pid"] == b.pid for r in rs), f"{task}:{attempt} ran twice without a crash: {rs}"
            assert sum(1 for r in rs if r["pid"] != b.pid) == 1, f"{task}:{attempt} re-run more than once"
    twice = {k for k, rs in runs.items() if len(rs) > 1}
    assert len({t for t, _ in twice}) <= 3, f"only tasks in flight at the kill may re-run: {sorted(twice)}"
    pids = Counter(r["pid"] for r in done)
    assert pids[a.pid] > 0 and pids[b.pid] > 0, "both runners took a share of the work"

    assert ok_roots(roots) == wanted, "deduped by attempt id: one successful rollout each"


def test_failing_hanging_and_undecodable(settings: Settings, settings_env: dict[str, str], tmp_path: Path,
                                         boltstream_cmd: list[str], helpers: Any,
                                         run_cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    (tmp_path / "runner_agent.py").write_text(AGENT)
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"id": k, "kind": k}) + "\n" for k in ("raise", "hang", "text", "fine")))

    async def garbage() -> None:  # a record no Task decoder accepts, straight onto the topic
        producer = AIOKafkaProducer(**producer_kwargs(settings))
        await producer.start()
        try:
            await producer.send_and_wait(settings.topic("tasks"), b"\x00garbage", key=b"junk")
        finally:
            await producer.stop()

    run_sync(garbage())
    assert run_cli("tasks", "publish", str(data), "--group-size", "1").returncode == 0
    env = dict(settings_env, ATTEMPT_LOG=str(tmp_path / "attempts.jsonl"), PYTHONPATH=str(tmp_path))
    log = tmp_path / "runner.log"
    proc = start_runner(boltstream_cmd, env, tmp_path, log, "--agent", "runner_agent:tricky", "--workers", "4",
                        "--rollout-timeout-s", "2", "--exit-when-idle-s", "3")
    try:
        code = proc.wait(timeout=90)
    finally:
        helpers.stop_process(proc, signal.SIGKILL)
    assert code == 3, f"a hung agent thread is reported by exit status 3:\n{log.read_text()[-3000:]}"
    recs = helpers.read_topic(settings, "spans", "Span", until=lambda rs: sum(
        1 for _, _, r in rs if r["name"] == "boltstream.rollout") >= 4, timeout=30)
    roots = {r["task_id"]: r for _, _, r in recs if r["name"] == "boltstream.rollout"}
    assert roots["raise"]["attributes"]["boltstream.status"] == "failed"
    assert roots["raise"]["attributes"]["boltstream.error"] == "ValueError: boom raise"
    assert roots["raise"]["status"]["code"] == "ERROR"
    assert roots["hang"]["attributes"]["boltstream.status"] == "timeout"
    assert "thread abandoned" in roots["hang"]["attributes"]["boltstream.error"]
    assert roots["text"]["attributes"]["boltstream.status"] == "ok"
    assert roots["fine"]["attributes"]["boltstream.status"] == "ok"
    rewards = {r["task_id"]: r["attributes"]["boltstream.reward.value"] for _, _, r in recs
               if r["name"] == "boltstream.reward"}
    assert rewards == {"fine": 0.5}, "failures, timeouts and non-numeric results never become rewards"
    dead = helpers.read_topic(settings, "dlq", "DeadLetter", count=1)
    assert len(dead) == 1 and dead[0][2]["component"] == "runner" and dead[0][2]["value"] == b"\x00garbage"
    assert "undecodable task" in dead[0][2]["reason"] and dead[0][1] == b"junk"
    assert os.path.exists(log)
