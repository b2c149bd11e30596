"""From TrainingBatch records to optimizer steps: reassembly, dedupe, staleness, offsets.

The pure core (:class:`OffsetTracker`, :class:`GroupAssembler`) knows nothing about
Kafka, so every rule below is unit-tested without a broker; :mod:`.source` feeds it from aiokafka.

*Exact resume* rests on one definition: a record is **used** once everything it
carried has been trained into the weights or deliberately dropped (stale, malformed,
duplicate). A checkpoint stores, per partition, the offset of the first record that is
not used yet (the *watermark*) plus the few offsets above it that are already used (a
group completes out of order when its parts, or a neighbour's, are still pending).
After a crash the learner reloads the weights of that checkpoint, seeks to the
watermarks and skips exactly those offsets: every record is applied to the weights once.

Duplicates (the stream app is at-least-once) are dropped by ``batch_id`` and by
``sample_id`` within a bounded window that is checkpointed with the weights, so a
duplicate that arrives after a restart is still recognised.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .collate import sample_problem
from .roles import OTHER_ROLE, Role

logger = logging.getLogger(__name__)

Ref = tuple[int, int]  # (partition, offset) of one record of the batches topic
UNKNOWN_VERSION = "unknown"


class OffsetTracker:
    """Per partition: where to resume (first record not yet used) and which records above it are used."""

    def __init__(self, start: Mapping[int, int] | None = None,
                 used_above: Mapping[int, Iterable[int]] | None = None) -> None:
        self._next: dict[int, int] = {int(p): int(o) for p, o in (start or {}).items()}
        self._pending: dict[int, set[int]] = {}
        self._used: dict[int, set[int]] = {}  # used offsets that may sit above the watermark
        self._replay: dict[int, set[int]] = {int(p): {int(o) for o in offs} for p, offs in (used_above or {}).items()}

    def start(self, partition: int, offset: int) -> None:
        """Where reading of ``partition`` begins when no checkpoint said so (e.g. the log start)."""
        self._next.setdefault(partition, offset)

    def used_before(self, partition: int, offset: int) -> bool:
        """True for a record the checkpoint already counted as used: skip it (and it stays used)."""
        replay = self._replay.get(partition)
        if not replay or offset not in replay:
            return False
        replay.discard(offset)
        self._advance(partition, offset)
        self._used.setdefault(partition, set()).add(offset)
        return True

    def read(self, partition: int, offset: int) -> None:
        """A record was handed to the assembler; it is pending until :meth:`use`."""
        self._advance(partition, offset)
        self._pending.setdefault(partition, set()).add(offset)

    def use(self, refs: Iterable[Ref]) -> None:
        """Records whose content is now trained or dropped."""
        for partition, offset in refs:
            self._pending.get(partition, set()).discard(offset)
            self._used.setdefault(partition, set()).add(offset)
        self._prune()

    def _advance(self, partition: int, offset: int) -> None:
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def _watermark(self, partition: int) -> int:
        pending = self._pending.get(partition)
        return min(pending) if pending else self._next[partition]

    def _prune(self) -> None:
        for partition, used in self._used.items():
            mark = self._watermark(partition)
            used.difference_update([o for o in used if o < mark])

    def positions(self) -> dict[int, int]:
        """Per partition, the offset a restarted learner must read from."""
        return {p: self._watermark(p) for p in sorted(self._next)}

    def used_above(self) -> dict[int, list[int]]:
        """Per partition, used offsets at or above the watermark (to skip after a restart)."""
        self._prune()
        out = {p: sorted(used) for p, used in self._used.items() if used}
        for p, replay in self._replay.items():  # not re-read yet: still owed a skip
            if replay:
                out[p] = sorted(set(out.get(p, ())) | replay)
        return out

    @property
    def pending(self) -> int:
        return sum(len(v) for v in self._pending.values())


@dataclass
class Group:
    """One complete GRPO group: the samples of all its parts, and the records they came in."""

    batch_id: str
    task_id: str
    samples: list[dict[str, Any]]
    refs: list[Ref]
    reward_mean: float = 0.0
    complete: bool = True
    reward_std: float = 0.0  # the spread of the group's episode rewards (0: every attempt scored alike)


@dataclass
class StepInput:
    """K groups' usable samples: what one optimizer step trains, plus what was dropped on the way."""

    groups: list[Group]
    samples: list[dict[str, Any]]
    staleness: Counter[str]
    dropped: Counter[str]

    @property
    def refs(self) -> list[Ref]:
        return [r for g in self.groups for r in g.refs]

    @property
    def sample_ids(self) -> list[str]:
        return [str(s["sample_id"]) for s in self.samples]


@dataclass
class _Partial:
    num_parts: int
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)
    refs: list[Ref] = field(default_factory=list)


class IdWindow:
    """The last ``size`` ids seen, in order: a bounded set that can be checkpointed as a list."""

    def __init__(self, size: int, ids: Iterable[str] = ()) -> None:
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()
        for i in ids:
            self.add(i)

    def add(self, item: str) -> None:
        self._ids[item] = None
        self._ids.move_to_end(item)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def to_list(self) -> list[str]:
        return list(self._ids)


def staleness_key(version: int, sample_version: int) -> str:
    """Histogram bucket: versions behind the learner, or ``unknown`` (no version recorded)."""
    return UNKNOWN_VERSION if sample_version < 0 else str(max(0, version - sample_version))


class GroupAssembler:
    """Reassembles split TrainingBatch parts, drops duplicates, and forms steps of K usable groups.

    Every record handed to :meth:`add` ends up either in a group (used when its step is
    :meth:`commit`-ted, or when all its samples are dropped) or dropped with a reason in
    :attr:`dropped`. Nothing is discarded silently. With a ``role`` only that role's samples
    are trained; a group with none of them is used up without a step.
    """

    def __init__(self, tracker: OffsetTracker | None = None, *, max_pending: int = 1000,
                 seen: Iterable[str] = (), window: int = 100_000, drop_incomplete: bool = False,
                 role: Role | None = None) -> None:
        self.tracker = tracker or OffsetTracker()
        self.max_pending = max_pending
        self.drop_incomplete = drop_incomplete
        self.role = role
        self.seen = IdWindow(window, seen)  # "b:<batch_id>" and "s:<sample_id>" of used groups/samples
        self.dropped: Counter[str] = Counter()  # cumulative, by reason (records and samples)
        self.ready: deque[Group] = deque()
        self._partial: OrderedDict[str, _Partial] = OrderedDict()
        self._buffer: list[tuple[Group, list[dict[str, Any]]]] = []
        self._buffer_staleness: Counter[str] = Counter()
        self._buffer_dropped: Counter[str] = Counter()
        self._active: set[str] = set()  # batch ids held in _partial / ready / _buffer

    # ------------------------------------------------------------------ records in

    def add(self, partition: int, offset: int, batch: Mapping[str, Any] | None, problem: str | None = None) -> None:
        """One record of the batches topic: a decoded TrainingBatch, or None with the ``problem``."""
        if self.tracker.used_before(partition, offset):
            return
        self.tracker.read(partition, offset)
        ref = (partition, offset)
        if batch is None:
            return self._drop_record(ref, problem or "undecodable")
        batch_id, part, num_parts = str(batch["batch_id"]), int(batch["part"]), int(batch["num_parts"])
        if num_parts < 1 or not 0 <= part < num_parts:
            return self._drop_record(ref, "bad_part_number")
        if f"b:{batch_id}" in self.seen or (batch_id in self._active and batch_id not in self._partial):
            return self._drop_record(ref, "duplicate_batch")
        if self.drop_incomplete and not batch.get("complete", True):
            return self._drop_record(ref, "incomplete_group")
        partial = self._partial.get(batch_id)
        if partial is None:
            partial = self._partial[batch_id] = _Partial(num_parts)
            self._active.add(batch_id)
            self._evict_oldest_partial()
        if num_parts != partial.num_parts:
            return self._drop_record(ref, "inconsistent_parts")
        if part in partial.parts:
            return self._drop_record(ref, "duplicate_part")
        partial.parts[part] = dict(batch)
        partial.refs.append(ref)
        if len(partial.parts) == num_parts:
            del self._partial[batch_id]
            first = partial.parts[0]
            samples = [s for i in range(num_parts) for s in partial.parts[i]["samples"]]
            self.ready.append(Group(batch_id, str(first.get("task_id", "")), samples, partial.refs,
                                    float(first.get("reward_mean", 0.0)), bool(first.get("complete", True)),
                                    float(first.get("reward_std", 0.0))))

    def _drop_record(self, ref: Ref, reason: str) -> None:
        self.dropped[f"record_{reason}"] += 1
        logger.warning("dropped record %d@%d: %s", ref[0], ref[1], reason)
        self.tracker.use([ref])

    def _evict_oldest_partial(self, keep: int | None = None) -> None:
        """Bound memory: a batch whose other parts never come would otherwise pin its records forever."""
        keep = self.max_pending if keep is None else keep
        while len(self._partial) > keep:
            batch_id, partial = self._partial.popitem(last=False)
            self._active.discard(batch_id)
            self.dropped["record_parts_never_completed"] += len(partial.refs)
            logger.warning("dropped incomplete batch %s (%d of %d parts), %d newer ones pending", batch_id,
                           len(partial.parts), partial.num_parts, len(self._partial))
            self.tracker.use(partial.refs)

    def drop_partial_batches(self) -> None:
        """The input is over (the end of a fixed dataset): batches still missing parts never complete."""
        self._evict_oldest_partial(keep=0)

    # ------------------------------------------------------------------ steps out

    def usable(self, group: Group, version: int, max_staleness: int | None, vocab_size: int | None,
               taken: set[str]) -> tuple[list[dict[str, Any]], Counter[str], Counter[str]]:
        """(samples to train, staleness histogram, dropped reasons) of one group at ``version``."""
        keep: list[dict[str, Any]] = []
        staleness: Counter[str] = Counter()
        dropped: Counter[str] = Counter()
        for s in group.samples:
            problem = OTHER_ROLE if self.role is not None and not self.role.trains(s) else sample_problem(s, vocab_size)
            sid = str(s.get("sample_id"))
            sample_version = int(s.get("policy_version", -1)) if problem is None else -1
            if problem is None and (f"s:{sid}" in self.seen or sid in taken):
                problem = "duplicate_sample"
            if problem is None and max_staleness is not None and 0 <= sample_version < version - max_staleness:
                problem = "stale"
            if problem is None:
                keep.append(s)
                taken.add(sid)
                staleness[staleness_key(version, sample_version)] += 1
            else:
                dropped[problem] += 1
        return keep, staleness, dropped

    def take_step(self, k: int, version: int, max_staleness: int | None = None,
                  vocab_size: int | None = None) -> StepInput | None:
        """The next K groups with usable samples, or None until that many are ready.

        Groups are judged (staleness, validity) when taken, against the current policy
        version; the buffer of groups taken so far is only ever judged under one version,
        because a step empties it before the version changes.
        """
        taken = {str(s["sample_id"]) for _, keep in self._buffer for s in keep}
        while len(self._buffer) < k and self.ready:
            group = self.ready.popleft()
            keep, staleness, dropped = self.usable(group, version, max_staleness, vocab_size, taken)
            self._buffer_dropped.update(dropped)
            self.dropped.update(dropped)
            if dropped:
                logger.info("group %s: dropped %s", group.batch_id, dict(dropped))
            if keep:
                self._buffer.append((group, keep))
                self._buffer_staleness.update(staleness)
            else:  # nothing to train: the group is used up now
                self._finish(group)
        if len(self._buffer) < k:
            return None
        step = StepInput(groups=[g for g, _ in self._buffer], samples=[s for _, keep in self._buffer for s in keep],
                         staleness=self._buffer_staleness, dropped=self._buffer_dropped)
        self._buffer, self._buffer_staleness, self._buffer_dropped = [], Counter(), Counter()
        return step

    def take_rest(self, version: int, max_staleness: int | None = None,
                  vocab_size: int | None = None) -> StepInput | None:
        """Every group still ready as one step, however few: the end of a fixed dataset rarely
        leaves a multiple of K. None when no usable group is left."""
        step = self.take_step(self.buffered_groups, version, max_staleness, vocab_size) if self.ready else None
        if step is None and self._buffer:  # some groups had nothing usable: train the rest
            step = self.take_step(len(self._buffer), version, max_staleness, vocab_size)
        return step

    def commit(self, step: StepInput) -> None:
        """The step's samples are in the weights: its records are used, its ids remembered."""
        for sid in step.sample_ids:
            self.seen.add(f"s:{sid}")
        for group in step.groups:
            self._finish(group)

    def _finish(self, group: Group) -> None:
        self._active.discard(group.batch_id)
        self.seen.add(f"b:{group.batch_id}")
        self.tracker.use(group.refs)

    @property
    def buffered_groups(self) -> int:
        return len(self._buffer) + len(self.ready)
