"""The on-disk spool: record format, order, ack-driven deletion, the size bound, restart and lanes."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from boltstream.producers.sender import Counters
from boltstream.producers.spool import Spool, decode_records, encode_records, spool_directory


def _spool(d: Path, counters: Counters | None = None, **kw: int) -> Spool:
    kw = {"max_bytes": 1 << 20, "segment_bytes": 1 << 16, **kw}
    return Spool(d, counters or Counters(), **kw)


def recs(prefix: str, n: int, key: bytes = b"r1") -> list[tuple[bytes, bytes]]:
    return [(key, f"{prefix}{i}".encode()) for i in range(n)]


def test_record_format_by_hand() -> None:
    data = encode_records([(b"k", b"vv")])
    assert data == struct.pack("<III", zlib.crc32(b"vv", zlib.crc32(b"k")), 1, 2) + b"kvv"
    assert decode_records(data) == ([(b"k", b"vv")], 15)
    torn = data + encode_records([(b"k", b"second")])[:-1]  # a crash mid-write
    assert decode_records(torn) == ([(b"k", b"vv")], 15)
    corrupt = data[:-1] + b"X"
    assert decode_records(corrupt) == ([], 0)


def test_order_ack_and_deletion(tmp_path: Path) -> None:
    c = Counters()
    s = _spool(tmp_path, c)
    s.append(recs("a", 3))
    s.append(recs("b", 2))
    first = s.take(4)
    assert [v for _, v, *_ in first] == [b"a0", b"a1", b"a2", b"b0"]
    assert s.pending == 5 and c.spooled == 5
    s.settle(first[:2])
    assert list(s.dir.glob("*.seg")), "a segment stays until every record in it is acked"
    rest = s.take(10)
    assert [v for _, v, *_ in rest] == [b"b1"]
    s.settle(first[2:] + rest)
    assert s.pending == 0 and not list(s.dir.glob("*.seg")) and s.size_bytes == 0
    assert s.wait_settled(0.0)
    s.close()
    assert not s.dir.exists()


def test_restart_replays_unacked_in_order(tmp_path: Path) -> None:
    s = _spool(tmp_path, segment_bytes=64)  # several segments
    s.append(recs("x", 10))
    s.append(recs("y", 10))
    s.settle(s.take(5))  # partly acked: the first segment's unacked part (and only it) comes back
    s.close()
    c = Counters()
    again = _spool(tmp_path, c, segment_bytes=64)
    got = [v.decode() for _, v, *_ in again.take(100)]
    # x0-x4 were acked but share a segment with unacked records: resent (the stream app dedups by span id)
    assert got == [f"x{i}" for i in range(10)] + [f"y{i}" for i in range(10)]
    assert c.replayed == 20
    assert again.pending == len(got)
    again.close()


def test_full_spool_drops_oldest_segment_counted(tmp_path: Path) -> None:
    c = Counters()
    one = len(encode_records(recs("a", 10)))
    s = _spool(tmp_path, c, max_bytes=3 * one, segment_bytes=one)
    for p in "abcd":
        s.append(recs(p, 10))
    assert c.dropped_spool_full == 10 and s.pending == 30 and s.size_bytes <= 3 * one
    assert [v for _, v, *_ in s.take(1)] == [b"b0"]
    s.close()


def test_lanes_and_adoption(tmp_path: Path) -> None:
    a = _spool(tmp_path)
    b = _spool(tmp_path)  # a second process: its own lane
    assert (a.lane, b.lane) == (0, 1)
    b.append(recs("b", 2))
    b.close()  # b's leftovers wait in lane 1 while a runs ...
    a.close()
    d = _spool(tmp_path)  # ... and the next start adopts them
    assert d.lane == 0 and [v for _, v, *_ in d.take(5)] == [b"b0", b"b1"]
    assert not (tmp_path / "lane-1").exists()
    d.close()


def test_ticket_resolves_when_all_settled(tmp_path: Path) -> None:
    import asyncio

    async def go() -> None:
        s = _spool(tmp_path)
        fut = asyncio.get_running_loop().create_future()
        s.append(recs("t", 3), fut)
        items = s.take(3)
        s.settle(items[:2])
        assert not fut.done()
        s.settle(items[2:])
        assert fut.done()
        s.close()

    asyncio.run(go())


def test_spool_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert spool_directory(None, "ns.spans") is None and spool_directory("off", "ns.spans") is None
    assert spool_directory("auto", "ns.spans") == tmp_path / "boltstream" / "spool" / "ns.spans"
    assert spool_directory("/x/y", "t") == Path("/x/y")
