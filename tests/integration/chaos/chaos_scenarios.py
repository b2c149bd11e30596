"""Fault-injection scenarios on the real pipeline, and the reconciliation that proves nothing was lost.

Each scenario runs real processes on an embedded stack: two ``boltstream stream worker`` processes and
one ``boltstream learn --model tiny``. A steady synthetic agent load (the stream tests' workload
generator: rollouts of 1-5 LLM calls, tools, rewards, failures, interleaved as concurrent agents
write them) goes to the ``spans`` topic at a fixed pace; one fault is injected mid-load; then every
rollout produced is reconciled against the sample ids the learner trained, read from its per-step
metrics records (``sample_ids`` of each step of the surviving history: a resumed learner erases the
steps after its checkpoint, see ``learner.metrics.read_steps``).

lost = expected samples never trained; duplicated = trained more than once in the surviving history
(after the learner's documented dedupe by sample id, ``learner/groups.py``). Recovery time = from
the fault until the learner completed a step after the killed process was restarted.

Used by ``tests/integration/chaos/test_chaos_fast.py`` (fast form, in ``make test``) and by
``benchmarks/chaos.py`` (``make chaos``: every scenario, the table in docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from boltstream.config import Settings
from boltstream.learner.metrics import read_records, read_steps
from boltstream.processes import Processes, log_tail
from boltstream.schemas import Codec
from tests.integration.streams.stream_helpers import WORKER_ENV, TopicReader, produce
from tests.integration.streams.stream_workload import (
    Rollout,
    interleaved_spans,
    make_workload,
    reference_samples,
)

log = logging.getLogger(__name__)

GROUP = 4
GROUPS_PER_STEP = 2
VOCAB = 255  # token ids are folded into the tiny model's byte vocabulary
STREAM = "stream-{}"
LEARNER = "learner"


@dataclasses.dataclass
class Result:
    """One row of the reliability table."""

    scenario: str
    spans_per_s: float
    faults: str
    rollouts_in: int
    expected_samples: int
    samples_trained: int
    lost: int
    duplicated: int
    unexpected: int
    recovery_s: float | None
    seconds: float
    deduped: int = 0  # duplicate deliveries the learner dropped (its documented dedupe by batch/sample id)
    poison: int = 0
    dead_letters: int = 0

    def row(self) -> str:
        rec = "-" if self.recovery_s is None else f"{self.recovery_s:.1f}"
        faults = self.faults + (f"; {self.poison} poison records, {self.dead_letters} dead letters"
                                if self.poison else "")
        return (f"| {self.scenario} | {self.spans_per_s:.0f} | {faults} | {self.rollouts_in} | "
                f"{self.samples_trained}/{self.expected_samples} | {self.lost} | {self.duplicated} | {self.deduped} | "
                f"{rec} |")


HEADER = ("| scenario | load held (spans/s) | faults | rollouts in | samples trained / expected | lost | "
          "duplicated | deduped | recovery (s) |\n|---|---|---|---|---|---|---|---|---|")


@dataclasses.dataclass(frozen=True)
class Reconciled:
    trained: int  # distinct expected-or-not sample ids trained
    lost: int  # expected, never trained
    duplicated: int  # trained copies beyond the first
    unexpected: int  # trained, never produced


def reconcile(expected: Iterable[str], steps: Iterable[Mapping[str, Any]]) -> Reconciled:
    """Produced sample ids against the ``sample_ids`` of the learner's surviving step history."""
    trained = [str(sid) for step in steps for sid in step["sample_ids"]]
    counts = Counter(trained)
    want = set(expected)
    return Reconciled(len(counts), len(want - set(counts)), len(trained) - len(counts), len(set(counts) - want))


def fit_vocab(rollouts: list[Rollout]) -> list[Rollout]:
    """Fold every token id into [1, VOCAB] in the spans and in the reference calls alike."""
    def fold(ids: list[int]) -> list[int]:
        return [1 + (t % VOCAB) for t in ids]

    for r in rollouts:
        r.calls = [(fold(p), fold(c)) for p, c in r.calls]
        for s in r.spans:
            if s.get("llm"):
                s["llm"] = {**s["llm"], "prompt_token_ids": fold(s["llm"]["prompt_token_ids"]),
                            "response_token_ids": fold(s["llm"]["response_token_ids"])}
    return rollouts


class Pipeline:
    """The processes of one scenario, their logs in ``workdir``; ``close`` stops every one."""

    def __init__(self, settings: Settings, env: dict[str, str], workdir: Path, tasks: int) -> None:
        self.settings = settings
        self.workdir = workdir
        self.app_id = f"{settings.namespace}chaos-stream"
        self.metrics = workdir / "metrics.jsonl"
        self.max_steps = tasks // GROUPS_PER_STEP
        self.procs = Processes(workdir / "logs", {**env, **WORKER_ENV})
        self.starts: Counter[str] = Counter()
        self.current: dict[str, str] = {}
        self.producing: asyncio.Task[Any] | None = None

    def argv(self, name: str) -> list[str]:
        """The ``boltstream`` command line of component ``name``."""
        if name == LEARNER:
            return ["learn", "--model", "tiny", "--groups-per-step", str(GROUPS_PER_STEP), "--checkpoint-every",
                    "2", "--max-staleness", "none", "--max-steps", str(self.max_steps), "--poll-ms", "100",
                    "--metrics-path", str(self.metrics), "--workdir", str(self.workdir / "learner")]
        return ["stream", "worker", "--app-id", self.app_id, "--group-size", str(GROUP)]

    def env_for(self, name: str) -> dict[str, str]:
        """Environment added for component ``name`` (over the pipeline's)."""
        return {}

    def start(self, name: str) -> None:
        """Start (or restart) component ``name``; each incarnation logs to ``logs/<name>.<n>.log``."""
        self.starts[name] += 1
        label = self.current[name] = f"{name}.{self.starts[name]}"
        proc = self.procs.start_command(label, [sys.executable, "-m", "boltstream.cli", *self.argv(name)],
                                        env=self.env_for(name))
        log.info("started %s (pid %d)", label, proc.pid)

    def ready(self, name: str) -> bool:
        """Whether the current incarnation of ``name`` is ready (its log says so)."""
        return self.logged(name, ready_text(name))

    def kill(self, name: str) -> None:
        """SIGKILL: no shutdown hook runs, nothing is flushed."""
        proc = self.procs.procs.pop(self.current[name])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def steps(self) -> list[dict[str, Any]]:
        return read_steps(read_records(self.metrics)) if self.metrics.exists() else []

    def step_count(self) -> int:
        return sum(1 for r in read_records(self.metrics) if r.get("event") == "step") if self.metrics.exists() else 0

    def learner_done(self) -> bool:
        proc = self.procs.procs.get(self.current[LEARNER])
        return proc is not None and proc.poll() == 0

    def logged(self, name: str, text: str) -> bool:
        """Whether the current incarnation of ``name`` has logged ``text``."""
        path = self.procs.log_path(self.current[name])
        return path.exists() and text in path.read_text(errors="replace")

    def logs(self) -> str:
        return "\n\n".join(f"--- {p.name}\n{log_tail(p, 30)}" for p in sorted((self.workdir / "logs").glob("*.log")))

    def close(self) -> None:
        self.procs.stop_all()


async def until(cond: Callable[[], Any], timeout: float, what: str, pipe: Pipeline) -> Any:
    """Poll ``cond`` (no sleep as synchronisation: a bounded wait on an observable condition)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in pipe.procs.procs.items():
            if proc.poll() not in (None, 0):
                raise AssertionError(f"{name} exited with {proc.returncode}\n{pipe.logs()}")
        value = cond()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{pipe.logs()}")


Fault = Callable[[Pipeline], Awaitable[tuple[str, float | None]]]


async def no_fault(pipe: Pipeline) -> tuple[str, float | None]:
    return "none", None


def ready_text(name: str) -> str:
    """What a component's log says once it is ready (the learner: resumed; a stream worker: state restored)."""
    return "ready: step" if name == LEARNER else "group state ready for partitions"


async def _mid_load(pipe: Pipeline) -> float:
    """Wait for the learner's first step, check the load still flows, return the fault's time."""
    await until(lambda: pipe.step_count() >= 1, 180, "the learner's first step", pipe)
    if pipe.producing is None or pipe.producing.done():
        raise AssertionError("the fault must land while the load is still being produced")
    return time.monotonic()


async def _next_step(pipe: Pipeline, what: str) -> None:
    """Wait until the learner completes a step after now (or has finished its run)."""
    after = pipe.step_count()
    await until(lambda: pipe.step_count() > after or pipe.learner_done(), 180, f"a learner step after {what}", pipe)


async def _recovered(pipe: Pipeline, name: str, t0: float) -> float:
    """Seconds from ``t0`` until ``name`` is ready again and the learner completed a step after that."""
    await until(lambda: pipe.ready(name), 180, f"{name} ready again", pipe)
    await _next_step(pipe, name)
    return time.monotonic() - t0


async def _stall(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` for ``seconds`` (the fault itself, not synchronisation), then SIGCONT, always."""
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def _restart_after_kill(name: str, label: str) -> Fault:
    async def fault(pipe: Pipeline) -> tuple[str, float | None]:
        t0 = await _mid_load(pipe)
        pipe.kill(name)
        pipe.start(name)
        return label, await _recovered(pipe, name, t0)
    return fault


async def slow_learner(pipe: Pipeline, stall_s: float = 8.0) -> tuple[str, float | None]:
    """SIGSTOP the learner while the load goes on (a backlog builds on ``batches``), then SIGCONT."""
    t0 = await _mid_load(pipe)
    await _stall(pipe.procs.procs[pipe.current[LEARNER]].pid, stall_s)
    await _next_step(pipe, "SIGCONT")
    return f"learner stopped (SIGSTOP) {stall_s:.0f}s mid-load", time.monotonic() - t0 - stall_s


async def broker_restart(pipe: Pipeline) -> tuple[str, float | None]:
    """SIGKILL the broker mid-load and start it again on the same port and (durable) storage."""
    from boltstream.stack import kill_broker, restart_broker

    state_file = pipe.settings.state_file
    if not state_file:
        raise AssertionError("the broker scenario needs a stack state file (run it on its own durable stack)")
    t0 = await _mid_load(pipe)
    await asyncio.to_thread(kill_broker, state_file)
    await asyncio.to_thread(restart_broker, state_file)
    await _next_step(pipe, "the broker's restart")
    return "SIGKILL + restart of the broker (durable storage)", time.monotonic() - t0


async def s3_stall(pipe: Pipeline, stall_s: float = 10.0) -> tuple[str, float | None]:
    """Freeze the S3 endpoint (SIGSTOP) for ``stall_s`` from the learner's first step, so the checkpoint
    it publishes after step 2 meets an endpoint that does not answer; then SIGCONT. With durable broker
    storage the broker's log is in that endpoint too, so the broker stalls with it."""
    from boltstream.config import read_state

    state = read_state(Path(pipe.settings.state_file))
    if not state:
        raise AssertionError("the S3 scenario needs a stack state file (run it on its own stack)")
    pid = int(state["pids"]["s3"])
    t0 = await _mid_load(pipe)
    await _stall(pid, stall_s)
    await _next_step(pipe, "S3 answers again")
    return (f"S3 endpoint frozen (SIGSTOP) {stall_s:.0f}s from the learner's first step (checkpoint every 2)",
            time.monotonic() - t0 - stall_s)


SCENARIOS: dict[str, Fault] = {
    "baseline": no_fault,
    "sigkill-stream-worker": _restart_after_kill(STREAM.format(0), "SIGKILL + restart of 1 of 2 stream workers"),
    "sigkill-learner": _restart_after_kill(LEARNER, "SIGKILL + restart of the learner (resumes from checkpoint)"),
    "slow-learner": slow_learner,
    "poison-records": no_fault,  # the fault is in the load: see POISON_EVERY
    "s3-stall": s3_stall,  # benchmarks/chaos.py only: would freeze a shared test stack's S3
    "sigkill-broker": broker_restart,  # benchmarks/chaos.py only: needs a stack of its own, durable
}
POISON_EVERY = 25  # poison-records: one undecodable record after every 25 good ones


def with_poison(records: list[tuple[bytes, bytes]], every: int) -> tuple[list[tuple[bytes, bytes]], int]:
    """Insert a corrupt record (a valid single-object header, garbage body) after every ``every``."""
    out: list[tuple[bytes, bytes]] = []
    poison = 0
    for i, (key, value) in enumerate(records, 1):
        out.append((key, value))
        if i % every == 0:
            out.append((b"poison-%d" % i, value[:10] + b"\xff" * 7))
            poison += 1
    return out, poison


async def run_scenario(name: str, settings: Settings, env: dict[str, str], workdir: Path, *, tasks: int = 16,
                       seed: int = 5, pace: float = 0.5, chunk: int = 20) -> Result:
    """Run one scenario to the end of the learner's run; the processes are always stopped."""
    fault = SCENARIOS[name]
    rollouts = fit_vocab(make_workload(tasks, GROUP, seed=seed, run=f"{settings.namespace}{name}"))
    expected = reference_samples(rollouts)
    records = interleaved_spans(Codec(), settings.topic("spans"), rollouts, width=8)
    poison = 0
    if name == "poison-records":
        records, poison = with_poison(records, POISON_EVERY)
    workdir.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline(settings, env, workdir, tasks)
    t_start = time.monotonic()
    try:
        for i in range(2):
            pipe.start(STREAM.format(i))
        pipe.start(LEARNER)
        # The load starts once every component is up, so the fault lands in a steady flow.
        await until(lambda: all(pipe.ready(name) for name in pipe.current), 120,
            "the learner and both stream workers ready", pipe)
        t_load = time.monotonic()
        pipe.producing = asyncio.create_task(
            produce(settings, settings.topic("spans"), records, pace=pace, chunk=chunk))
        faults, recovery = await fault(pipe)
        await pipe.producing
        load_s = time.monotonic() - t_load
        await until(pipe.learner_done, 300, f"the learner's last step ({pipe.max_steps})", pipe)
        dead_letters = await count_dead_letters(settings, poison)
    finally:
        pipe.close()
    steps = pipe.steps()
    got = reconcile(expected, steps)
    dropped = steps[-1].get("dropped_total", {}) if steps else {}
    return Result(
        scenario=name, spans_per_s=len(records) / max(load_s, 1e-9), faults=faults, rollouts_in=len(rollouts),
        expected_samples=len(expected), samples_trained=got.trained, lost=got.lost, duplicated=got.duplicated,
        unexpected=got.unexpected, recovery_s=recovery,
        seconds=time.monotonic() - t_start, deduped=sum(v for k, v in dropped.items() if "duplicate" in k),
        poison=poison, dead_letters=dead_letters)


async def count_dead_letters(settings: Settings, expected: int, idle_s: float = 2.0) -> int:
    """Dead letters on this namespace's ``dlq``: at least ``expected`` within the timeout, then quiet."""
    async with TopicReader(settings, settings.topic("dlq"), "DeadLetter") as reader:
        if expected:
            await reader.until(lambda: len(reader.records) >= expected, 60, f"{expected} dead letters")
        await reader.quiet(idle=idle_s, timeout=30)
        return len(reader.records)
