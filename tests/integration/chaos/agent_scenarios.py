"""The chaos runner's agent-path scenarios: the load comes from agents, not from a span generator.

Processes (each a real ``boltstream`` subprocess): ``serve --model tiny`` (the inference worker,
capturing every completion as an LLM span, spooled), ``runner`` running ``chaos_agent.py`` (the
plain openai SDK against the worker; the runner's exporter, spooled, carries the rollout, reward
and client spans), two stream workers and the learner of chaos_scenarios.py. The tasks are
published with ``boltstream tasks publish``; the runner IS the load, so it is started last.

Reconciliation: every attempt (``<task>:<k>``) of every task makes ``calls`` LLM calls that got an
answer, so the learner must train exactly the sample ids ``<task>:<k>:<i>`` for ``i < calls``:
lost, duplicated and unexpected as in chaos_scenarios.reconcile. An unexpected id is a call the
agent never saw answered (an earlier incarnation's call, or one whose answer died with the worker)
trained as part of the rollout.

Scenarios (one fault each, landing while attempts still run):

* ``sigkill-runner``: SIGKILL the runner with attempts in flight, start it again (same spool). Its
  uncommitted tasks are run again with the same attempt ids (docs/producers.md, "The runner").
* ``sigkill-inference``: SIGKILL the inference worker while a call is in flight, start it again on
  the same port and spool; the agent's failed calls are tried again.
* ``s3-refused``: the learner and the inference worker reach S3 through a TCP proxy; it is closed
  (connections refused, open ones reset) from the learner's first step until 10 s into the
  checkpoint it publishes after step 2. The learner must retry the upload; the worker must keep
  answering with the version it had (its ``/health`` is read throughout).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from boltstream.broker.kafka import log_end_offsets
from boltstream.config import Settings
from boltstream.processes import free_port
from boltstream.runs.pipeline import worker_version
from tests.integration.chaos.chaos_scenarios import (
    GROUP,
    LEARNER,
    STREAM,
    Fault,
    Pipeline,
    Result,
    _mid_load,
    _recovered,
    count_dead_letters,
    reconcile,
    until,
)

AGENT_FILE = Path(__file__).with_name("chaos_agent.py")
INFERENCE, RUNNER = "inference", "runner"
RUNNER_WORKERS = 4


class S3Proxy:
    """A TCP proxy in front of the S3 endpoint that can refuse connections: closed, nothing listens on
    its port (a connect is refused at once) and the connections it carried are reset."""

    def __init__(self, target: str) -> None:
        url = urllib.parse.urlsplit(target)
        self.host, self.target_port = url.hostname or "127.0.0.1", url.port or 80
        self.port = free_port()
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()
            await asyncio.wait_for(server.wait_closed(), 10)
        for w in list(self.writers):
            w.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            self.writers.discard(writer)
            return
        self.writers.add(up_writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self.writers.difference_update((writer, up_writer))


class AgentPipeline(Pipeline):
    """Pipeline plus the inference worker and the runner; S3 through ``proxy`` for learner and worker."""

    def __init__(self, settings: Settings, env: dict[str, str], workdir: Path, tasks: int,
                 proxy: S3Proxy | None = None) -> None:
        super().__init__(settings, env, workdir, tasks)
        self.port = free_port()
        self.agent_log = workdir / "agent.jsonl"
        self.proxy = proxy

    def argv(self, name: str) -> list[str]:
        spool = self.workdir / "spool"
        if name == INFERENCE:
            return ["serve", "--model", "tiny", "--served-model-name", "policy", "--port", str(self.port),
                    "--spool-dir", str(spool / INFERENCE), "--workdir", str(self.workdir / INFERENCE)]
        if name == RUNNER:
            return ["runner", "--agent", f"{AGENT_FILE}:agent", "--workers", str(RUNNER_WORKERS), "--group-size",
                    str(GROUP), "--base-url", f"http://127.0.0.1:{self.port}/v1", "--spool-dir", str(spool / RUNNER)]
        if name == LEARNER:
            return [*super().argv(name), "--model-name", "policy"]
        return super().argv(name)

    def env_for(self, name: str) -> dict[str, str]:
        if name == RUNNER:
            return {"CHAOS_AGENT_LOG": str(self.agent_log)}
        if name in (LEARNER, INFERENCE) and self.proxy is not None:
            return {"BOLTSTREAM_S3_ENDPOINT": self.proxy.endpoint}
        return {}

    def ready(self, name: str) -> bool:
        if name == INFERENCE:
            return worker_version(self.port) is not None
        if name == RUNNER:  # the restarted runner has finished an attempt
            return self.logged(name, ": ok in ")
        return super().ready(name)

    def counter(self, name: str) -> int:
        """A stream counter summed over the stream workers' incarnations (each logs it cumulatively)."""
        total = 0
        for path in (self.workdir / "logs").glob("stream-*.log"):
            lines = [line for line in path.read_text(errors="replace").splitlines() if "stream counters" in line]
            if lines and (m := re.search(rf"'{re.escape(name)}': (\d+)", lines[-1])):
                total += int(m.group(1))
        return total

    def agent_events(self) -> list[dict[str, Any]]:
        if not self.agent_log.exists():
            return []
        return [json.loads(line) for line in self.agent_log.read_text().splitlines() if line.endswith("}")]

    def in_flight(self) -> set[tuple[str, int]]:
        """(attempt id, call) of the calls started and not yet answered or failed."""
        state: dict[tuple[str, int], str] = {}
        for e in self.agent_events():
            state[(e["attempt_id"], e["call"])] = e["event"]
        return {k for k, v in state.items() if v == "start"}


def plan(tasks: int) -> list[dict[str, Any]]:
    """The tasks: one or two LLM calls per attempt, alternately."""
    return [{"id": f"t{i:02d}", "calls": 1 + i % 2} for i in range(tasks)]


def expected_samples(tasks: list[dict[str, Any]]) -> set[str]:
    return {f"{t['id']}:{k}:{c}" for t in tasks for k in range(GROUP) for c in range(t["calls"])}


def load_done(pipe: AgentPipeline, tasks: list[dict[str, Any]]) -> Callable[[], bool]:
    """Whether every attempt has had its last call answered (the load has ended)."""
    last = {f"{t['id']}:{k}": t["calls"] - 1 for t in tasks for k in range(GROUP)}

    def done() -> bool:
        answered = {e["attempt_id"] for e in pipe.agent_events() if e["event"] == "ok" and
                    last.get(e["attempt_id"]) == e["call"]}
        return answered >= last.keys()
    return done


async def sigkill_runner(pipe: AgentPipeline) -> tuple[str, float | None]:
    t0 = await _mid_load(pipe)
    running = {a for a, _ in pipe.in_flight()}
    pipe.kill(RUNNER)
    pipe.start(RUNNER)
    return (f"SIGKILL + restart of the runner ({len(running)} attempts in a call at the kill)",
            await _recovered(pipe, RUNNER, t0))


async def sigkill_inference(pipe: AgentPipeline) -> tuple[str, float | None]:
    await _mid_load(pipe)
    deadline = time.monotonic() + 60
    while not (calls := pipe.in_flight()) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # polling the agents' log for a call in flight (the kill must land in one)
    if not calls:
        raise AssertionError(f"no LLM call in flight within 60s\n{pipe.logs()}")
    t0 = time.monotonic()
    pipe.kill(INFERENCE)
    pipe.start(INFERENCE)
    recovery = await _recovered(pipe, INFERENCE, t0)
    failed = {(e["attempt_id"], e["call"]) for e in pipe.agent_events() if e["event"] == "retry"}
    return (f"SIGKILL + restart of the inference worker, {len(calls)} call(s) in flight; {len(failed)} call(s) "
            "failed and were retried by the agents", recovery)


async def s3_refused(pipe: AgentPipeline, down_s: float = 10.0) -> tuple[str, float | None]:
    """Refuse S3 from the learner's first step until ``down_s`` after its second (the checkpoint it then
    publishes meets a refused endpoint for at least ``down_s``), reading the worker's version meanwhile."""
    proxy = pipe.proxy
    assert proxy is not None
    await _mid_load(pipe)
    before = worker_version(pipe.port)
    answered_before = sum(1 for e in pipe.agent_events() if e["event"] == "ok")
    await proxy.close()
    t_closed, t_publish, seen = time.monotonic(), None, set()
    try:
        while t_publish is None or time.monotonic() - t_publish < down_s:
            if t_publish is None and pipe.step_count() >= 2:
                t_publish = time.monotonic()  # the learner publishes v2 right after its step 2
            if time.monotonic() - t_closed > 180:
                raise AssertionError(f"no learner step 2 within 180s of closing S3\n{pipe.logs()}")
            seen.add(worker_version(pipe.port))
            await asyncio.sleep(0.5)  # the fault's duration, reading the worker meanwhile
    finally:
        await proxy.open()
    t_open = time.monotonic()
    answered = sum(1 for e in pipe.agent_events() if e["event"] == "ok") - answered_before
    if seen != {before}:
        raise AssertionError(f"while S3 was down the worker reported versions {seen}, not only v{before}")
    if answered == 0:
        raise AssertionError("the worker answered no call while S3 was down")
    retries = sum(1 for p in (pipe.workdir / "logs").glob("learner.*.log")
                  for line in p.read_text(errors="replace").splitlines() if "S3 failed" in line)
    if not retries:
        raise AssertionError(f"the learner never met the refused endpoint: the fault missed the publish\n{pipe.logs()}")
    await until(lambda: (worker_version(pipe.port) or 0) > (before or 0), 180, "the worker on a new version", pipe)
    return (f"S3 refusing connections {t_open - t_closed:.0f}s, from the learner's first step to {down_s:.0f}s into "
            f"the publish after step 2: the learner retried {retries}x; the worker served v{before} throughout "
            f"({answered} calls answered)", time.monotonic() - t_open)


AGENT_SCENARIOS: dict[str, Fault] = {
    "sigkill-runner": sigkill_runner,  # type: ignore[dict-item]
    "sigkill-inference": sigkill_inference,  # type: ignore[dict-item]
    "s3-refused": s3_refused,  # type: ignore[dict-item]
}


async def run_agent_scenario(name: str, settings: Settings, env: dict[str, str], workdir: Path, *,
                             tasks: int = 16) -> Result:
    """Run one agent-path scenario to the end of the learner's run; the processes are always stopped."""
    fault = AGENT_SCENARIOS[name]
    todo = plan(tasks)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in todo))
    publish = subprocess.run([sys.executable, "-m", "boltstream.cli", "tasks", "publish",
                              str(workdir / "tasks.jsonl"), "--group-size", str(GROUP)], env=env,
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if publish.returncode:
        raise AssertionError(f"tasks publish failed: {publish.stderr[-2000:]}")
    proxy = None
    if name == "s3-refused":
        proxy = S3Proxy(settings.s3_endpoint)
        await proxy.open()
    pipe = AgentPipeline(settings, env, workdir, tasks, proxy)
    t_start = time.monotonic()
    try:
        for component in (INFERENCE, STREAM.format(0), STREAM.format(1), LEARNER):
            pipe.start(component)
        await until(lambda: all(pipe.ready(c) for c in pipe.current), 180, "the worker, stream workers, learner", pipe)
        t_load = time.monotonic()
        pipe.start(RUNNER)  # the load
        pipe.producing = asyncio.create_task(until(load_done(pipe, todo), 600, "every attempt answered", pipe))
        faults, recovery = await fault(pipe)
        await pipe.producing
        load_s = time.monotonic() - t_load
        await until(pipe.learner_done, 300, f"the learner's last step ({pipe.max_steps})", pipe)
        dead_letters = await count_dead_letters(settings, 0)
        topic = settings.topic("spans")
        ends = await log_end_offsets(settings, [TopicPartition(topic, p) for p in range(settings.partitions)])
    finally:
        pipe.close()
        if proxy is not None:
            await proxy.close()
    other_runs = pipe.counter("rollout.other_run_spans")
    if other_runs:
        faults += f"; {other_runs} span(s) of dead runs left out"
    steps = pipe.steps()
    expected = expected_samples(todo)
    got = reconcile(expected, steps)
    dropped = steps[-1].get("dropped_total", {}) if steps else {}
    return Result(
        scenario=name, spans_per_s=sum(ends.values()) / max(load_s, 1e-9), faults=faults,
        rollouts_in=len(todo) * GROUP, expected_samples=len(expected), samples_trained=got.trained, lost=got.lost,
        duplicated=got.duplicated, unexpected=got.unexpected, recovery_s=recovery,
        seconds=time.monotonic() - t_start, deduped=sum(v for k, v in dropped.items() if "duplicate" in k),
        dead_letters=dead_letters)
