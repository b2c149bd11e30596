"""The stream app (faust-streaming): spans -> trajectories -> training batches.

Why faust: consumer-group scaling, changelog-backed tables restored on every
rebalance, and agents/timers on one event loop, with no JVM. What we add
(streams/tables.py, streams/faust_internals.py): explicit-partition table writes in
chunks, a Tansu recovery fix, a short fetch wait, and delivery of each fetch to
the stages as one batch (with the rewind of records a rebalance left behind).

Layout of one worker (``boltstream stream worker``, or ``faust -A
boltstream.streams.app worker``):

* agent ``rollouts`` on ``<ns>spans`` (raw bytes) -> :class:`RolloutStage`
  (with the fast consumer, the batch handler ``_rollout_batch`` instead),
  tables ``rollout-spans`` (spans of open rollouts, chunked, by span id) and
  ``rollouts-emitted`` (markers);
* agent ``groups`` on ``<ns>trajectories`` (keyed by task id, so this is the
  repartition by task) -> :class:`GroupStage`, tables ``group-trajectories``
  (by attempt id) and ``groups-emitted``;
* a timer every ``tick_s`` closing rollouts past their grace/timeout and
  groups past their timeout, and forgetting old markers.

Faust settings chosen for the embedded broker and at-least-once: no
transactions (Tansu has no InitProducerId), session = rebalance timeout = 6 s
(group joins take half the session timeout there: ~3 s, not 30 s), standby
replicas off (the memory store recovers from the changelog anyway), a private
temporary data directory (nothing is kept on disk with ``memory://``), and no
recovery consistency check: it compares a store's persisted offset with the
changelog's high watermark, but no store outlives its worker here, and Tansu
reports its last batch's base offset + 1 as the high watermark, below offsets
the worker has read, so the check stopped restarted workers (ConsistencyError)
over a tail that :func:`boltstream.streams.tables.catch_up` re-reads anyway.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from typing import Any

import faust

from boltstream.broker.dlq import DeadLetterWriter
from boltstream.broker.kafka import (
    HEARTBEAT_INTERVAL_MS,
    REBALANCE_TIMEOUT_MS,
    SESSION_TIMEOUT_MS,
    ssl_context,
)
from boltstream.config import Settings
from boltstream.schemas import Codec

from .config import StreamConfig, load_stream_config
from .faust_internals import StreamFaustApp
from .metrics import StreamMetrics, consumer_lag
from .stages import GroupStage, RolloutStage
from .tables import ChangelogMap, catch_up

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 5.0
# Records per fetch, so per batch handed to a stage: big enough that a rollout's spans usually share
# one chunk write, small enough that one batch (~0.1 ms a span) does not hold the loop for long.
MAX_POLL_RECORDS = 1000
COMPONENT = "stream"  # the DeadLetter's ``component``


def broker_credentials(settings: Settings) -> Any:
    """faust credentials for SSL / SASL settings (None for plaintext)."""
    ctx = ssl_context(settings)
    if settings.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=settings.sasl_username,
            password=settings.sasl_password,
            mechanism=settings.sasl_mechanism,
            ssl_context=ctx,
        )
    if ctx is not None:
        return faust.SSLCredentials(ctx)
    return None


def faust_settings(config: StreamConfig, datadir: str) -> dict[str, Any]:
    """faust.App keyword settings for ``config`` (see the module docstring for the why)."""
    s = config.settings
    return {
        "broker": [f"kafka://{hp.strip()}" for hp in s.bootstrap_servers.split(",")],
        "broker_credentials": broker_credentials(s),
        "store": config.store,
        "datadir": datadir,
        "autodiscover": False,
        "web_enabled": False,
        "worker_redirect_stdouts": False,
        "processing_guarantee": "at_least_once",
        "topic_partitions": s.partitions,
        "topic_replication_factor": s.replication_factor,
        "table_standby_replicas": 0,
        "recovery_consistency_check": False,  # see the module docstring
        "broker_session_timeout": SESSION_TIMEOUT_MS / 1000,
        "broker_rebalance_timeout": REBALANCE_TIMEOUT_MS / 1000,
        "broker_heartbeat_interval": HEARTBEAT_INTERVAL_MS / 1000,
        "broker_commit_interval": config.commit_interval_s,
        "consumer_auto_offset_reset": "earliest",
        "consumer_max_fetch_size": max(s.max_message_bytes, 1_048_576),
        "broker_max_poll_records": MAX_POLL_RECORDS,
        "producer_acks": -1,
        "producer_compression_type": s.compression_type,
        "producer_linger": 0.002,
        "producer_max_request_size": s.max_message_bytes,
        "key_serializer": "raw",
        "value_serializer": "raw",
    }


class StreamApp:
    """One worker's faust app with both stages wired to their topics, tables and timer."""

    def __init__(self, config: StreamConfig, codec: Codec | None = None) -> None:
        settings = config.settings
        self.config = config
        self.codec = codec or Codec.from_registry_url(settings.schema_registry_url)
        self.datadir = tempfile.mkdtemp(prefix="boltstream-stream-")
        app = self.faust = StreamFaustApp(config.app_name, **faust_settings(config, self.datadir))
        app.fast_consumer = config.fast_consumer
        n = settings.partitions
        self.rollout_tables = (
            ChangelogMap(app, "rollout-spans", "spans of open rollouts, by span id", n),
            ChangelogMap(app, "rollouts-emitted", "rollouts already emitted", n),
        )
        self.group_tables = (
            ChangelogMap(app, "group-trajectories", "trajectories of open groups, by attempt id", n),
            ChangelogMap(app, "groups-emitted", "groups already emitted", n),
        )
        # Through faust's producer: faust flushes it before every offset commit, so a source offset
        # is never committed before its dead letter is acked.
        self.dlq = DeadLetterWriter(settings, self.codec, COMPONENT,
                                    send=lambda topic, key, value: app.producer.send(topic, key, value, None, None, None))
        self.rollouts = RolloutStage(app, *self.rollout_tables, config, self.codec, self.dlq)
        self.groups = GroupStage(app, *self.group_tables, config, self.codec, self.dlq)
        self.spans_topic = app.topic(settings.topic("spans"), key_type=bytes, value_type=bytes)
        self.trajectories_topic = app.topic(settings.topic("trajectories"), key_type=bytes, value_type=bytes)
        # The agents subscribe the topics (faust's assignor co-partitions them with the tables) and
        # process records one by one on faust's stock path; with the fast consumer every fetch goes to
        # the batch handlers instead and the agents' streams stay idle.
        app.agent(self.spans_topic, name="rollouts")(self._rollout_agent)
        app.agent(self.trajectories_topic, name="groups")(self._group_agent)
        if config.fast_consumer:
            app.batch_handlers[self.spans_topic.get_topic_name()] = self._rollout_batch
            app.batch_handlers[self.trajectories_topic.get_topic_name()] = self._group_batch
        app.timer(interval=config.tick_s, name="close-due")(self._tick)
        app.timer(interval=config.log_every_s, name="log-stats")(self._log_stats)
        self.metrics = StreamMetrics()
        self.rollouts.on_saved = lambda s: self.metrics.observe_save("rollout", s)
        self.groups.on_saved = lambda s: self.metrics.observe_save("group", s)
        app.timer(interval=config.tick_s, name="metrics")(self._refresh_metrics)
        self.rollout_tables[0].table.on_recover(self._on_recover)
        app.on_partitions_revoked.connect(self._on_revoked)
        app.on_before_shutdown.connect(self._on_shutdown)
        self._last_stats: dict[str, int] = {}

    # ------------------------------------------------------------------ agents

    async def _consume(self, stage: RolloutStage | GroupStage, stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            try:
                await stage.on_record(message, time.time())
            except Exception as exc:  # never let one record kill the agent (faust would ack it anyway)
                log.exception("%s[%d]@%d: internal error", message.topic, message.partition, message.offset)
                await self.dlq.reject(
                    message, f"internal error in the {stage.kind} stage: {type(exc).__name__}: {exc}", "internal_error"
                )

    async def _rollout_agent(self, stream: Any) -> None:
        await self._consume(self.rollouts, stream)

    async def _group_agent(self, stream: Any) -> None:
        await self._consume(self.groups, stream)

    async def _rollout_batch(self, messages: list[Any]) -> None:
        await self._batch(self.rollouts, messages)

    async def _group_batch(self, messages: list[Any]) -> None:
        await self._batch(self.groups, messages)

    async def _batch(self, stage: RolloutStage | GroupStage, messages: list[Any]) -> None:
        """Hand a fetch to ``stage``; if the stage itself fails, dead-letter the whole batch.

        The transport acknowledges the batch when this returns, so a batch must not
        leave here neither kept nor dead-lettered. The stages handle bad records and
        unwritable state themselves; this is the last resort for a bug (some of the
        records may then be both kept and in the DLQ: a copy, never a loss).
        """
        try:
            await stage.on_batch(messages, time.time())
        except Exception as exc:
            log.exception("%s stage failed on a batch of %d record(s); dead-lettering them", stage.kind, len(messages))
            for message in messages:
                await self.dlq.reject(
                    message, f"internal error in the {stage.kind} stage on its batch: {type(exc).__name__}: {exc}",
                    "internal_error",
                )

    async def _tick(self) -> None:
        now = time.time()
        for stage in (self.rollouts, self.groups):
            try:
                await stage.tick(now)
            except Exception:
                log.exception("%s timer failed; retried next tick", stage.kind)

    # ------------------------------------------------------------------ rebalance

    def _active(self, topic: str) -> set[int]:
        return {tp.partition for tp in self.faust.consumer.assignment() if tp.topic == topic}

    async def _on_recover(self) -> None:
        """After faust restored the tables: Tansu tail fix, then rebuild both stages' views."""
        spans, trajectories = self._active(self.spans_topic.get_topic_name()), self._active(
            self.trajectories_topic.get_topic_name()
        )
        settings = self.config.settings
        applied = await catch_up(settings, self.rollout_tables, spans)
        applied += await catch_up(settings, self.group_tables, trajectories)
        if applied:
            log.info("re-applied %d changelog record(s) past the reported high watermark", applied)
        now = time.time()
        await self.rollouts.rebuild(spans, now)
        await self.groups.rebuild(trajectories, now)

    async def _on_revoked(self, sender: Any, revoked: Any = None, **kwargs: Any) -> None:
        for stage in (self.rollouts, self.groups):
            stage.revoke()
            await stage.drain(DRAIN_TIMEOUT_S)

    async def _on_shutdown(self, sender: Any = None, **kwargs: Any) -> None:
        for stage in (self.rollouts, self.groups):
            await stage.drain(DRAIN_TIMEOUT_S)
        self._log_counters()

    # ------------------------------------------------------------------ stats

    def counters(self) -> dict[str, int]:
        """Flat counters of both stages and the DLQ (``rollout.records``, ``dlq.undecodable`` ...)."""
        out = {f"rollout.{k}": v for k, v in self.rollouts.stats.items()}
        out.update({f"group.{k}": v for k, v in self.groups.stats.items()})
        out.update({f"dlq.{k}": v for k, v in self.dlq.counts.items()})
        out["rollout.open"] = len(self.rollouts.open)
        out["group.open"] = len(self.groups.open)
        return out

    def _log_counters(self) -> None:
        log.info("stream counters: %s", dict(sorted(self.counters().items())))

    async def _log_stats(self) -> None:
        current = self.counters()
        if current != self._last_stats:
            self._last_stats = current
            self._log_counters()

    async def _refresh_metrics(self) -> None:
        """Copy the counters and the consumer lag for the /metrics thread (streams/metrics.py)."""
        topics = (self.spans_topic.get_topic_name(), self.trajectories_topic.get_topic_name())
        try:
            lag = consumer_lag(self.faust.consumer, topics)
        except Exception as exc:  # no consumer yet (starting) or one being rebuilt: keep the counters coming
            log.debug("consumer lag unavailable: %s", exc)
            lag = {}
        self.metrics.refresh(self.counters(), lag)

    def cleanup(self) -> None:
        """Stop the metrics server, remove the private data directory (call after the worker stopped)."""
        self.metrics.close()
        shutil.rmtree(self.datadir, ignore_errors=True)


_default: StreamApp | None = None


def __getattr__(name: str) -> Any:
    """``app``: the faust app for ``faust -A boltstream.streams.app worker`` (config from env)."""
    global _default
    if name == "app":
        if _default is None:
            _default = StreamApp(load_stream_config())
        return _default.faust
    raise AttributeError(name)
