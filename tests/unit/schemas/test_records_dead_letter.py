"""``records.dead_letter``: the one DeadLetter builder, checked against hand-computed records."""

from __future__ import annotations

import time

import pytest

from boltstream.schemas import Codec
from boltstream.schemas.records import ENVELOPE_BYTES, MAX_REASON_CHARS, dead_letter

WHERE = {"component": "stream", "topic": "t.spans", "partition": 3, "offset": 17}


def test_a_small_record_is_kept_whole() -> None:
    got = dead_letter("undecodable", **WHERE, key=b"k", value=b"junk", max_bytes=1_000_000, now_ns=5)
    assert got == {"reason": "undecodable", "component": "stream", "topic": "t.spans", "partition": 3,
                   "offset": 17, "key": b"k", "value": b"junk", "timestamp_ns": 5}


def test_no_key_and_no_value_give_null_key_and_empty_value() -> None:
    got = dead_letter("empty", **WHERE, key=None, value=None, max_bytes=1_000_000, now_ns=1)
    assert got["key"] is None and got["value"] == b""


def test_a_value_too_large_is_cut_to_what_fits_and_the_reason_says_so() -> None:
    # envelope = 1024 + len("too big") 7 + len("stream") 6 + len("t.spans") 7 + 2 * len(b"kk") 4 = 1048
    assert ENVELOPE_BYTES == 1024
    got = dead_letter("too big", **WHERE, key=b"kk", value=b"x" * 5000, max_bytes=2048, now_ns=9)
    assert got == {"reason": "too big (value truncated from 5000 bytes)", "component": "stream",
                   "topic": "t.spans", "partition": 3, "offset": 17, "key": b"kk", "value": b"x" * 1000,
                   "timestamp_ns": 9}


def test_a_value_that_exactly_fits_is_not_marked() -> None:
    got = dead_letter("too big", **WHERE, key=b"kk", value=b"x" * 1000, max_bytes=2048, now_ns=9)
    assert got["reason"] == "too big" and got["value"] == b"x" * 1000


def test_a_long_reason_is_bounded_and_says_how_long_it_was() -> None:
    reason = "é" * (MAX_REASON_CHARS + 500)
    got = dead_letter(reason, **WHERE, key=None, value=b"v", max_bytes=1_000_000, now_ns=0)
    assert got["reason"] == "é" * MAX_REASON_CHARS + f"... ({MAX_REASON_CHARS + 500} chars)"


def test_timestamp_is_when_it_was_dead_lettered() -> None:
    before = time.time_ns()
    got = dead_letter("r", **WHERE, key=None, value=b"", max_bytes=1_000_000)
    assert before <= got["timestamp_ns"] <= time.time_ns()


def test_the_record_encodes_within_max_bytes_even_at_the_limit() -> None:
    max_bytes = 4096
    got = dead_letter("x" * 5000, **WHERE, key=b"k" * 300, value=b"v" * 10_000, max_bytes=max_bytes)
    encoded = Codec().encode("DeadLetter", got)
    assert len(encoded) + len(got["key"]) < max_bytes and got["value"]


def test_a_non_positive_max_bytes_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_bytes must be > 0, got 0"):
        dead_letter("r", **WHERE, key=None, value=b"", max_bytes=0)
