"""Helpers for integration tests (the ``stack`` / ``settings`` fixtures live in tests/conftest.py).

Everything here talks to the real embedded stack; nothing is mocked.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import minio
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from boltstream import s3
from boltstream.broker.kafka import consumer_kwargs, log_end_offsets
from boltstream.config import Settings
from boltstream.schemas import Codec
from boltstream.schemas.packed import as_lists
from boltstream.stack import run_sync

BOLTSTREAM = Path(sys.executable).with_name("boltstream")
CLI_TIMEOUT = 120.0

Record = tuple[int, bytes | None, dict[str, Any]]  # (partition, key, decoded value)


async def read_records(settings: Settings, short: str, expect: str, *, count: int | None = None,
                       until: Callable[[list[Record]], bool] | None = None, to_end: bool = False,
                       timeout: float = 30.0, topic: str | None = None) -> list[Record]:
    """Records of a topic from the beginning, all partitions, by assignment (no group), until
    ``count`` arrived, ``until(records)`` holds, or (``to_end``) the log end at call time was
    reached; at the latest at the deadline. The caller asserts on what came back."""
    topic = topic or settings.topic(short)
    codec = Codec.from_registry_url(settings.schema_registry_url)
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None))
    await consumer.start()
    out: list[Record] = []
    try:
        await consumer.topics()  # a full metadata fetch (a broker may have auto-created the topic)
        parts = consumer.partitions_for_topic(topic) or set(range(settings.partitions))
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await log_end_offsets(settings, tps) if to_end else {}  # Tansu's end_offsets() falls short

        async def done() -> bool:
            if to_end:
                return all([await consumer.position(tp) >= ends[tp] for tp in tps])
            return until(out) if until else count is not None and len(out) >= count

        deadline = time.monotonic() + timeout
        while not await done() and time.monotonic() < deadline:
            for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                # Token payloads decode as array.array; the tests compare plain lists.
                out.extend((tp.partition, r.key, as_lists(codec.decode(r.value, topic=topic, expect=expect)))
                           for r in records)
    finally:
        await consumer.stop()
    return out


async def read_keyed(settings: Settings, short: str, expect: str, count: int,
                     timeout: float = 30.0) -> list[tuple[bytes | None, dict[str, Any]]]:
    """(key, value) of the first ``count`` records of a topic; fails if fewer arrive in ``timeout``."""
    out = [(key, value) for _, key, value in await read_records(settings, short, expect, count=count,
                                                                timeout=timeout)]
    assert len(out) >= count, f"only {len(out)} of {count} records on {settings.topic(short)}"
    return out


def read_topic(settings: Settings, short: str, expect: str, **kw: Any) -> list[Record]:
    """:func:`read_records` for synchronous tests."""
    return run_sync(read_records(settings, short, expect, **kw))


def boltstream_argv(*args: str) -> list[str]:
    """argv for the installed ``boltstream`` command (falls back to ``python -m boltstream.cli``)."""
    if BOLTSTREAM.exists():
        return [str(BOLTSTREAM), *args]
    return [sys.executable, "-m", "boltstream.cli", *args]


@pytest.fixture
def boltstream_cmd() -> list[str]:
    """argv prefix that runs the installed ``boltstream`` command (for tests with their own env)."""
    return boltstream_argv()


@pytest.fixture
def s3_client(settings: Settings) -> minio.Minio:
    """A minio client for the stack's S3 endpoint (bucket ``settings.s3_bucket`` exists)."""
    return s3.make_client(settings)


@pytest.fixture
def run_cli(settings_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``boltstream ARGS...`` as a subprocess pointed at this test's settings; returns the result.

    ``env=`` replaces the environment (e.g. a private state file); every call
    has a timeout so a hung command fails the test instead of the session.
    """

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            boltstream_argv(*args),
            env=settings_env if env is None else env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    return run
