"""The exporter's on-disk spool: encoded spans survive a broker outage and a process restart.

Why: the in-memory buffer bounds how long an outage may last before spans are
lost; a broker restart or a rolling upgrade is longer than that in every agent
process. Like the OTel Collector's persistent queue, every encoded record is
written here BEFORE it is sent (write-ahead), so the spool is the send queue:

* Append-only segment files (``lane-N/<seq>.seg``) of record batches, one per
  append, in the order the spans were encoded: ``crc32, count, body length``
  then a body of ``count`` pairs of uint32 lengths (key, value) followed by the
  keys and values. One checksum per batch (not per record) keeps the spool's
  Python work per span small: the exporter's throughput is the budget. A
  segment is rolled at ``segment_bytes`` and deleted only when every record in
  it has been acknowledged (or refused) by the broker. The whole spool is
  bounded by ``max_bytes``: when full the OLDEST segment is dropped, its
  unsent records counted (``dropped_spool_full``) and logged.
* Records are sent in file order (a round that fails goes back to the front),
  so a rollout's spans keep their key and order through an outage and a
  restart. A restart after a partial ack resends the acked part of a segment:
  the stream app deduplicates by span id.
* Durability (``fsync``): off, a record is in the OS page cache once appended,
  which survives a crash of the process (it loses at most the spans not yet
  encoded and appended) but not of the machine; on, each append is fsynced
  (survives power loss, costs a disk flush per batch).
* Several processes may share a directory: each claims a lane with an
  exclusive ``flock`` on ``lane-N.lock``; a process starting later adopts the
  segments of lanes nobody holds (a previous run's leftovers), oldest first.

Only the sender's event loop calls :meth:`Spool.append`, :meth:`take` and
:meth:`settle`; other threads only wait (:meth:`wait_settled`) or read counts.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import logging
import os
import struct
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Sequence
from operator import itemgetter
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

BATCH = struct.Struct("<III")  # crc32(body), records in the batch, len(body)
SUFFIX = ".seg"
MAX_LANES = 256


OFF = ("", "off", "none", "false", "0")


def spool_directory(value: str | None, topic: str) -> Path | None:
    """A spool setting as a directory: unset/``off`` is none, ``auto`` the default for ``topic``.

    The default, ``$XDG_STATE_HOME/boltstream/spool/<topic>`` (``~/.local/state/...``), is per topic
    (namespace included) so a replay never crosses into another run's topic.
    """
    if value is None or value.strip().lower() in OFF:
        return None
    if value.strip().lower() == "auto":
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        return Path(state) / "boltstream" / "spool" / topic
    return Path(value).expanduser()


class SpoolError(Exception):
    """The spool directory cannot be used (unwritable, every lane held)."""


class Ticket:
    """Settled once every record of one append is acked or dropped (what the worker's capture awaits)."""

    __slots__ = ("remaining", "future")

    def __init__(self, n: int, future: Any) -> None:
        self.remaining = n
        self.future = future

    def _one_done(self) -> None:
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(None)


class Segment:
    """One segment file; ``cache`` holds its records while they are needed in memory (hashed by identity)."""

    __slots__ = ("seq", "path", "count", "size", "sent", "settled", "dropped", "cache", "from_disk")

    def __init__(self, seq: int, path: Path, count: int = 0, size: int = 0) -> None:
        self.seq, self.path, self.count, self.size = seq, path, count, size
        self.sent = self.settled = 0
        self.dropped = False
        self.cache: list[Item] | None = [] if count == 0 else None
        self.from_disk = count > 0


Item = tuple[bytes, bytes, Segment, Ticket | None]


def batch_parts(records: Sequence[tuple[bytes, bytes]]) -> tuple[bytes, bytes, bytes]:
    """The on-disk form of one batch of records, in the three parts written one after the other.

    Pure; not joined, because a batch is ~0.5 MB and one more copy of it cost as much as its CRC.
    """
    lengths = array("I", map(len, itertools.chain.from_iterable(records)))
    if sys.byteorder == "big":
        lengths.byteswap()
    head, payload = lengths.tobytes(), b"".join(itertools.chain.from_iterable(records))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return BATCH.pack(crc, len(records), len(head) + len(payload)), head, payload


def encode_records(records: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The on-disk form of one batch of records as one string (tested by hand)."""
    return b"".join(batch_parts(records))


def decode_records(data: bytes) -> tuple[list[tuple[bytes, bytes]], int]:
    """Records of a segment and how many bytes are valid; a torn or corrupt batch ends the segment."""
    out: list[tuple[bytes, bytes]] = []
    pos, n, head = 0, len(data), BATCH.size
    view = memoryview(data)
    while pos + head <= n:
        crc, count, size = BATCH.unpack_from(data, pos)
        start, end = pos + head, pos + head + size
        if end > n or size < 8 * count or zlib.crc32(view[start:end]) != crc:
            break
        lengths = array("I")
        lengths.frombytes(data[start:start + 8 * count])
        if sys.byteorder == "big":
            lengths.byteswap()
        at = start + 8 * count
        if at + sum(lengths) != end:
            break
        for i in range(0, 2 * count, 2):
            k_end = at + lengths[i]
            v_end = k_end + lengths[i + 1]
            out.append((data[at:k_end], data[k_end:v_end]))
            at = v_end
        pos = end
    return out, pos


def _claim_lane(root: Path) -> tuple[int, IO[bytes]]:
    for i in range(MAX_LANES):
        fh = open(root / f"lane-{i}.lock", "ab")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            continue
        return i, fh
    raise SpoolError(f"every lane of spool {root} is held by another process ({MAX_LANES})")


class Spool:
    """Segment files of one process' unacknowledged records; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], counters: Any, *, max_bytes: int,
                 segment_bytes: int, fsync: bool = False) -> None:
        self.root = Path(directory).expanduser()
        self.counters = counters
        self.max_bytes, self.segment_bytes, self.fsync = max_bytes, segment_bytes, fsync
        self.cache_bytes = 4 * segment_bytes
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.lane, self._lock_fh = _claim_lane(self.root)
            self.dir = self.root / f"lane-{self.lane}"
            self.dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"cannot use spool directory {self.root}: {exc}") from exc
        self._segments: collections.deque[Segment] = collections.deque()
        self._active: Segment | None = None
        self._fh: IO[bytes] | None = None
        self._bytes = 0
        self._pending = 0  # records appended (or found on disk), neither settled nor dropped
        self._done = 0  # records settled or dropped: with _pending, a watermark for wait_settled
        self._cond = threading.Condition(threading.Lock())
        self._next_seq = 0
        self._recover()

    # ------------------------------------------------------------ start: what a previous run left

    def _recover(self) -> None:
        """Our lane's segments, then those of lanes nobody holds (renamed into ours), oldest first."""
        files = sorted(self.dir.glob(f"*{SUFFIX}"))
        self._next_seq = int(files[-1].stem) + 1 if files else 0
        for other in sorted(self.root.glob("lane-*.lock")):
            lane = other.stem
            if lane == self.dir.name or not (self.root / lane).is_dir():
                continue
            with open(other, "ab") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a live process' lane
                for f in sorted((self.root / lane).glob(f"*{SUFFIX}")):
                    target = self.dir / f"{self._next_seq:020d}{SUFFIX}"
                    os.replace(f, target)
                    files.append(target)
                    self._next_seq += 1
                try:
                    (self.root / lane).rmdir()
                except OSError:
                    pass
        found = 0
        for f in files:
            data = f.read_bytes()
            records, valid = decode_records(data)
            if valid < len(data):
                log.warning("spool %s: %d bytes after the last whole record (a crash mid-write?) ignored",
                            f, len(data) - valid)
            if not records:
                f.unlink(missing_ok=True)
                continue
            self._segments.append(Segment(int(f.stem), f, len(records), len(data)))
            self._bytes += len(data)
            found += len(records)
        self._pending = found
        if found:
            log.warning("spool %s: %d spans from a previous run to deliver first (%d segments)",
                        self.dir, found, len(self._segments))

    # ------------------------------------------------------------ writing

    def append(self, records: Sequence[tuple[bytes, bytes]], future: Any = None) -> Ticket | None:
        """Write records after everything before them; returns a ticket for ``future`` (or None)."""
        if not records:
            if future is not None and not future.done():
                future.set_result(None)
            return None
        parts = batch_parts(records)
        size = sum(map(len, parts))
        seg = self._active
        if seg is None or (seg.size and seg.size + size > self.segment_bytes):
            seg = self._roll()
        self._make_room(size)
        assert self._fh is not None
        self._fh.writelines(parts)
        self._fh.flush()
        if self.fsync:
            os.fsync(self._fh.fileno())
        ticket = Ticket(len(records), future) if future is not None else None
        assert seg.cache is not None
        n = len(records)
        seg.cache.extend(zip(map(itemgetter(0), records), map(itemgetter(1), records),
                             itertools.repeat(seg, n), itertools.repeat(ticket, n), strict=True))
        seg.count += len(records)
        seg.size += size
        self._bytes += size
        with self._cond:
            self._pending += len(records)
        with self.counters.lock:
            self.counters.spooled += len(records)
        return ticket

    def _roll(self) -> Segment:
        self._seal()
        seg = Segment(self._next_seq, self.dir / f"{self._next_seq:020d}{SUFFIX}")
        self._next_seq += 1
        self._fh = open(seg.path, "ab")
        self._active = seg
        self._segments.append(seg)
        return seg

    def _seal(self) -> None:
        """The active segment becomes read-only; its records leave memory (read back when sent)."""
        if self._fh is not None:
            if self.fsync:
                os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
        seg, self._active = self._active, None
        if seg is None:
            return
        if seg.settled >= seg.count:
            self._delete(seg)
        elif seg.sent == seg.count or self._cached_bytes() > self.cache_bytes:
            # Sealed but unsent segments stay in memory up to ``cache_bytes`` (a burst that the
            # sender is still working through); beyond that, a long outage, they are read back.
            seg.cache = None

    def _cached_bytes(self) -> int:
        return sum(s.size for s in self._segments if s.cache is not None)

    def _make_room(self, incoming: int) -> None:
        while self._bytes + incoming > self.max_bytes:
            oldest = next((s for s in self._segments if s is not self._active), None)
            if oldest is None:
                return  # one batch larger than the spool: written anyway, the bound is exceeded briefly
            lost = oldest.count - oldest.sent
            oldest.dropped = True
            self._delete(oldest)
            with self._cond:
                self._pending -= lost
                self._done += lost
                self._cond.notify_all()
            with self.counters.lock:
                self.counters.dropped_spool_full += lost
            log.warning("spool %s full (%d bytes): dropped its oldest segment, %d unsent spans lost",
                        self.dir, self.max_bytes, lost)

    def _delete(self, seg: Segment) -> None:
        try:
            self._segments.remove(seg)
        except ValueError:
            return
        self._bytes -= seg.size
        seg.cache = None
        seg.path.unlink(missing_ok=True)

    # ------------------------------------------------------------ reading, acknowledging

    def has_unsent(self) -> bool:
        return any(s.sent < s.count for s in self._segments)

    def take(self, n: int) -> list[Item]:
        """Up to ``n`` unsent records, oldest first (a sealed segment is read back from disk)."""
        out: list[Item] = []
        for seg in self._segments:
            if len(out) >= n:
                break
            if seg.sent >= seg.count:
                continue
            if seg.cache is None:
                records, _ = decode_records(seg.path.read_bytes())
                seg.cache = [(k, v, seg, None) for k, v in records]
                seg.from_disk = True
            k = min(n - len(out), seg.count - seg.sent)
            out += seg.cache[seg.sent:seg.sent + k]
            seg.sent += k
            if seg.from_disk:
                with self.counters.lock:
                    self.counters.replayed += k
            if seg.sent == seg.count and seg is not self._active:
                seg.cache = None
        return out

    def settle(self, items: Sequence[Item]) -> None:
        """These records are acked (or refused for good): a segment goes once all of it has."""
        for ticket in filter(None, map(itemgetter(3), items)):
            ticket._one_done()
        for seg, n in collections.Counter(map(itemgetter(2), items)).items():  # C speed: rounds are large
            seg.settled += n
            if seg.settled >= seg.count and not seg.dropped:
                if seg is self._active:
                    self._seal()  # idle and all delivered: start the next batch in a fresh file
                else:
                    self._delete(seg)
        with self._cond:
            self._pending -= len(items)
            self._done += len(items)
            self._cond.notify_all()

    # ------------------------------------------------------------ any thread

    @property
    def pending(self) -> int:
        """Records in the spool not yet acknowledged."""
        return self._pending

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def wait_settled(self, timeout: float) -> bool:
        """True once every record pending at the call is acked or dropped (later ones may still flow)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._done + self._pending
            while self._done < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self) -> None:
        """Release the lane; what is pending stays on disk for the next start."""
        try:
            self._seal()
            if not any(self.dir.iterdir()):
                self.dir.rmdir()
        except OSError as exc:
            log.warning("spool %s: closing: %s", self.dir, exc)
        finally:
            self._lock_fh.close()
