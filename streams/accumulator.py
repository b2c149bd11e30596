"""Keyed accumulation with idempotent, crash-safe closing: the mechanics shared by both stages.

Both stages collect items under a key until something closes the key: spans
under a rollout id (closed by the root span + grace, or a timeout), trajectories
under a task id (closed when the GRPO group is full, or a timeout). What makes
that safe under faust's at-least-once (design.md, "Crash semantics"):

* Items are stored BY ITEM ID (span id / attempt id) in the ``items`` table:
  re-applying a record after a crash overwrites an identical value.
* A closed key gets a marker in the ``markers`` table and is skipped from then
  on (late duplicates are counted, not re-emitted).
* Order on close: send the outputs; only after the broker acked them write the
  marker; only after the marker is acked delete the items. A crash at any point
  therefore either re-emits the SAME output (items still there, no marker:
  at-least-once, consumers dedupe by id) or emits nothing more (marker
  durable) - never a shorter re-assembly and never a lost output.

The in-memory view (``open``: decoded items per key, timings) is rebuilt from
the store after every faust recovery (:meth:`Accumulator.rebuild`), keeping
entries of partitions this worker still owns.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .tables import ChangelogMap, make_key, split_key

log = logging.getLogger(__name__)

Output = tuple[str, bytes, bytes]  # topic, key, value
RETRY_AFTER_S = 5.0


@dataclass
class Entry:
    """One open key (a rollout, or a task's group) and its decoded items."""

    partition: int
    key: str
    first_seen: float
    last_seen: float
    items: dict[str, dict[str, Any]] = field(default_factory=dict)
    due: float | None = None  # close at or after this time (root seen + grace, group full)
    closing: bool = False


class Accumulator:
    """Open entries backed by an items table and a markers table; subclasses say what closing emits."""

    kind = "key"

    def __init__(self, app: Any, items: ChangelogMap, markers: ChangelogMap, forget_after_s: float) -> None:
        self.app = app
        self.items = items
        self.markers = markers
        self.forget_after_s = forget_after_s
        self.open: dict[tuple[int, str], Entry] = {}
        self.active: set[int] = set()
        self.ready = False
        self.stats: collections.Counter[str] = collections.Counter()
        self._forget: collections.deque[tuple[float, int, bytes]] = collections.deque()
        self._pending: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------- subclass hooks

    def decode_item(self, raw: bytes) -> dict[str, Any]:
        raise NotImplementedError

    def on_item(self, entry: Entry, item: dict[str, Any], now: float) -> None:
        """Update ``entry.due`` after ``item`` was added (or restored)."""

    def expired(self, entry: Entry, now: float) -> bool:
        raise NotImplementedError

    def outputs(self, entry: Entry, timed_out: bool) -> Sequence[Output]:
        raise NotImplementedError

    def failed(self, entry: Entry, reason: str) -> Sequence[Output]:
        """Dead-letter output(s) for an entry whose outputs could not be built or sent."""
        raise NotImplementedError

    # ------------------------------------------------------------- processing

    def is_closed(self, partition: int, key: str) -> bool:
        entry = self.open.get((partition, key))
        return (entry is not None and entry.closing) or make_key(partition, key) in self.markers

    async def add(
        self, partition: int, key: str, item_id: str, raw: bytes, item: dict[str, Any], now: float
    ) -> Entry | None:
        """Store one item idempotently; returns its entry, or None for a late or duplicate item."""
        if self.is_closed(partition, key):
            self.stats["late"] += 1
            log.debug("%s %s already closed: late item %s dropped", self.kind, key, item_id)
            return None
        entry = self.open.get((partition, key))
        if entry is None:
            entry = self.open[(partition, key)] = Entry(partition, key, now, now)
        entry.last_seen = now
        if item_id in entry.items:
            self.stats["duplicate"] += 1
            return None
        entry.items[item_id] = item
        await self.items.put(partition, make_key(partition, key, item_id), raw)
        self.on_item(entry, item, now)
        return entry

    async def close(self, entry: Entry, timed_out: bool = False) -> None:
        """Emit the entry's outputs; marker and cleanup follow once the broker acked them."""
        if entry.closing:
            return
        entry.closing = True
        self.stats["timed_out" if timed_out else "closed"] += 1
        try:
            outputs = self.outputs(entry, timed_out)
        except Exception as exc:  # assembly/credit/encoding refused these items: dead-letter them
            outputs = self.failed(entry, f"{type(exc).__name__}: {exc}")
            self.stats["failed"] += 1
        futures = []
        for topic, key, value in outputs:
            try:
                futures.append(await self.app.producer.send(topic, key, value, None, None, None))
            except Exception as exc:  # refused locally (e.g. too large): never retried, so dead-letter it
                log.error("%s %s: cannot send %d bytes to %s: %s", self.kind, entry.key, len(value), topic, exc)
                self.stats["failed"] += 1
                for dtopic, dkey, dvalue in self.failed(entry, f"cannot send to {topic}: {exc}"):
                    futures.append(await self.app.producer.send(dtopic, dkey, dvalue, None, None, None))
                continue
            self.stats[f"out:{topic}"] += 1
        task = asyncio.ensure_future(self._finish(entry, futures, timed_out))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _finish(self, entry: Entry, futures: list[asyncio.Future[Any]], timed_out: bool) -> None:
        try:
            await asyncio.gather(*futures)
        except Exception as exc:  # the producer gave up: keep the items, try again later
            log.error("%s %s: output not acknowledged (%s); retrying in %.0fs", self.kind, entry.key, exc, RETRY_AFTER_S)
            entry.closing = False
            entry.due = time.time() + RETRY_AFTER_S
            self.stats["retried"] += 1
            return
        now = time.time()
        marker_key = make_key(entry.partition, entry.key)
        marker = json.dumps({"closed_at": now, "items": len(entry.items), "timed_out": timed_out}).encode()
        try:
            ack = await self.markers.put(entry.partition, marker_key, marker)
            self.open.pop((entry.partition, entry.key), None)
            self._forget.append((now, entry.partition, marker_key))
            await ack
            for item_id in entry.items:
                await self.items.delete(entry.partition, make_key(entry.partition, entry.key, item_id))
        except Exception as exc:
            # Items stay: after a restart the key is re-emitted identically (consumers dedupe).
            log.error("%s %s: marker/cleanup failed: %s", self.kind, entry.key, exc)

    async def tick(self, now: float) -> None:
        """Close due and expired entries; forget old markers."""
        if not self.ready:
            return
        for entry in list(self.open.values()):
            if entry.closing:
                continue
            if entry.due is not None and now >= entry.due:
                await self.close(entry)
            elif entry.due is None and self.expired(entry, now):
                await self.close(entry, timed_out=True)
        while self._forget and self._forget[0][0] + self.forget_after_s <= now:
            _, partition, marker_key = self._forget.popleft()
            if partition in self.active and marker_key in self.markers:
                await self.markers.delete(partition, marker_key)
                self.stats["forgotten"] += 1

    # ------------------------------------------------------------- rebalance

    def revoke(self) -> None:
        """A rebalance started: stop timer work until :meth:`rebuild`."""
        self.ready = False

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) for closes in flight, so their markers land before partitions move."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout)

    async def rebuild(self, active: set[int], now: float) -> None:
        """Re-derive the in-memory view from the recovered store for the ``active`` partitions."""
        self.active = set(active)
        dropped = self.items.purge_except(active) + self.markers.purge_except(active)
        for pk in [pk for pk in self.open if pk[0] not in active]:
            del self.open[pk]
        forget = []
        for marker_key in self.markers.keys_for(active):
            try:
                closed_at = float(json.loads(self.markers.store[marker_key])["closed_at"])
            except (ValueError, KeyError, TypeError):
                closed_at = now
            forget.append((closed_at, split_key(marker_key)[0], marker_key))
        self._forget = collections.deque(sorted(forget))
        restored = stale = 0
        for item_key in self.items.keys_for(active):
            partition, (key, item_id) = split_key(item_key)
            if make_key(partition, key) in self.markers:
                await self.items.delete(partition, item_key)  # closed before the crash: finish the cleanup
                stale += 1
                continue
            entry = self.open.get((partition, key))
            if entry is not None and item_id in entry.items:
                continue
            raw = self.items.get(item_key)
            try:
                item = self.decode_item(raw) if raw is not None else None
            except Exception as exc:  # stored by us after a successful decode: should not happen
                log.error("%s %s: stored item %s undecodable (%s); dropped", self.kind, key, item_id, exc)
                item = None
            if item is None:
                continue
            if entry is None:
                entry = self.open[(partition, key)] = Entry(partition, key, now, now)
            entry.items[item_id] = item
            self.on_item(entry, item, now)
            restored += 1
        self.ready = True
        log.info(
            "%s state ready for partitions %s: %d open, %d item(s) restored, %d stale cleaned, %d foreign dropped",
            self.kind, sorted(active), len(self.open), restored, stale, dropped,
        )
