"""Which Kafka offsets the runner may commit, with tasks finishing out of order.

Tasks finish out of order (a short task after a long one). Committing offset 8 while task 5 still runs would, after a crash,
skip task 5 forever: Kafka's committed offset means "everything before this is
done", so only the contiguous prefix of finished records is committable.
Entries are handles: :meth:`CommitTracker.start` returns one and
:meth:`CommitTracker.finish` marks that very handle. When a partition is
revoked its entries are forgotten; a task still running from before then
finishes on an orphaned handle and cannot mark a newer run of the same offset
done by mistake.

Not the learner's tracker of which training records it used (what a restarted learner skips,
kept in its checkpoint): that one remembers used offsets above the resume point, this one only
finds the committable prefix, and neither needs the other's state.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Generic, TypeVar

TP = TypeVar("TP")


class Entry:
    """One dispatched record (a task) awaiting completion."""

    __slots__ = ("done", "offset")

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.done = False


class CommitTracker(Generic[TP]):
    """Per-partition in-order record of dispatched offsets and their completion: what may be committed. Not thread-safe
    (used from the runner's event loop only)."""

    def __init__(self) -> None:
        self._parts: dict[TP, collections.deque[Entry]] = {}
        self._position: dict[TP, int] = {}  # next offset after the last committable one handed out

    def start(self, tp: TP, offset: int) -> Entry | None:
        """Register a fetched record; None when it is already in flight or done here (skip it).

        After a rebalance gives a partition back, the consumer re-fetches from the
        committed offset; records this runner is still working on must not run twice.
        """
        if offset < self._position.get(tp, -1):
            return None
        entries = self._parts.setdefault(tp, collections.deque())
        if entries and offset <= entries[-1].offset:
            return None
        entry = Entry(offset)
        entries.append(entry)
        return entry

    @staticmethod
    def finish(entry: Entry) -> None:
        entry.done = True

    def committable(self) -> dict[TP, int]:
        """{tp: offset to commit} for partitions whose finished prefix grew; consumes that prefix."""
        out: dict[TP, int] = {}
        for tp, entries in self._parts.items():
            last = None
            while entries and entries[0].done:
                last = entries.popleft().offset
            if last is not None:
                self._position[tp] = last + 1
                out[tp] = last + 1
        return out

    def in_flight(self, tps: Iterable[TP] | None = None) -> int:
        parts = self._parts if tps is None else {tp: self._parts[tp] for tp in tps if tp in self._parts}
        return sum(1 for entries in parts.values() for e in entries if not e.done)

    def pending(self, tps: Iterable[TP] | None = None) -> int:
        """Entries not yet committable (running, or done behind a running one)."""
        parts = self._parts if tps is None else {tp: self._parts[tp] for tp in tps if tp in self._parts}
        return sum(len(entries) for entries in parts.values())

    def forget(self, tps: Iterable[TP]) -> int:
        """Drop all state for revoked partitions; returns how many unfinished entries were orphaned."""
        lost = 0
        for tp in tps:
            entries = self._parts.pop(tp, None)
            self._position.pop(tp, None)
            lost += sum(1 for e in entries or () if not e.done)
        return lost
