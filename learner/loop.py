"""The learner: training batches in, optimizer steps, checkpoints out. Read it top to bottom.

In the spirit of nanochat's ``chat_rl.py``, the algorithm reads top to bottom: ``_train`` in four
numbered sections (1. model, optimizer, resume; 2. data in, checkpoints out; 3. the steps; 4. clean
exit; :func:`train` only adds the model thread and a work directory around it). The steps are two
short loops of ``_Run``: ``offline_steps`` over a fixed dataset's epochs (``--offline``) and
``online_steps`` over the live topic, both calling ``train_step`` (one optimizer step, its
metrics, a checkpoint every N steps). The machinery lives next door:

* :mod:`.groups` reassembles split TrainingBatch parts into GRPO groups, drops
  duplicates, stale and malformed samples (counted by reason), and keeps the offset
  bookkeeping that makes resume exact;
* :mod:`.source` reads the ``batches`` topic (aiokafka, every partition, manual assignment);
* :mod:`.step` is one PPO/GRPO optimizer step (micro-batched, clipped);
* :mod:`.trainer` / :mod:`.deepspeed_backend` hold model + optimizer (what both share:
  :mod:`.model_setup`);
* :mod:`.checkpointing` publishes checkpoints to S3 and loads the newest one at start;
* :mod:`.metrics` logs each step to the console, Prometheus and a JSONL file.

Asynchrony: the step runs in a worker thread, so aiokafka keeps fetching the next groups
while the model trains; samples produced by an older policy than ``max_staleness`` versions
are dropped when their group is taken into a step. Everything that touches the model runs
on ONE dedicated thread: glibc gives each thread its own malloc arena and keeps a freed
peak in it, so steps spread over a thread pool held one activation peak per thread
(SmolLM2 + LoRA: 7.4 GB RSS after the 4th pool thread vs 4.2 GB on one thread).
What freed memory glibc still keeps on that one thread is bounded by the pinned mmap threshold
(:mod:`.memory`, set by ``boltstream learn`` at start) when glibc serves malloc; a learner started
by ``boltstream train`` / ``demo`` runs on tcmalloc where it is installed (:mod:`boltstream.allocator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from boltstream import s3 as s3_mod
from boltstream.broker.dlq import DeadLetterWriter
from boltstream.broker.kafka import producer_kwargs, wait_for_broker
from boltstream.monitoring.tracking import open_trackers
from boltstream.schemas import Codec
from boltstream.weights.checkpoints import announce_checkpoint

from . import timeline
from .checkpointing import LearnerState, Resumed, fetch_resume, prune, publish
from .config import LearnerConfig
from .groups import GroupAssembler, OffsetTracker, StepInput
from .metrics import MetricsSink, step_record
from .model_setup import vocab_size
from .offline import Dataset, OfflineData, live_log_end, open_dataset
from .source import BatchSource, TopicMissingError
from .step import warmup_lr
from .trainer import Trainer, make_trainer

logger = logging.getLogger(__name__)

# How often a held learner looks whether its hold file is gone (reading records in between).
HOLD_CHECK_MS = 100


@dataclass
class RunResult:
    """How a run ended (for the CLI, tests and benchmarks)."""

    step: int
    version: int
    resumed_from: int | None
    trainer: Trainer
    events: list[dict[str, Any]] = field(default_factory=list)  # CheckpointEvents announced
    dropped: dict[str, int] = field(default_factory=dict)
    samples_trained: int = 0


def _backend(cfg: LearnerConfig) -> tuple[str, int]:
    if not cfg.deepspeed:
        return "torch", 1
    from .deepspeed_backend import dist_env

    return "deepspeed", dist_env()[1]


async def train(cfg: LearnerConfig, *, stop: asyncio.Event | None = None,
                progress: Callable[[str], None] | None = None) -> RunResult:
    """Run the learner until ``cfg.max_steps``, ``cfg.idle_exit_s`` of silence, or ``stop`` is set.

    ``progress`` receives one short line per milestone (ready, step, checkpoint, done).
    """
    say = progress or (lambda line: None)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-model") as model_thread:
        loop = asyncio.get_running_loop()

        async def on_model_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return await loop.run_in_executor(model_thread, functools.partial(fn, *args, **kwargs))

        if cfg.workdir:
            return await _train(cfg, Path(cfg.workdir), stop or asyncio.Event(), say, on_model_thread)
        with tempfile.TemporaryDirectory(prefix="boltstream-learn-") as tmp:
            return await _train(cfg, Path(tmp), stop or asyncio.Event(), say, on_model_thread)


async def _train(cfg: LearnerConfig, workdir: Path, stop: asyncio.Event, say: Callable[[str], None],
                 on_model_thread: Callable[..., Any]) -> RunResult:
    settings = cfg.settings
    logger.info("learner config: %s", cfg.to_dict())
    await wait_for_broker(settings, timeout=30.0)  # fail before minutes of model loading, not after
    s3 = s3_mod.make_client(settings)
    await asyncio.to_thread(s3_mod.ensure_bucket, s3, settings.s3_bucket)

    # ------------------------------------------------------------------ 1. model, optimizer, resume
    resumed, dataset, trainer = await _resume(cfg, workdir, s3, on_model_thread)
    state = resumed.state

    # ------------------------------------------------------------------ 2. data in, checkpoints out
    # Reading starts at the checkpoint's offsets; records it had already used above them are skipped.
    # --offline: the fixed dataset comes first (.offline); the live topic follows with --then-online, from
    # the checkpoint's offsets, which a new run set to the live log end of its first start (above).
    tracker = OffsetTracker(state.offsets, state.used_above)
    assembler = GroupAssembler(tracker, max_pending=cfg.max_pending_batches, seen=state.seen,
                               window=cfg.dedupe_window, drop_incomplete=cfg.drop_incomplete_groups,
                               role=cfg.role_spec)
    assembler.dropped.update(state.dropped)
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    codec = Codec.from_registry_url(settings.schema_registry_url)
    dlq = DeadLetterWriter(settings, codec, "learner", producer=producer)
    source = BatchSource(settings, assembler, codec=codec, start=state.offsets, dlq=dlq)
    offline = None if dataset is None else OfflineData(cfg, dataset, codec, assembler.dropped, state.offline, say)
    run = _Run(cfg, workdir, stop, say, on_model_thread, s3, trainer, state, tracker, source, producer, codec,
               offline, RunResult(state.step, state.version, state.version if resumed.manifest else None, trainer))
    try:
        trackers = open_trackers(cfg.report_to, cfg.tracking_path, cfg.name, group=cfg.run_name)
        run.sink = MetricsSink(cfg.metrics_path, cfg.metrics_port, cfg.metrics_host, model_name=cfg.name,
                               trackers=trackers)
        trackers.log_params(cfg.to_dict())
        run.sink.plan(trainer.plan)
        await producer.start()
        if offline is None:
            await source.start()
        run.sink.sync_dropped(assembler.dropped)
        run.sink.event("resume", step=run.step, version=run.version, run=cfg.run_name, offsets=tracker.positions(),
                       manifest=resumed.event["manifest_uri"] if resumed.event else None,
                       offline=offline.state() if offline else None)
        if resumed.event is not None:  # a crash may have come between the manifest and its announcement
            await announce_checkpoint(producer, codec, settings.topic("checkpoints"), resumed.event)
        say(f"ready: step {run.step} version {run.version} run {cfg.run_name}")

        # -------------------------------------------------------------- 3. the steps
        # The fixed dataset's epochs first (--offline), then the live topic (online, or --then-online).
        if offline is not None:
            await run.offline_steps(offline)
        if run.offline is None and (dataset is None or cfg.then_online):
            if dataset is not None:
                await source.start()
                say(f"online: reading {source.topic} from {tracker.positions()}")
            await run.online_steps()

        # -------------------------------------------------------------- 4. clean exit
        if cfg.checkpoint_on_exit and run.step > run.last_checkpoint:
            await run.checkpoint()
        run.sink.event("stop", step=run.step, version=run.version, dropped_total=dict(assembler.dropped))
        say(f"done: step {run.step} version {run.version}")
    finally:
        if run.sink is not None:
            run.sink.close()
        if run.offline is not None:
            await run.offline.close()
        await source.stop()
        await producer.stop()
        trainer.close()
    result = run.result
    result.step, result.version = run.step, run.version
    result.dropped, result.samples_trained = dict(assembler.dropped), run.samples_trained
    return result


async def _resume(cfg: LearnerConfig, workdir: Path, s3: Any,
                  on_model_thread: Callable[..., Any]) -> tuple[Resumed, Dataset | None, Trainer]:
    """The run's newest checkpoint (if any), its offline dataset (if any) and the trainer built from them.

    The checkpoint is downloaded first, so its weights are in place before the optimizer (or
    DeepSpeed's fp32 partitions) are built from them. An --offline dataset is found (and a
    topic range resolved) before the model loads, to fail early.
    """
    backend, world_size = _backend(cfg)
    resumed = await asyncio.to_thread(fetch_resume, s3, cfg, workdir, backend=backend, world_size=world_size)
    try:
        dataset = await open_dataset(cfg, resumed.state.offline) if cfg.offline else None
        if cfg.offline and resumed.manifest is None:  # a new run: its live offsets are the log end of now
            resumed.state.offsets = await live_log_end(cfg.settings) or {}
            if cfg.then_online and not resumed.state.offsets:
                raise TopicMissingError(f"--then-online: topic {cfg.settings.topic('batches')} does not exist")
        trainer = await on_model_thread(make_trainer, cfg, resumed.weights_dir, resumed.state_dir)
    finally:
        resumed.cleanup()
    return resumed, dataset, trainer


class _Run:
    """One run's counters and the components its steps touch, shared by the offline and online phases."""

    def __init__(self, cfg: LearnerConfig, workdir: Path, stop: asyncio.Event, say: Callable[[str], None],
                 on_model_thread: Callable[..., Any], s3: Any, trainer: Trainer, state: LearnerState,
                 tracker: OffsetTracker, source: BatchSource, producer: AIOKafkaProducer, codec: Codec,
                 offline: OfflineData | None, result: RunResult) -> None:
        self.cfg, self.workdir, self.stop, self.say, self.on_model_thread = cfg, workdir, stop, say, on_model_thread
        self.s3, self.trainer, self.source, self.producer, self.codec = s3, trainer, source, producer, codec
        self.tracker = tracker  # the live topic's offsets (an offline epoch keeps its own)
        self.assembler = source.assembler  # the live one; its `dropped` counts every phase's drops
        self.offline = offline
        self.offline_state = state.offline  # what checkpoints keep once the offline phase is over
        self.result = result
        self.sink: MetricsSink | None = None
        self.vocab = vocab_size(trainer.model)
        self.step, self.version, self.samples_trained = state.step, state.version, state.samples_trained
        self.last_checkpoint, self.last_step_at = state.step, time.perf_counter()
        self.last_publish_s = 0.0  # the latest checkpoint's publish: part of the next step's window
        self.last_scrape: dict[str, float] | None = None  # the workers' counters at the latest step record

    async def _workers(self) -> dict[str, float] | None:
        urls = self.cfg.worker_metrics
        return await asyncio.to_thread(timeline.scrape, urls) if urls else None

    def running(self) -> bool:
        return not self.stop.is_set() and (self.cfg.max_steps is None or self.step < self.cfg.max_steps)

    async def held(self, data: OfflineData | BatchSource) -> bool:
        """Whether ``cfg.hold_file`` holds the steps (reading records in meanwhile). When a hold ends, the
        next step's window (its timeline) starts then: the time held was nobody's step."""
        hold = self.cfg.hold_file
        if hold is None or not Path(hold).exists():
            return False
        self.say(f"held while {hold} exists")
        while Path(hold).exists() and not self.stop.is_set():
            if not await data.poll(HOLD_CHECK_MS):  # nothing to read (an offline epoch's end): wait all the same
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), HOLD_CHECK_MS / 1000)
        self.last_step_at, self.last_scrape = time.perf_counter(), await self._workers()
        return True

    async def offline_steps(self, offline: OfflineData) -> None:
        """Steps over the fixed dataset until every epoch is trained (then the offline phase is over)."""
        while self.running():
            if offline.finished:
                self.offline_state = offline.state()
                await offline.close()
                self.offline = None
                return
            if await self.held(offline):
                continue
            inp = offline.take_step(self.cfg.groups_per_step, self.version, self.cfg.max_staleness, self.vocab)
            if inp is None:
                await offline.poll(self.cfg.poll_ms)
                continue
            await self.train_step(offline, inp)

    async def online_steps(self) -> None:
        """Steps from the live topic until the run stops (``stop``, ``max_steps``, ``idle_exit_s``)."""
        cfg, source = self.cfg, self.source
        self.last_scrape = self.last_scrape or await self._workers()
        while self.running():
            if await self.held(source):
                continue
            # K complete groups, judged against the current policy version (staleness: online only)
            inp = source.take_step(cfg.groups_per_step, self.version, cfg.max_staleness, self.vocab)
            if inp is None:
                idle = time.monotonic() - source.last_record_at
                if cfg.idle_exit_s is not None and idle > cfg.idle_exit_s:
                    logger.info("no new record for %.1fs: stopping", idle)
                    return
                await source.poll(cfg.poll_ms)
                continue
            await self.train_step(source, inp)

    async def train_step(self, data: OfflineData | BatchSource, inp: StepInput) -> None:
        """One optimizer step on ``inp`` (taken from ``data``), its metrics, and every N steps a checkpoint."""
        cfg = self.cfg
        # one optimizer step; aiokafka fetches ahead meanwhile
        lr = warmup_lr(cfg.lr, self.step + 1, cfg.lr_warmup_steps)
        metrics = await self.on_model_thread(self.trainer.step, inp.samples, lr)
        data.assembler.commit(inp)
        self.step, self.version = self.step + 1, self.version + 1
        self.samples_trained += len(inp.samples)

        # metrics: console, Prometheus, JSONL (with the sample ids trained), and where the step's time went
        now = time.perf_counter()
        record = step_record(self.step, self.version, metrics, inp, wall_seconds=now - self.last_step_at,
                             dropped_total=self.assembler.dropped, lr=lr)
        scraped = await self._workers()
        record["timeline"] = timeline.step_timeline(now - self.last_step_at, metrics.seconds, self.last_publish_s,
                                                    self.last_scrape, scraped)
        self.last_scrape = scraped
        epoch = ""
        if isinstance(data, OfflineData):
            record["epoch"] = data.epoch + 1
            epoch = f" epoch {data.epoch + 1}"
        self.last_step_at = now
        assert self.sink is not None
        self.sink.step(record)
        self.say(f"step {self.step} version {self.version}{epoch}")

        # every N steps: weights + optimizer + offsets to S3, then the event on `checkpoints`
        if self.step % cfg.checkpoint_every == 0:
            await self.checkpoint()
            self.last_checkpoint = self.step

    async def checkpoint(self) -> None:
        """Publish weights, training state and offsets to S3, announce them, prune old checkpoints."""
        cfg, assembler, tracker = self.cfg, self.assembler, self.tracker
        t0 = time.perf_counter()
        snapshot = LearnerState(step=self.step, version=self.version, offsets=tracker.positions(),
                                used_above=tracker.used_above(), seen=assembler.seen.to_list(),
                                dropped=dict(assembler.dropped), samples_trained=self.samples_trained,
                                offline=self.offline.state() if self.offline else self.offline_state)
        event = await self.on_model_thread(publish, self.s3, cfg, self.trainer, snapshot, self.source.topic,
                                           self.workdir)
        await announce_checkpoint(self.producer, self.codec, cfg.settings.topic("checkpoints"), event)
        deleted = await asyncio.to_thread(prune, self.s3, cfg)
        self.result.events.append(event)
        seconds = self.last_publish_s = time.perf_counter() - t0
        assert self.sink is not None
        self.sink.event("checkpoint", step=self.step, version=self.version, manifest=event["manifest_uri"],
                        offsets=snapshot.offsets, used_above=snapshot.used_above, pruned=deleted, seconds=seconds)
        logger.info("checkpoint v%d published in %.2fs: %s", self.version, seconds, event["manifest_uri"])
        self.say(f"checkpoint v{self.version} {event['manifest_uri']}")
