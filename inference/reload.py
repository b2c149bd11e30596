"""Hot checkpoint reload: follow the ``checkpoints`` topic, fetch + verify from S3, swap weights.

Why no consumer group: every worker must see every event (a group would hand
each event to one worker only). Each worker assigns itself all partitions,
reads the topic from the beginning up to its true end at startup (the topic
is compacted, so this is short) to find the newest version for its model,
loads that (falling back to older announced versions if it is refused), then
follows new events. Only versions newer than the one being
served are applied; when several arrive at once only the newest is loaded.

A worker serving several adapters follows one checkpoint model name per
adapter (``targets``): each adapter's versions are found, compared, applied and
refused on their own, so one adapter's reload never moves another's version.

A checkpoint that fails anywhere (missing manifest, a file whose sha256 or
size differs, weights that do not fit the model) is refused with a logged
error and counted; the worker keeps serving the version it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from boltstream.inference.backend import Backend
from boltstream.inference.metrics import Metrics
from boltstream.weights.checkpoints import fetch_checkpoint

log = logging.getLogger(__name__)


class ReloadStatus:
    """What /health reports about reloads, plus a condition to wait on (tests, benchmarks, operators)."""

    def __init__(self) -> None:
        self.reloads = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_reload_seconds: float | None = None
        self.last_fetch_seconds: float | None = None
        self.caught_up = False
        # Per adapter (workers serving several): {"reloads", "reload_failures", "last_reload_error"}.
        self.by_adapter: dict[str, dict[str, Any]] = {}
        self.closing = False  # the server is shutting down: waits end now
        self._changed: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def record(self, adapter: str | None, error: str | None) -> None:
        """Count one reload (``error`` None) or one refused checkpoint."""
        if error is None:
            self.reloads += 1
        else:
            self.failures += 1
        self.last_error = error
        if adapter is not None:
            mine = self.by_adapter.setdefault(adapter, {"reloads": 0, "reload_failures": 0,
                                                        "last_reload_error": None})
            mine["reloads" if error is None else "reload_failures"] += 1
            mine["last_reload_error"] = error

    async def notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    async def close(self) -> None:
        """End every wait now: a long poll in flight would otherwise hold the server's graceful shutdown
        (it waits for every request) until the poll's own timeout."""
        self.closing = True
        await self.notify()

    async def wait_until(self, predicate: Any, timeout: float) -> bool:
        """Wait until ``predicate()`` holds, ``timeout`` passes or :meth:`close`; returns whether it holds."""
        cond = self._cond()
        async with cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cond.wait_for(lambda: self.closing or predicate()), timeout)
        return bool(predicate())


class CheckpointFollower:
    """Applies CheckpointEvents to ``backend``; see the module docstring.

    ``targets``: checkpoint model name -> the adapter its versions load into (None: the worker's one
    policy).
    """

    def __init__(
        self,
        settings: Any,
        backend: Backend,
        *,
        targets: dict[str, str | None],
        workdir: str | Path,
        status: ReloadStatus,
        metrics: Metrics | None = None,
        codec: Any = None,
        s3_client: Any = None,
    ) -> None:
        from boltstream import s3
        from boltstream.schemas import Codec

        self.settings = settings
        self.backend = backend
        self.targets = dict(targets)
        self.workdir = Path(workdir)
        self.status = status
        self.metrics = metrics
        self.codec = codec or Codec.from_registry_url(settings.schema_registry_url)
        self.s3 = s3_client or s3.make_client(settings)
        self.topic = settings.topic("checkpoints")
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from boltstream.broker.kafka import consumer_kwargs

        self.workdir.mkdir(parents=True, exist_ok=True)
        self._consumer = AIOKafkaConsumer(**consumer_kwargs(self.settings, None, fetch_max_wait_ms=50))
        await self._consumer.start()
        await self._consumer.topics()  # metadata for every topic, so partitions_for_topic answers
        parts = self._consumer.partitions_for_topic(self.topic)
        if not parts:
            await self._consumer.stop()
            raise RuntimeError(f"topic {self.topic} does not exist (run `boltstream topics create`)")
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._run(tps), name="boltstream-checkpoint-follower")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    def _relevant(self, records: list[Any]) -> dict[str, list[dict[str, Any]]]:
        """Per followed model, its events among ``records`` newer than what its adapter serves, newest
        first, one per version."""
        by_model: dict[str, dict[int, dict[str, Any]]] = {}
        for rec in records:
            try:
                event = self.codec.decode(rec.value, topic=self.topic, expect="CheckpointEvent")
            except Exception as exc:  # a foreign or corrupt record must not stop reloads
                log.warning("skipping undecodable record %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
                continue
            model = event["model"]
            if model in self.targets and event["version"] > self.backend.version_of(self.targets[model]):
                by_model.setdefault(model, {})[int(event["version"])] = event  # a later record of a version wins
        return {m: [vs[v] for v in sorted(vs, reverse=True)] for m, vs in by_model.items()}

    async def _caught_up(self, tps: list[Any], ends: dict[Any, int]) -> bool:
        for tp in tps:
            if await self._consumer.position(tp) < ends[tp]:
                return False
        return True

    async def _run(self, tps: list[Any]) -> None:
        from boltstream.broker.kafka import log_end_offsets

        ends = await log_end_offsets(self.settings, tps)
        history: list[Any] = []
        while not await self._caught_up(tps, ends):
            batches = await self._consumer.getmany(timeout_ms=500)
            history += [r for recs in batches.values() for r in recs]
        self.status.caught_up = True
        # Newest first; a refused version (pruned files, corruption) falls back to the one before it.
        for events in self._relevant(history).values():
            for event in events:
                if await self._apply(event):
                    break
        await self.status.notify()
        for model, adapter in self.targets.items():
            log.info("following %s for model %r from policy version %d%s", self.topic, model,
                     self.backend.version_of(adapter), f" (adapter {adapter})" if adapter else "")
        while True:
            batches = await self._consumer.getmany(timeout_ms=1000)
            for events in self._relevant([r for recs in batches.values() for r in recs]).values():
                await self._apply(events[0])

    async def _apply(self, event: dict[str, Any]) -> bool:
        """Fetch, verify and load one version; False (logged, counted) when it was refused."""
        version, kind = int(event["version"]), str(event.get("kind") or "full")
        model = event["model"]
        adapter = self.targets[model]
        t0 = time.perf_counter()
        dest = self.workdir / (f"v{version}" if adapter is None else f"{adapter}-v{version}")
        try:
            path = await asyncio.to_thread(fetch_checkpoint, self.s3, event, dest)
            fetched = time.perf_counter()
            await self.backend.load_weights(path, kind, version, adapter)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.status.record(adapter, f"{model} v{version}: {exc}" if adapter else f"v{version}: {exc}")
            if self.metrics:
                self.metrics.reload_failures.inc()
            log.error("refused checkpoint %s v%d (%s): %s; still serving v%d", model, version,
                      event.get("manifest_uri"), exc, self.backend.version_of(adapter))
            shutil.rmtree(dest, ignore_errors=True)
            await self.status.notify()
            return False
        elapsed = time.perf_counter() - t0
        self.status.record(adapter, None)
        self.status.last_reload_seconds = elapsed
        self.status.last_fetch_seconds = fetched - t0
        if self.metrics:
            self.metrics.reloads.labels(kind).inc()
            self.metrics.reload_seconds.labels(kind).observe(elapsed)
            self.metrics.set_version(version, adapter)
        log.info("reloaded %s v%d (%s) in %.3fs (download + verify %.3fs, load %.3fs)", model,
                 version, kind, elapsed, fetched - t0, elapsed - (fetched - t0))
        self._cleanup(keep=dest, adapter=adapter)
        await self.status.notify()
        return True

    def _cleanup(self, keep: Path, adapter: str | None) -> None:
        """Drop this policy's downloaded versions other than the one just loaded (weights live in memory
        now); other adapters' downloads are theirs to drop."""
        prefix = "v" if adapter is None else f"{adapter}-v"
        for d in self.workdir.iterdir():
            if d.is_dir() and d != keep and d.name.startswith(prefix) and d.name[len(prefix):].isdigit():
                shutil.rmtree(d, ignore_errors=True)
