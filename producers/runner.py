"""``boltstream runner``: consume tasks in a consumer group and run G attempts of the agent per task.

Semantics (details in docs/producers.md):

* One task = one GRPO group = G attempts (the task's ``group_size`` or
  ``--group-size``), at most ``--workers`` attempts running at once in this
  process. More runner processes in the same group (``--group-id``) split the
  partitions, hence the tasks.
* Every attempt runs inside ``boltstream.rollout(task_id, i)``: deterministic
  ids (``attempt_id = "<task_id>:<i>"``, ``rollout_id = uuid5(attempt_id)``),
  a root span with ``boltstream.status`` ok / failed / timeout and the error.
  A failing agent is a failed rollout, never a reward of 0.
* A task's offset is committed only after all its attempts ended, and only
  as part of the contiguous finished prefix of its partition (at-least-once).
  A task that was running when its runner died is run again by whoever gets
  the partition; its attempts keep their ids, so downstream dedupe by
  attempt id makes them count once.
* On a rebalance, running tasks are given ``--revoke-grace-s`` to finish and
  be committed; tasks still running after that keep running here (their spans
  are still useful) and are not re-dispatched if the partition comes back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from typing import Any, ClassVar

from boltstream.config import DEFAULT_GROUP_SIZE, Settings, flags_from_dataclass, load, opt
from boltstream.errors import ConfigError

from .agent import AgentInvoker, load_agent
from .consuming import CommitTracker, Entry
from .context import RolloutTimeout, rollout
from .runner_metrics import RunnerMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """``BOLTSTREAM_RUNNER_*`` knobs plus :class:`Settings`."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_RUNNER_"
    settings: Settings = dataclasses.field(default_factory=Settings)
    agent: str = opt("", "the agent function: module:function or path/to/file.py:function")
    workers: int = opt(4, "attempts running at once in this process")
    group_size: int = opt(DEFAULT_GROUP_SIZE, "attempts per task when the task does not say")
    base_url: str | None = opt(None, "OpenAI base URL of an inference worker, e.g. http://127.0.0.1:8000/v1")
    agent_name: str | None = opt(None, "boltstream.agent_name on every rollout (default: the function's name)")
    group_id: str | None = opt(None, "consumer group (default <namespace>runners, or <namespace>runners.<run id> "
                                     "with --run-id)")
    run_id: str | None = opt(None, "a deliberate second pass over the same tasks: attempt ids are prefixed with it, "
                                   "and by default the pass reads the tasks topic from the start in a consumer "
                                   "group of its own")
    rollout_timeout_s: float = opt(600.0, "time limit per attempt")
    revoke_grace_s: float = opt(2.0, "on rebalance, wait this long for running tasks")
    max_abandoned: int = opt(8, "hung sync agent threads tolerated before exiting 3")
    max_inflight_tasks: int | None = opt(None, "tasks fetched ahead of the workers (default: enough for "
                                               "every worker, plus one)")
    exit_when_idle_s: float | None = opt(None, "exit after this long with nothing to do")
    tasks_per_version: int | None = opt(None, "start at most N tasks per policy version the worker serves "
                                              "(pace the runner to the learner)")
    metrics_port: int | None = opt(None, "serve Prometheus /metrics on this port (0: any free port)")
    metrics_host: str = opt("127.0.0.1", "address of the /metrics server")
    spool_dir: str = opt("auto", "the span exporter's on-disk spool, which keeps spans through broker "
                                 "outages and restarts ('auto': $XDG_STATE_HOME/boltstream/spool/<topic>, "
                                 "i.e. ~/.local/state/...; 'off': none)")

    def __post_init__(self) -> None:
        if not self.agent:
            raise ConfigError("agent", self.agent, "name the agent function as module:function")
        for name in ("workers", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.tasks_per_version is not None:
            if self.tasks_per_version < 1:
                raise ConfigError("tasks_per_version", self.tasks_per_version, "must be >= 1")
            if not self.base_url:
                raise ConfigError("tasks_per_version", self.tasks_per_version,
                                  "needs --base-url (the worker whose policy version paces the runner)")
        if self.rollout_timeout_s <= 0:
            raise ConfigError("rollout_timeout_s", self.rollout_timeout_s, "must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", self.metrics_port, "must be 0-65535")

    @property
    def group(self) -> str:
        if self.group_id:
            return self.group_id
        suffix = f".{self.run_id}" if self.run_id else ""
        return f"{self.settings.namespace}runners{suffix}"

    @property
    def inflight_limit(self) -> int:
        """Tasks fetched ahead: enough to keep every worker busy, few enough to lose little on a crash."""
        return self.max_inflight_tasks or max(1, -(-self.workers // self.group_size)) + 1


class Runner:
    """The runner's event-loop side: fetch, dispatch, track, commit."""

    def __init__(self, config: RunnerConfig, agent: Any = None) -> None:
        self.config = config
        fn = agent or load_agent(config.agent)
        self.invoker = AgentInvoker(fn, config.workers, config.max_abandoned)
        self.agent_name = config.agent_name or getattr(fn, "__name__", None)
        self.tracker: CommitTracker[Any] = CommitTracker()
        self._uncommitted: dict[Any, int] = {}
        self._tasks: dict[Any, set[asyncio.Task[None]]] = {}
        self._stop = asyncio.Event()
        self._sem = asyncio.Semaphore(config.workers)
        self._changed = asyncio.Event()
        self.exit_code = 0
        self.attempts_done = 0
        self._consumer: Any = None
        self._provider: Any = None
        self._codec: Any = None
        self._revoked: set[Any] = set()
        self._dlq: Any = None
        self._exporter: Any = None
        self._needs_flush = False
        self.metrics = RunnerMetrics()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    # ---------------------------------------------------------------- attempts

    async def _attempt(self, task_id: str, task: dict[str, Any], i: int) -> None:
        async with self._sem:
            started = time.monotonic()
            status = "ok"
            self.metrics.running.inc()
            try:
                with rollout(task_id, i, run_id=self.config.run_id, task=task, base_url=self.config.base_url,
                             tracer_provider=self._provider, agent_name=self.agent_name) as ctx:
                    result = await self.invoker(task, ctx, self.config.rollout_timeout_s)
                    ctx.set_result(result)
                log.info("task %s attempt %d: ok in %.2fs, rewards %s", task_id, i, time.monotonic() - started,
                         [(n, v) for n, v, final, _ in ctx.rewards if final])
            except RolloutTimeout as exc:
                status = "timeout"
                log.warning("task %s attempt %d: timeout (%s)", task_id, i, exc)
            except asyncio.CancelledError:
                status = "cancelled"
                log.warning("task %s attempt %d: cancelled at shutdown", task_id, i)
                raise
            except Exception as exc:
                status = "failed"
                log.warning("task %s attempt %d: failed: %s: %s", task_id, i, type(exc).__name__, exc)
            finally:
                self.attempts_done += 1
                self.metrics.running.dec()
                self.metrics.attempts.labels(status).inc()
        if self.invoker.over_limit():
            log.error("%d agent threads hung past the time limit; exiting so a supervisor restarts this "
                      "runner", self.invoker.abandoned)
            self.exit_code = 3
            self.stop()

    async def _run_task(self, tp: Any, entry: Entry, record: Any) -> None:
        try:
            task_rec = self._codec.decode(record.value, topic=record.topic, expect="Task")
            task = json.loads(task_rec["payload_json"])
            if not isinstance(task, dict):
                raise ValueError("payload_json is not a JSON object")
        except Exception as exc:
            await self._dead_letter(record, f"undecodable task: {type(exc).__name__}: {exc}")
        else:
            self.metrics.tasks.inc()
            group = task_rec.get("group_size") or self.config.group_size
            await asyncio.gather(*(self._attempt(task_rec["task_id"], task, i) for i in range(group)),
                                 return_exceptions=True)
        finally:
            self.tracker.finish(entry)
            self._changed.set()

    async def _dead_letter(self, record: Any, reason: str) -> None:
        """The task's offset is marked done only after the broker acked its dead letter."""
        self.metrics.dead_letters.inc()
        await (await self._dlq.reject(record, reason, "undecodable"))

    # ---------------------------------------------------------------- offsets

    def _flush_spans(self) -> bool:
        """Blocking: every span ended so far is acked by the broker (or the timeout passed)."""
        self._provider.force_flush(10_000)  # the SDK's queue -> our exporter
        return bool(self._exporter.force_flush(10_000)) if self._exporter is not None else True

    async def _commit(self) -> None:
        """Commit finished tasks, but only once their spans are in the log.

        Otherwise a crash right after the commit would lose the spans of tasks
        that are never run again: the commit must follow the data it stands for.
        """
        fresh = self.tracker.committable()
        if fresh:
            self._uncommitted.update(fresh)
            self._needs_flush = True
        assigned = self._consumer.assignment()
        todo = {tp: off for tp, off in self._uncommitted.items() if tp in assigned}
        if not todo:
            return
        if self._needs_flush:
            if not await asyncio.get_running_loop().run_in_executor(None, self._flush_spans):
                log.warning("spans not yet acknowledged by the broker; holding the commit of %s", todo)
                return
            self._needs_flush = False
        try:
            await self._consumer.commit(todo)
            for tp, off in todo.items():
                if self._uncommitted.get(tp) == off:
                    del self._uncommitted[tp]
        except Exception as exc:  # a rebalance in progress: retried on the next round
            log.warning("commit of %s failed (%s); will retry", todo, exc)

    async def on_revoked(self, revoked: set[Any]) -> None:
        """Give running tasks of revoked partitions a short grace to finish, then commit what is done."""
        deadline = time.monotonic() + self.config.revoke_grace_s
        while self.tracker.in_flight(revoked) and time.monotonic() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
        await self._commit()
        self._revoked = set(revoked)

    def on_assigned(self, assigned: set[Any]) -> None:
        gone = self._revoked - set(assigned)
        lost = self.tracker.forget(gone)
        for tp in gone:
            self._uncommitted.pop(tp, None)
        if lost:
            self.metrics.retried.inc(lost)
            log.warning("%d running task(s) lost their partition; the new owner re-runs them "
                        "(same attempt ids, deduplicated downstream)", lost)
        self._revoked = set()

    # ---------------------------------------------------------------- main loop

    async def run(self) -> int:
        from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

        from boltstream.broker.dlq import DeadLetterWriter
        from boltstream.broker.kafka import consumer_kwargs
        from boltstream.schemas import Codec

        from .exporter import KafkaSpanExporter
        from .tracing import setup_tracing

        settings = self.config.settings
        self._codec = Codec.from_registry_url(settings.schema_registry_url)
        self._dlq = DeadLetterWriter(settings, self._codec, "runner")  # its producer starts on first use
        self._exporter = KafkaSpanExporter(settings=settings, install_rollout_processor=False,
                                           spool_dir=self.config.spool_dir)
        self.metrics.watch_exporter(self._exporter)
        self._provider = setup_tracing(settings, service_name="boltstream-runner", exporter=self._exporter)
        runner = self

        class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            async def on_partitions_revoked(self, revoked: Any) -> None:
                await runner.on_revoked(set(revoked))

            async def on_partitions_assigned(self, assigned: Any) -> None:
                runner.on_assigned(set(assigned))

        self._consumer = AIOKafkaConsumer(**consumer_kwargs(settings, self.config.group, max_poll_records=50))
        self._consumer.subscribe([settings.topic("tasks")], listener=Listener())
        await self._consumer.start()
        log.info("runner in group %s: %d workers, group size %d, agent %s", self.config.group,
                 self.config.workers, self.config.group_size, self.config.agent)
        idle_since = time.monotonic()
        pacer, pacing = None, None
        if self.config.tasks_per_version is not None:
            from .pacing import PolicyPacer

            pacer = PolicyPacer(self.config.base_url or "", self.config.tasks_per_version, self._changed.set)
            pacing = asyncio.create_task(pacer.run(self._stop), name="boltstream-policy-pacer")
        try:
            while not self._stop.is_set():
                room = self.config.inflight_limit - self.tracker.in_flight()
                if pacer is not None:
                    room = min(room, pacer.room())
                assigned = self._consumer.assignment()
                if room <= 0:
                    self._consumer.pause(*assigned)
                else:
                    self._consumer.resume(*assigned)
                batches = await self._consumer.getmany(timeout_ms=200, max_records=max(room, 1))
                for tp, records in batches.items():
                    for record in records:
                        entry = self.tracker.start(tp, record.offset)
                        if entry is not None:
                            if pacer is not None:
                                pacer.started_one()
                            t = asyncio.create_task(self._run_task(tp, entry, record))
                            self._tasks.setdefault(tp, set()).add(t)
                            t.add_done_callback(self._tasks[tp].discard)
                await self._commit()
                if batches or self.tracker.pending() or not assigned:
                    idle_since = time.monotonic()
                elif self.config.exit_when_idle_s is not None and \
                        time.monotonic() - idle_since > self.config.exit_when_idle_s:
                    log.info("idle for %.1fs; exiting", self.config.exit_when_idle_s)
                    break
            await self._drain()
        finally:
            if pacing is not None:
                pacing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pacing
            await self._consumer.stop()
            if self._dlq is not None:
                await self._dlq.stop()
        return self.exit_code

    async def _drain(self) -> None:
        """Shutdown: let running tasks finish (bounded by the rollout time limit), then commit them."""
        running = [t for ts in self._tasks.values() for t in ts]
        if running:
            log.info("waiting for %d running task(s) before exiting", len(running))
            _, pending = await asyncio.wait(running, timeout=self.config.rollout_timeout_s + 1)
            for t in pending:
                t.cancel()
        await self._commit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream runner", description="Run an agent on tasks from the tasks topic.")
    flags_from_dataclass(p, RunnerConfig)
    return p


def main(argv: list[str]) -> int:
    args = vars(parser().parse_args(argv))
    config = load(RunnerConfig, args)
    code, abandoned = asyncio.run(_main(config))
    if abandoned:  # hung agent threads would block interpreter exit forever: leave now
        log.warning("exiting with %d agent thread(s) still hung", abandoned)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 3)
    return code


async def _main(config: RunnerConfig) -> tuple[int, int]:
    runner = Runner(config)
    if config.metrics_port is not None:
        runner.metrics.serve(config.metrics_host, config.metrics_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runner.stop)
    try:
        code = await runner.run()
    finally:
        runner.metrics.close()
        runner.invoker.shutdown()
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if hasattr(provider, "shutdown"):
            provider.shutdown()
    return code, runner.invoker.abandoned
