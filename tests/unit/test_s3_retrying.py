"""``boltstream.s3.retrying``: transient S3 failures are tried again until the deadline, answers are not."""

from __future__ import annotations

import pytest
import urllib3
from minio.error import S3Error

from boltstream.s3 import retrying


class Clock:
    """A fake clock advanced by the fake sleep: the schedule of waits, without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def sleep(self, s: float) -> None:
        self.waits.append(s)
        self.now += s


def failing(times: int, exc: Exception) -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise exc
        return "ok"

    return calls, fn


def test_retries_a_refused_endpoint_with_doubling_capped_waits() -> None:
    clock = Clock()
    calls, fn = failing(5, urllib3.exceptions.MaxRetryError(None, "/b/k", "Connection refused"))
    assert retrying(fn, "upload", 60, sleep=clock.sleep, clock=lambda: clock.now) == "ok"
    assert len(calls) == 6
    assert clock.waits == [0.5, 1.0, 2.0, 4.0, 5.0]


def test_gives_up_at_the_deadline_with_the_last_error() -> None:
    clock = Clock()
    calls, fn = failing(100, ConnectionRefusedError(111, "Connection refused"))
    with pytest.raises(ConnectionRefusedError):
        retrying(fn, "upload", 10, sleep=clock.sleep, clock=lambda: clock.now)
    assert clock.waits == [0.5, 1.0, 2.0, 4.0, 2.5]  # the last wait is cut to the deadline
    assert clock.now == 10 and len(calls) == 6


def test_an_s3_answer_is_not_retried() -> None:
    clock = Clock()
    err = S3Error("AccessDenied", "denied", "/b/k", "r", "h", None)
    calls, fn = failing(1, err)
    with pytest.raises(S3Error):
        retrying(fn, "upload", 60, sleep=clock.sleep, clock=lambda: clock.now)
    assert len(calls) == 1 and clock.waits == []
