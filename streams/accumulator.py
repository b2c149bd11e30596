"""Keyed accumulation with idempotent, crash-safe closing: the mechanics shared by both stages.

Both stages collect items under a key until something closes the key: spans
under a rollout id (closed by the root span + grace, or a timeout), trajectories
under a task id (closed when the GRPO group is full, or a timeout). What makes
that safe under faust's at-least-once (docs/architecture.md, "Why it is correct after a crash"):

* Items are identified BY ITEM ID (span id / attempt id): a re-delivered item
  is a duplicate in memory and is not stored again. The new items of a key from
  one consumed batch are written as one table value (a chunk, see
  streams/tables.py), split into several when they would not fit the broker's
  message size, and :meth:`Accumulator.save` returns only once the broker acked
  every chunk: a batch is acknowledged (its offsets can be committed) only after
  its items are kept. A chunk re-applied after a crash holds the same records,
  so rebuilding is idempotent.
* Never ack what was not kept: an item whose chunk the broker refuses (too
  large, or the write failed) is dead-lettered whole with the reason and leaves
  the in-memory view, so the entry emits the same thing before and after a
  restart; the other keys of the batch are saved regardless.
* A closed key gets a marker in the ``markers`` table and is skipped from then
  on (late duplicates are counted, not re-emitted).
* Order on close: send the outputs; only after the broker acked them write the
  marker; only after the marker is acked delete the chunks. A crash at any point
  therefore either re-emits the SAME output (items still there, no marker:
  at-least-once, consumers dedupe by id) or emits nothing more (marker
  durable) - never a shorter re-assembly and never a lost output. The keys
  closed together (one batch, one timer tick) share one background task that
  awaits their acks, instead of one task per key.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .tables import (
    CHUNK_HEADER_BYTES,
    CHUNK_ITEM_BYTES,
    ChangelogMap,
    make_key,
    pack_items,
    split_key,
    unpack_items,
)

log = logging.getLogger(__name__)

Output = tuple[str, bytes, bytes]  # topic, key, value
RETRY_AFTER_S = 5.0
# Chunk ids start with this, so they never collide with an item id stored by an older version.
CHUNK_PREFIX = "@"
# Room around a chunk's value in its changelog record: Kafka record/batch framing and the store
# key (partition, entry key, chunk id), on top of the key's own length.
CHUNK_FRAMING_BYTES = 512


class Staged(NamedTuple):
    """One item accepted in memory but not yet in the table: what a dead letter needs to keep it whole."""

    offset: int
    item_id: str
    key: bytes | None  # the source record's key
    raw: bytes


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
    chunks: set[bytes] = field(default_factory=set)  # table keys holding this entry's items
    unsaved: list[Staged] = field(default_factory=list)  # items staged but not yet in the table
    state: dict[str, Any] = field(default_factory=dict)  # what a stage derives from the items (rebuilt with them)


class Accumulator:
    """Open entries backed by an items table and a markers table; subclasses say what closing emits."""

    kind = "key"

    def __init__(self, app: Any, items: ChangelogMap, markers: ChangelogMap, forget_after_s: float,
                 max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes  # the broker's message size: a chunk's record must fit it
        self.items = items
        self.markers = markers
        self.forget_after_s = forget_after_s
        self.open: dict[tuple[int, str], Entry] = {}
        self.active: set[int] = set()
        self.ready = False
        self.stats: collections.Counter[str] = collections.Counter()
        self._forget: collections.deque[tuple[float, int, bytes]] = collections.deque()
        self._pending: set[asyncio.Task[None]] = set()
        # The time a close reads (markers, retries, created_ns): wall clock live, event time in a replay.
        self.clock_ns: Callable[[], int] = time.time_ns
        # Told how long each save took, sent to acknowledged (the worker's metrics); None: nobody asks.
        self.on_saved: Callable[[float], None] | None = None

    # ------------------------------------------------------------- subclass hooks

    def decode_item(self, raw: bytes) -> dict[str, Any]:
        raise NotImplementedError

    def item_key_of(self, item: dict[str, Any]) -> tuple[str, str]:
        """(key, item id) of a decoded item (a stored chunk is split back into items by these)."""
        raise NotImplementedError

    def on_item(self, entry: Entry, item: dict[str, Any], now: float) -> None:
        """Update ``entry.due`` after ``item`` was added (or restored)."""

    def expires_at(self, entry: Entry) -> float:
        """When an entry with no ``due`` times out (it closes with ``timed_out=True``)."""
        raise NotImplementedError

    def hold(self, entry: Entry, timed_out: bool, now: float) -> bool:
        """True to keep an entry that is due (or expired) open a while longer; it must then set ``entry.due``."""
        return False

    def outputs(self, entry: Entry, timed_out: bool) -> Sequence[Output]:
        raise NotImplementedError

    def failed(self, entry: Entry, reason: str) -> Sequence[Output]:
        """Dead-letter output(s) for an entry whose outputs could not be built or sent."""
        raise NotImplementedError

    async def unsaved(self, entry: Entry, items: Sequence[Staged], reason: str) -> None:
        """Dead-letter items that could not be kept; called before their batch is acknowledged."""
        raise NotImplementedError

    # ------------------------------------------------------------- processing

    def is_closed(self, partition: int, key: str) -> bool:
        entry = self.open.get((partition, key))
        if entry is not None:  # an open entry has no marker: it leaves ``open`` when its marker is written
            return entry.closing
        return make_key(partition, key) in self.markers

    def stage(
        self, partition: int, key: str, item_id: str, raw: bytes, item: dict[str, Any], now: float, offset: int,
        record_key: bytes | None = None,
    ) -> Entry | None:
        """Add one item to the in-memory view; returns its entry, or None for a late or duplicate item.

        The item reaches the table with the entry's next :meth:`save` (the stages save
        every entry a batch touched before that batch counts as processed).
        """
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
        entry.unsaved.append(Staged(offset, item_id, record_key, raw))
        self.on_item(entry, item, now)
        return entry

    def chunks_of(self, entry: Entry, staged: Sequence[Staged]) -> list[list[Staged]]:
        """``staged`` cut into runs whose packed chunk fits the broker's message size (in order).

        An item too large even alone forms a run of its own (its write fails and it is
        dead-lettered); the stages refuse such items at intake, so that is the last resort.
        """
        budget = self.max_bytes - CHUNK_FRAMING_BYTES - len(entry.key.encode("utf-8"))
        runs: list[list[Staged]] = []
        size = budget  # forces a new run for the first item
        for item in staged:
            cost = CHUNK_ITEM_BYTES + len(item.raw)
            if size + cost > budget:
                runs.append([])
                size = CHUNK_HEADER_BYTES
            runs[-1].append(item)
            size += cost
        return runs

    async def save(self, entries: Iterable[Entry]) -> None:
        """Write each entry's staged items to the changelog partition of its source; wait for the acks.

        One chunk per entry, more when they would not fit one record. Items whose chunk
        the producer refuses or the broker does not acknowledge are handed to
        :meth:`unsaved` (the DLQ); the other entries' chunks are written regardless.
        """
        started = time.monotonic()
        written: list[tuple[Entry, bytes, list[Staged], asyncio.Future[Any]]] = []
        for entry in entries:
            staged, entry.unsaved = entry.unsaved, []
            for run in self.chunks_of(entry, staged) if staged else ():
                chunk_key = make_key(entry.partition, entry.key, f"{CHUNK_PREFIX}{run[0].offset}")
                try:
                    ack = await self.items.put(entry.partition, chunk_key, pack_items([s.raw for s in run]))
                except Exception as exc:  # refused locally (too large, producer closed): never sent
                    await self._not_kept(entry, chunk_key, run, exc)
                    continue
                entry.chunks.add(chunk_key)
                written.append((entry, chunk_key, run, ack))
        for entry, chunk_key, run, ack in written:
            try:
                await ack
            except Exception as exc:  # the broker refused it or the producer gave up
                await self._not_kept(entry, chunk_key, run, exc)
        if written and self.on_saved is not None:
            self.on_saved(time.monotonic() - started)

    async def _not_kept(self, entry: Entry, chunk_key: bytes, run: Sequence[Staged], exc: BaseException) -> None:
        log.error("%s %s: %d item(s) not kept (%s: %s); sent to the DLQ", self.kind, entry.key, len(run),
                  type(exc).__name__, exc)
        self.stats["not_kept"] += len(run)
        self.items.store.pop(chunk_key, None)
        entry.chunks.discard(chunk_key)
        for item in run:
            entry.items.pop(item.item_id, None)
        if not entry.items and not entry.chunks and not entry.unsaved:
            self.open.pop((entry.partition, entry.key), None)
        await self.unsaved(entry, run, f"{self.kind} {entry.key}: cannot keep it in the stream state: "
                                       f"{type(exc).__name__}: {exc}")

    async def close(self, entry: Entry, timed_out: bool = False) -> None:
        """Emit the entry's outputs; marker and cleanup follow once the broker acked them."""
        await self.close_all([(entry, timed_out)])

    async def close_all(self, closing: Sequence[tuple[Entry, bool]], now: float | None = None) -> None:
        """Emit the outputs of several (entry, timed_out) unless :meth:`hold` keeps them open; one task
        finishes them all once acked."""
        now = self.clock_ns() / 1e9 if now is None else now
        sent = []
        for entry, timed_out in closing:
            if entry.closing or self.hold(entry, timed_out, now):
                continue
            sent.append((entry, await self._send_outputs(entry, timed_out), timed_out))
        if sent:
            task = asyncio.ensure_future(self._finish(sent))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _send_outputs(self, entry: Entry, timed_out: bool) -> list[asyncio.Future[Any]]:
        entry.closing = True
        self.stats["timed_out" if timed_out else "closed"] += 1
        try:
            outputs = self.outputs(entry, timed_out)
        except Exception as exc:  # assembly/credit/encoding refused these items: dead-letter them
            outputs = self.failed(entry, f"{type(exc).__name__}: {exc}")
            self.stats["failed"] += 1
        futures = []
        send = self.app.producer.send
        for topic, key, value in outputs:
            try:
                futures.append(await send(topic, key, value, None, None, None))
            except Exception as exc:  # refused locally (e.g. too large): never retried, so dead-letter it
                log.error("%s %s: cannot send %d bytes to %s: %s", self.kind, entry.key, len(value), topic, exc)
                self.stats["failed"] += 1
                for dtopic, dkey, dvalue in self.failed(entry, f"cannot send to {topic}: {exc}"):
                    futures.append(await send(dtopic, dkey, dvalue, None, None, None))
                continue
            self.stats[f"out:{topic}"] += 1
        return futures

    async def _finish(self, sent: list[tuple[Entry, list[asyncio.Future[Any]], bool]]) -> None:
        acked = []
        for entry, futures, timed_out in sent:
            try:
                await asyncio.gather(*futures)
            except Exception as exc:  # the producer gave up: keep the items, try again later
                log.error(
                    "%s %s: output not acknowledged (%s); retrying in %.0fs", self.kind, entry.key, exc, RETRY_AFTER_S
                )
                entry.closing = False
                entry.due = self.clock_ns() / 1e9 + RETRY_AFTER_S
                self.stats["retried"] += 1
                continue
            acked.append((entry, timed_out))
        if not acked:
            return
        now = self.clock_ns() / 1e9
        marked = []
        for entry, timed_out in acked:
            marker_key = make_key(entry.partition, entry.key)
            marker = json.dumps({"closed_at": now, "items": len(entry.items), "timed_out": timed_out}).encode()
            try:
                ack = await self.markers.put(entry.partition, marker_key, marker)
            except Exception as exc:
                log.error("%s %s: marker not written: %s", self.kind, entry.key, exc)
                continue
            self.open.pop((entry.partition, entry.key), None)
            self._forget.append((now, entry.partition, marker_key))
            marked.append((entry, ack))
        for entry, ack in marked:
            try:
                await ack
                for chunk_key in sorted(entry.chunks):
                    await self.items.delete(entry.partition, chunk_key)
            except Exception as exc:
                # Items stay: after a restart the key is re-emitted identically (consumers dedupe).
                log.error("%s %s: marker/cleanup failed: %s", self.kind, entry.key, exc)

    async def tick(self, now: float) -> None:
        """Close due and expired entries; forget old markers."""
        if not self.ready:
            return
        closing = []
        for entry in self.open.values():
            if entry.closing:
                continue
            if entry.due is not None and now >= entry.due:
                closing.append((entry, False))
            elif entry.due is None and now >= self.expires_at(entry):
                closing.append((entry, True))
        if closing:
            await self.close_all(closing, now)
        while self._forget and self._forget[0][0] + self.forget_after_s <= now:
            _, partition, marker_key = self._forget.popleft()
            if partition in self.active and marker_key in self.markers:
                await self.markers.delete(partition, marker_key)
                self.stats["forgotten"] += 1

    def next_deadline(self, forget: bool = True) -> float | None:
        """When :meth:`tick` would next close an entry (with ``forget``: or drop a marker); None: never.

        A replay (event time) fires its timer only there, not every ``tick_s`` across a gap."""
        times = [e.due if e.due is not None else self.expires_at(e) for e in self.open.values() if not e.closing]
        if forget and self._forget:
            times.append(self._forget[0][0] + self.forget_after_s)
        return min(times, default=None)

    # ------------------------------------------------------------- rebalance

    def revoke(self) -> None:
        """A rebalance started: stop timer work until :meth:`rebuild`."""
        self.ready = False

    async def drain(self, timeout: float) -> bool:
        """Wait (bounded) for closes in flight, so their markers land before partitions move; True if all did."""
        if not self._pending:
            return True
        _, pending = await asyncio.wait(list(self._pending), timeout=timeout)
        return not pending

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
            partition, parts = split_key(item_key)
            key = parts[0]
            if make_key(partition, key) in self.markers:
                await self.items.delete(partition, item_key)  # closed before the crash: finish the cleanup
                stale += 1
                continue
            entry = self.open.get((partition, key))
            if entry is not None and item_key in entry.chunks:
                continue
            value = self.items.get(item_key)
            for raw in unpack_items(value) if value is not None else ():
                try:
                    item = self.decode_item(raw)
                    item_id = self.item_key_of(item)[1]
                except Exception as exc:  # stored by us after a successful decode: should not happen
                    log.error("%s %s: stored item in %r undecodable (%s); dropped", self.kind, key, item_key, exc)
                    continue
                if entry is None:
                    entry = self.open[(partition, key)] = Entry(partition, key, now, now)
                if item_id in entry.items:
                    continue
                entry.items[item_id] = item
                self.on_item(entry, item, now)
                restored += 1
            if entry is not None:
                entry.chunks.add(item_key)
        self.ready = True
        log.info(
            "%s state ready for partitions %s: %d open, %d item(s) restored, %d stale cleaned, %d foreign dropped",
            self.kind, sorted(active), len(self.open), restored, stale, dropped,
        )
