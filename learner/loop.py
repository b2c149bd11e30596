"""The learner: training batches in, optimizer steps, checkpoints out. Read it top to bottom.

In the spirit of nanochat's ``chat_rl.py``, the algorithm reads top to bottom in one function,
``_train``, in four numbered sections (:func:`train` only adds the model thread and a work
directory around it); the machinery lives next door:

* :mod:`.consumer` reassembles split TrainingBatch parts into GRPO groups, drops
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
from boltstream.dlq import DeadLetterWriter
from boltstream.kafka import producer_kwargs, wait_for_broker
from boltstream.schemas import Codec
from boltstream.weights.checkpoints import announce_checkpoint

from .checkpointing import LearnerState, fetch_resume, prune, publish
from .config import LearnerConfig
from .consumer import GroupAssembler, OffsetTracker
from .metrics import MetricsSink, step_record
from .model_setup import Trainer, vocab_size
from .offline import OfflineData, live_log_end, open_dataset
from .source import BatchSource, TopicMissingError
from .step import warmup_lr
from .trainer import make_trainer

logger = logging.getLogger(__name__)


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
    # The newest complete checkpoint of the run (if any) is downloaded first, so its weights are in
    # place before the optimizer (or DeepSpeed's fp32 partitions) are built from them.
    # An --offline dataset is found (and a topic range resolved) before the model loads, to fail early.
    backend, world_size = _backend(cfg)
    resumed = await asyncio.to_thread(fetch_resume, s3, cfg, workdir, backend=backend, world_size=world_size)
    try:
        dataset = await open_dataset(cfg, resumed.state.offline) if cfg.offline else None
        if cfg.offline and resumed.manifest is None:  # a new run: its live offsets are the log end of now
            resumed.state.offsets = await live_log_end(settings) or {}
            if cfg.then_online and not resumed.state.offsets:
                raise TopicMissingError(f"--then-online: topic {settings.topic('batches')} does not exist")
        trainer = await on_model_thread(make_trainer, cfg, resumed.weights_dir, resumed.state_dir)
    finally:
        resumed.cleanup()
    state = resumed.state
    step, version, samples_trained = state.step, state.version, state.samples_trained
    vocab = vocab_size(trainer.model)
    result = RunResult(step, version, state.version if resumed.manifest else None, trainer)

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
    offline_state = state.offline  # what checkpoints keep once the offline phase is over
    sink: MetricsSink | None = None
    try:
        sink = MetricsSink(cfg.metrics_path, cfg.metrics_port, cfg.metrics_host, model_name=cfg.name)
        await producer.start()
        if offline is None:
            await source.start()
        sink.sync_dropped(assembler.dropped)
        sink.event("resume", step=step, version=version, run=cfg.run_name, offsets=tracker.positions(),
                   manifest=resumed.event["manifest_uri"] if resumed.event else None,
                   offline=offline.state() if offline else None)
        if resumed.event is not None:  # a crash may have come between the manifest and its announcement
            await announce_checkpoint(producer, codec, settings.topic("checkpoints"), resumed.event)
        say(f"ready: step {step} version {version} run {cfg.run_name}")

        async def checkpoint() -> None:
            t0 = time.perf_counter()
            snapshot = LearnerState(step=step, version=version, offsets=tracker.positions(),
                                    used_above=tracker.used_above(), seen=assembler.seen.to_list(),
                                    dropped=dict(assembler.dropped), samples_trained=samples_trained,
                                    offline=offline.state() if offline else offline_state)
            event = await on_model_thread(publish, s3, cfg, trainer, snapshot, source.topic, workdir)
            await announce_checkpoint(producer, codec, settings.topic("checkpoints"), event)
            deleted = await asyncio.to_thread(prune, s3, cfg)
            result.events.append(event)
            seconds = time.perf_counter() - t0
            sink.event("checkpoint", step=step, version=version, manifest=event["manifest_uri"],
                       offsets=snapshot.offsets, used_above=snapshot.used_above, pruned=deleted, seconds=seconds)
            logger.info("checkpoint v%d published in %.2fs: %s", version, seconds, event["manifest_uri"])
            say(f"checkpoint v{version} {event['manifest_uri']}")

        # -------------------------------------------------------------- 3. the loop
        last_checkpoint, last_step_at = step, time.perf_counter()
        while not stop.is_set() and (cfg.max_steps is None or step < cfg.max_steps):
            if offline is not None and offline.finished:  # every epoch trained: stop, or go on live
                offline_state = offline.state()
                await offline.close()
                offline = None
                if not cfg.then_online:
                    break
                await source.start()
                say(f"online: reading {source.topic} from {tracker.positions()}")
            data = offline or source

            # 3a. K complete groups, judged against the current policy version (staleness: online only)
            inp = data.take_step(cfg.groups_per_step, version, cfg.max_staleness, vocab)
            if inp is None:
                idle = time.monotonic() - source.last_record_at
                if offline is None and cfg.idle_exit_s is not None and idle > cfg.idle_exit_s:
                    logger.info("no new record for %.1fs: stopping", idle)
                    break
                await data.poll(cfg.poll_ms)
                continue

            # 3b. one optimizer step; aiokafka fetches ahead meanwhile
            lr = warmup_lr(cfg.lr, step + 1, cfg.lr_warmup_steps)
            metrics = await on_model_thread(trainer.step, inp.samples, lr)
            data.assembler.commit(inp)
            step, version, samples_trained = step + 1, version + 1, samples_trained + len(inp.samples)

            # 3c. metrics: console, Prometheus, JSONL (with the sample ids trained)
            now = time.perf_counter()
            record = step_record(step, version, metrics, inp, wall_seconds=now - last_step_at,
                                 dropped_total=assembler.dropped, lr=lr)
            epoch = f" epoch {offline.epoch + 1}" if offline is not None else ""
            if offline is not None:
                record["epoch"] = offline.epoch + 1
            last_step_at = now
            sink.step(record)
            say(f"step {step} version {version}{epoch}")

            # 3d. every N steps: weights + optimizer + offsets to S3, then the event on `checkpoints`
            if step % cfg.checkpoint_every == 0:
                await checkpoint()
                last_checkpoint = step

        # -------------------------------------------------------------- 4. clean exit
        if cfg.checkpoint_on_exit and step > last_checkpoint:
            await checkpoint()
        sink.event("stop", step=step, version=version, dropped_total=dict(assembler.dropped))
        say(f"done: step {step} version {version}")
    finally:
        if sink is not None:
            sink.close()
        if offline is not None:
            await offline.close()
        await source.stop()
        await producer.stop()
        trainer.close()
    result.step, result.version = step, version
    result.dropped, result.samples_trained = dict(assembler.dropped), samples_trained
    return result
