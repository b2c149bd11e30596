"""Pure parts of the runner side: offset tracking, task validation, agent loading and time limits."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from boltstream.errors import ConfigError
from boltstream.producers.agent import AgentInvoker, load_agent, wants_context
from boltstream.producers.consuming import CommitTracker
from boltstream.producers.context import RolloutContext, RolloutTimeout
from boltstream.producers.runner import RunnerConfig
from boltstream.producers.tasks import read_rows, validate


def test_only_the_contiguous_finished_prefix_is_committable() -> None:
    t: CommitTracker[str] = CommitTracker()
    e = {o: t.start("p0", o) for o in (5, 6, 7, 9)}
    assert t.committable() == {}
    t.finish(e[6])
    t.finish(e[9])
    assert t.committable() == {}, "offset 5 still runs"
    t.finish(e[5])
    assert t.committable() == {"p0": 7}
    assert t.in_flight() == 1 and t.pending() == 2
    t.finish(e[7])
    assert t.committable() == {"p0": 10}
    assert t.committable() == {}


def test_refetched_offsets_are_not_dispatched_twice() -> None:
    t: CommitTracker[str] = CommitTracker()
    a = t.start("p", 0)
    assert t.start("p", 0) is None, "still in flight"
    t.finish(a)
    t.committable()
    assert t.start("p", 0) is None, "already done and committed here"
    assert t.start("p", 1) is not None


def test_forgotten_partitions_orphan_their_entries() -> None:
    t: CommitTracker[str] = CommitTracker()
    old = t.start("p", 3)
    assert t.forget(["p"]) == 1
    new = t.start("p", 3)
    assert new is not None
    t.finish(old)  # the old run finishing must not commit the new one
    assert t.committable() == {}
    t.finish(new)
    assert t.committable() == {"p": 4}


def test_task_validation_reports_every_bad_line(tmp_path: Path) -> None:
    lines = [
        '{"id": "a", "q": 1}',
        "not json",
        "[1, 2]",
        "",
        '{"id": "a", "q": 2}',
        '{"id": {"x": 1}}',
        '{"id": ""}',
        '{"id": 7}',
        '{"q": "no id"}',
        '{"q": "no id"}',
        '{"id": true}',
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    good, bad = validate(read_rows(path), "id")
    assert [(g.line, g.task_id) for g in good][:2] == [(1, "a"), (8, "7")]
    assert len(good) == 3 and len(good[2].task_id) == 16, "content-hash id for a task without one"
    assert {b.line for b in bad} == {2, 3, 5, 6, 7, 10, 11}
    reasons = {b.line: b.reason for b in bad}
    assert "invalid JSON" in reasons[2] and "duplicate task id 'a' (first on line 1)" in reasons[5]
    assert json.loads(good[0].payload_json) == {"id": "a", "q": 1}


def test_task_validation_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="Parquet task files need pyarrow, which only the [dev] extra installs")
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": ["x", "y", "x"], "q": [1, 2, 3]}), path)
    good, bad = validate(read_rows(path), "id")
    assert [g.task_id for g in good] == ["x", "y"] and [b.line for b in bad] == [3]


def test_validation_rejects_oversized_tasks() -> None:
    good, bad = validate(iter([(1, {"id": "big", "x": "y" * 5000})]), max_bytes=1000)
    assert not good and "larger than" in bad[0].reason


def test_load_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_agent_mod.py").write_text("def run(task, ctx):\n    return 1\ndef one(task):\n    return 2\n")
    monkeypatch.chdir(tmp_path)
    fn = load_agent("my_agent_mod:run")
    assert wants_context(fn) and not wants_context(load_agent("my_agent_mod:one"))
    assert load_agent(str(tmp_path / "my_agent_mod.py") + ":one")({}) == 2
    for bad in ("nocolon", "my_agent_mod:missing", "no_such_module_xyz:f"):
        with pytest.raises(ConfigError):
            load_agent(bad)


def _ctx() -> RolloutContext:
    return RolloutContext(rollout_id="r", attempt_id="t:0", task_id="t")


def test_invoker_sync_async_and_time_limits() -> None:
    release = threading.Event()

    def hangs(task: dict[str, Any]) -> int:
        release.wait(10)
        return 0

    async def slow(task: dict[str, Any], ctx: RolloutContext) -> int:
        await asyncio.sleep(10)
        return 0

    async def fine(task: dict[str, Any], ctx: RolloutContext) -> str:
        return ctx.attempt_id

    async def main() -> None:
        assert await AgentInvoker(fine, 1, 1)({}, _ctx(), 1.0) == "t:0"
        assert await AgentInvoker(lambda task: task["x"] * 2, 1, 1)({"x": 2}, _ctx(), 1.0) == 4
        inv = AgentInvoker(hangs, 1, 0)
        started = time.monotonic()
        with pytest.raises(RolloutTimeout, match="abandoned"):
            await inv({}, _ctx(), 0.2)
        assert time.monotonic() - started < 2 and inv.abandoned == 1 and inv.over_limit()
        release.set()
        deadline = time.monotonic() + 5
        while inv.abandoned and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert inv.abandoned == 0, "a released thread gives its slot back"
        inv.shutdown()
        with pytest.raises(RolloutTimeout, match="cancelled"):
            await AgentInvoker(slow, 1, 1)({}, _ctx(), 0.1)
        with pytest.raises(KeyError):
            await AgentInvoker(lambda task: task["missing"], 1, 1)({}, _ctx(), 1.0)

    asyncio.run(main())


def test_runner_config_validation() -> None:
    with pytest.raises(ConfigError):
        RunnerConfig()
    with pytest.raises(ConfigError):
        RunnerConfig(agent="m:f", workers=0)
    cfg = RunnerConfig(agent="m:f", workers=8, group_size=4)
    assert cfg.inflight_limit == 3 and cfg.group == "boltstream.runners"
    # a second pass reads the tasks again in a group of its own, unless told which group
    assert RunnerConfig(agent="m:f", run_id="p2").group == "boltstream.runners.p2"
    assert RunnerConfig(agent="m:f", run_id="p2", group_id="g").group == "g"


def test_runner_metrics_count_attempts_by_status() -> None:
    import urllib.request

    from boltstream.producers.runner import Runner

    def agent(task: dict[str, Any]) -> str:
        if task.get("fail"):
            raise ValueError("no")
        return "ok"

    runner = Runner(RunnerConfig(agent="x:y", workers=2), agent=agent)

    async def go() -> None:
        await asyncio.gather(runner._attempt("t1", {}, 0), runner._attempt("t2", {"fail": True}, 0))

    try:
        asyncio.run(go())
        m = runner.metrics
        assert m.attempts.labels("ok")._value.get() == 1
        assert m.attempts.labels("failed")._value.get() == 1
        assert m.attempts.labels("timeout")._value.get() == 0
        assert m.running._value.get() == 0
        port = m.serve("127.0.0.1", 0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'boltstream_runner_attempts_total{status="failed"} 1.0' in text
        assert "boltstream_runner_attempts_running 0.0" in text
    finally:
        runner.metrics.close()
        runner.invoker.shutdown()
    with pytest.raises(ConfigError, match="metrics_port"):
        RunnerConfig(agent="x:y", metrics_port=-1)
