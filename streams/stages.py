"""The stream app's two stages: spans -> trajectories (per rollout) and trajectories -> batches (per task).

Both are :class:`~boltstream.streams.accumulator.Accumulator` subclasses: this
module says what a record is, when a key closes and what closing emits; the
pure core (``assemble_trajectory``, ``build_training_batches``) decides the
content. Records are Avro bytes on the wire in both directions; encoding and
decoding are explicit (:class:`~boltstream.schemas.Codec`), so every topic
reads in Redpanda Console or any Avro-aware tool.

Rollout stage (spans topic, keyed by rollout id):

* undecodable bytes, a record of another schema, a span without ``rollout_id``
  or ``span_id``, a record over ``max_message_bytes - RECORD_HEADROOM`` (it
  could not be kept in the changelog, see schemas/records.py) -> dead letter,
  the worker goes on;
* spans are accumulated by :func:`~boltstream.schemas.records.rollout_key`:
  explicit rollout id > conversation/session id > trace id;
* what closes a rollout (docs/zero-code.md): the ``boltstream.rollout`` root span
  (the runner), the ``boltstream.rollout.end`` marker (the exporter of a process that
  was one rollout, ``BOLTSTREAM_ROLLOUT_ID``, at its exit: producers/rollout_end.py),
  or for a rollout keyed by its trace id the trace's local root span
  (no parent, not the inference worker's), each after ``grace_s`` (0: at once);
  otherwise no new span for ``session_idle_s`` (status ok). A rollout still
  missing a referenced parent span (an enclosing span, e.g. the runner's root,
  never ended) waits ``rollout_timeout_s`` instead and closes ``abandoned``;
* a rollout without the runner's root that closes without a final reward is held
  ``reward_timeout_s`` for one (delayed feedback: a reward span with its key);
  one with no LLM call, no root and no task id (a service's other traces: a health
  check, a web request) is neither held nor emitted, only counted (``without_llm_calls``);
  it closes as soon as one arrives, else with none (``failure_reward`` applies);
* a rollout the pure core cannot assemble (no rollout id) or must not
  train on (a non-finite reward, bad behaviour logprobs, negative or inverted
  span times: streams/validate.py), or whose trajectory cannot be encoded or
  sent (too large) -> every one of its spans is dead-lettered with the reason;
* delayed feedback (a reward span with ``boltstream.feedback``, producers/feedback.py) for a
  rollout already closed -> dead letter ``feedback for rollout X arrived after it was trained``
  (DLQ category ``feedback_after_trained``); a rollout made of feedback alone when it closes
  -> its spans dead-lettered as ``unknown rollout`` (``feedback_unknown_rollout``).

Both stages: what a stage cannot keep in its changelog (the broker refused the
chunk) is dead-lettered whole before the batch is acknowledged, and the other
keys of the batch are kept (streams/accumulator.py).

Group stage (trajectories topic, keyed by task id, so all attempts of a task
meet on one partition; a task-less trajectory by its prompt fingerprint,
streams/baselines.py): a group is one task's attempts within one run
(:func:`~boltstream.streams.grouping.group_key`: a ``--run-id`` second pass
forms its own groups); it closes when ``group_size`` distinct attempts
are there, or ``group_timeout_s`` after its first trajectory (then
``complete=False``); a task-less group closes after ``prompt_window_s`` and, when
it holds one trajectory, gets its agent's running-mean baseline; a trajectory
for an already emitted group is late and dropped.
A trajectory with a non-finite reward or bad logprobs (written by an older
worker or by hand) is dead-lettered alone, so its group closes without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from boltstream.broker.dlq import DeadLetterWriter
from boltstream.schemas import Codec, SchemaError
from boltstream.schemas.records import RECORD_HEADROOM, REWARD_VALUE, ROLLOUT_END_SPAN, rollout_key

from .accumulator import Accumulator, Entry, Output, Staged
from .assembly import InvalidRollout, assemble_trajectory_with_stats
from .baselines import PROMPT_PREFIX, AgentBaselines, agent_of, partition_key
from .config import StreamConfig
from .credit import rollout_returns
from .grouping import batch_id_for, build_training_batches, group_key
from .spans import is_feedback, is_final_reward, is_local_root, is_rollout_root
from .tables import ChangelogMap, unpack_items
from .validate import summarise, trajectory_problems

log = logging.getLogger(__name__)


class _Stage(Accumulator):
    """Shared plumbing: codec, topics, dead letters for a key whose outputs failed."""

    record = ""
    in_name = ""

    def __init__(
        self,
        app: Any,
        items: ChangelogMap,
        markers: ChangelogMap,
        config: StreamConfig,
        codec: Codec,
        dlq: DeadLetterWriter,
    ) -> None:
        super().__init__(app, items, markers, config.forget_after_s, config.settings.max_message_bytes)
        # Larger records could not be kept in the changelog, nor dead-lettered whole later.
        self.item_limit = config.settings.max_message_bytes - RECORD_HEADROOM
        self.config = config
        self.codec = codec
        self.dlq = dlq
        self.in_topic = config.settings.topic(self.in_name)

    def decode_item(self, raw: bytes) -> dict[str, Any]:
        return self.codec.decode(raw, topic=self.in_topic, expect=self.record)

    def failed(self, entry: Entry, reason: str, category: str = "") -> Sequence[Output]:
        """One dead letter per stored item of the entry (each whole: the stages refuse bigger ones)."""
        category = category or f"{self.kind}_failed"
        log.error("%s %s: %s; its items go to the DLQ", self.kind, entry.key, reason)
        self.dlq.counts[category] += 1
        raws = dict.fromkeys(raw for k in sorted(entry.chunks) if (v := self.items.get(k)) for raw in unpack_items(v))
        key = entry.key.encode()
        return [
            (self.dlq.topic, key, self.dlq.encode(f"{self.kind} {entry.key}: {reason}", topic=self.in_topic,
                                                  partition=entry.partition, offset=-1, key=key, value=raw))
            for raw in raws
        ]

    async def unsaved(self, entry: Entry, items: Sequence[Staged], reason: str) -> None:
        for item in items:
            await self.dlq.send(reason, topic=self.in_topic, partition=entry.partition, offset=item.offset,
                                key=item.key, value=item.raw, category="not_kept")

    def rejection(self, item: dict[str, Any]) -> tuple[str, str] | None:
        """(reason, DLQ category) when a decoded record cannot be accumulated, else None."""
        return None

    def refuse(self, partition: int, key: str, item: dict[str, Any]) -> tuple[str, str] | None:
        """(reason, DLQ category) for an item its key can no longer take (a late one that must be said)."""
        return None

    async def on_batch(self, messages: Sequence[Any], now: float) -> None:
        """Consumed records of the input topic, in offset order per partition.

        Each is decoded and staged; every key the batch touched is saved (one
        chunk, or more when large) and the call returns once the broker has them;
        then the keys that became due are closed together. A record that cannot
        be used or kept - or that hits an internal error - is dead-lettered alone.
        """
        touched: dict[tuple[int, str], Entry] = {}
        for message in messages:
            self.stats["records"] += 1
            value = message.value if message.value is not None else b""
            if len(value) > self.item_limit:
                await self.dlq.reject(message, (
                    f"{self.record} record of {len(value)} bytes is over the {self.item_limit}-byte limit of what "
                    f"the stream app can keep (max_message_bytes - {RECORD_HEADROOM}); producers must truncate "
                    "(the exporter does)"), "oversize")
                continue
            try:
                item = self.decode_item(value)
            except SchemaError as exc:
                await self.dlq.reject(message, f"undecodable {self.record}: {exc}", "undecodable")
                continue
            try:
                problem = self.rejection(item)
                if problem is None:
                    key, item_id = self.item_key_of(item)
                    problem = self.refuse(message.partition, key, item)
                if problem is not None:
                    await self.dlq.reject(message, *problem)
                    continue
                entry = self.stage(message.partition, key, item_id, value, item, now, message.offset, message.key)
            except Exception as exc:  # never let one record stop the stage
                log.exception("%s[%d]@%d: internal error", message.topic, message.partition, message.offset)
                await self.dlq.reject(
                    message, f"internal error in the {self.kind} stage: {type(exc).__name__}: {exc}",
                    "internal_error",
                )
                continue
            if entry is not None:
                touched[(entry.partition, entry.key)] = entry
        await self.save(touched.values())
        due = [(e, False) for e in touched.values()
               if e.due is not None and now >= e.due and not e.closing and self.open.get((e.partition, e.key)) is e]
        if due:
            await self.close_all(due, now)

    async def on_record(self, message: Any, now: float) -> None:
        """One record of the input topic (faust's per-record delivery)."""
        await self.on_batch((message,), now)


class RolloutStage(_Stage):
    """Spans -> one Trajectory per rollout attempt, on ``trajectories`` keyed by task id."""

    kind = "rollout"
    record = "Span"
    in_name = "spans"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.assembly = self.config.assembly_config()
        self.out_topic = self.config.settings.topic("trajectories")

    def on_item(self, entry: Entry, item: dict[str, Any], now: float) -> None:
        state = entry.state
        # Parents referenced but not seen: an enclosing span (the runner's root) has not ended yet.
        waiting = state.setdefault("waiting", set())
        waiting.discard(item["span_id"])
        parent = item.get("parent_span_id")
        if parent and parent not in entry.items:
            waiting.add(parent)
        if item.get("llm") is not None:
            state["llm"] = True
        if item.get("task_id"):
            state["task"] = True
        if is_final_reward(item):
            state["rewarded"] = True
            if state.get("held"):
                entry.due = now  # the reward it was held for came
        root = is_rollout_root(item)
        state["root"] = state.get("root", False) or root
        ended = item.get("name") == ROLLOUT_END_SPAN  # the process that was this rollout exited
        if entry.due is None and (root or ended or (item.get("trace_id") == entry.key and is_local_root(item))):
            entry.due = now + self.config.grace_s

    def expires_at(self, entry: Entry) -> float:
        limit = self.config.rollout_timeout_s if entry.state.get("waiting") else self.config.session_idle_s
        return entry.last_seen + limit

    def hold(self, entry: Entry, timed_out: bool, now: float) -> bool:
        """A runnerless rollout that closes without a final reward waits ``reward_timeout_s`` for one."""
        state = entry.state
        if (state.get("held") or state.get("rewarded") or state.get("root") or not state.get("llm")
                or self.config.reward_timeout_s <= 0):
            return False
        state["held"], state["timed_out"] = True, timed_out
        entry.due = now + self.config.reward_timeout_s
        self.stats["held_for_reward"] += 1
        return True

    def refuse(self, partition: int, key: str, item: dict[str, Any]) -> tuple[str, str] | None:
        # Any other late span is only counted (``late``); a feedback is someone's answer: dead-letter it, said.
        if is_feedback(item) and self.is_closed(partition, key):
            return (f"feedback for rollout {key} arrived after it was trained: its reward "
                    f"{item['attributes'].get(REWARD_VALUE)!r} was not used"), "feedback_after_trained"
        return None

    def outputs(self, entry: Entry, timed_out: bool) -> Sequence[Output]:
        if entry.items and all(is_feedback(span) for span in entry.items.values()):
            return self.failed(entry, "unknown rollout: feedback arrived for it, but no span of the rollout itself",
                               "feedback_unknown_rollout")
        if not (entry.state.get("llm") or entry.state.get("root") or entry.state.get("task")):
            # a service's other traces (a health check, a web request): nothing to train, no group waits for it
            self.stats["without_llm_calls"] += 1
            return []
        overrides: dict[str, str] = {}
        if (timed_out or entry.state.get("timed_out")) and entry.state.get("waiting"):
            overrides = {"status": "abandoned", "error": f"no root span within {self.config.rollout_timeout_s:g}s"}
        elif not entry.state.get("root"):
            overrides = {"status": "ok"}  # a session or trace: its end (local root, idleness) is its normal close
        try:
            trajectory, stats = assemble_trajectory_with_stats(
                entry.items.values(), self.assembly, rollout_id=entry.key, **overrides
            )
        except InvalidRollout as exc:
            self.stats["invalid"] += 1
            return self.failed(entry, f"rejected: {exc}", "invalid_rollout")
        self.stats["llm_calls"] += stats.llm_calls
        self.stats["trained_calls"] += stats.trained_calls
        self.stats["dropped_calls"] += stats.dropped_calls
        self.stats["duplicate_spans"] += stats.duplicate_spans
        self.stats["other_run_spans"] += stats.other_run_spans
        value = self.codec.encode("Trajectory", trajectory, topic=self.out_topic)
        return [(self.out_topic, partition_key(trajectory).encode(), value)]

    def rejection(self, item: dict[str, Any]) -> tuple[str, str] | None:
        key, span_id = rollout_key(item), item.get("span_id")
        if not key:
            return "span has no rollout id, session id or trace id: it belongs to no rollout", "no_rollout_id"
        if not span_id:
            return f"span of rollout {key} has no span_id", "no_span_id"
        return None

    def item_key_of(self, item: dict[str, Any]) -> tuple[str, str]:
        return rollout_key(item), item["span_id"]


class GroupStage(_Stage):
    """Trajectories -> the TrainingBatch part(s) of each GRPO group, on ``batches`` keyed by task id."""

    kind = "group"
    record = "Trajectory"
    in_name = "trajectories"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.credit = self.config.credit
        self.out_topic = self.config.settings.topic("batches")
        self.baselines = AgentBaselines(self.config.baseline_window)

    def on_item(self, entry: Entry, item: dict[str, Any], now: float) -> None:
        if entry.due is None and len(entry.items) >= self.config.group_size:
            entry.due = now

    def expires_at(self, entry: Entry) -> float:
        window = self.config.prompt_window_s if entry.key.startswith(PROMPT_PREFIX) else self.config.group_timeout_s
        return entry.first_seen + window

    def outputs(self, entry: Entry, timed_out: bool) -> Sequence[Output]:
        trajectories = list(entry.items.values())
        task_id = trajectories[0]["task_id"]  # the entry key may carry a run id in front of it
        taskless = not task_id
        baseline = None
        if taskless:  # a prompt-fingerprint group: peers when several came, else the agent's recent returns
            returns = {t["attempt_id"]: rollout_returns(t, self.credit).episode_return for t in trajectories}
            if len(returns) == 1:
                (only,) = trajectories
                baseline = self.baselines.baseline(agent_of(only), returns[only["attempt_id"]])
                self.stats["agent_baseline"] += 1
            for t in trajectories:
                self.baselines.add(agent_of(t), returns[t["attempt_id"]])
        batches = build_training_batches(
            task_id,
            trajectories,
            self.credit,
            group_size=self.config.group_size,
            complete=True if taskless else None,  # a task-less group is whatever its window gathered
            max_bytes=self.config.batch_bytes,
            batch_id=batch_id_for(entry.key, entry.items) if taskless else None,
            created_ns=self.clock_ns(),
            baseline=baseline,
        )
        self.stats["samples"] += sum(len(b["samples"]) for b in batches)
        if len(batches) > 1:
            self.stats["split_groups"] += 1
        key = (task_id or entry.key).encode()
        return [(self.out_topic, key, self.codec.encode("TrainingBatch", b, topic=self.out_topic)) for b in batches]

    def rejection(self, item: dict[str, Any]) -> tuple[str, str] | None:
        problems = trajectory_problems(item)
        if problems:
            return f"trajectory {item.get('attempt_id')} rejected: {summarise(problems)}", "invalid_trajectory"
        return None

    def item_key_of(self, item: dict[str, Any]) -> tuple[str, str]:
        if not item["task_id"]:
            return partition_key(item), item["attempt_id"]
        return group_key(item["task_id"], item["attempt_id"]), item["attempt_id"]
