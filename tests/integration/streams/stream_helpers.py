"""Helpers for the stream app's integration tests: worker processes, producing spans, reading outputs.

Workers are real ``boltstream stream worker`` subprocesses against the session
stack (``settings_env``); every one is stopped with a timeout at the end of
its test, SIGKILLed if it does not stop. Nothing sleeps to synchronise: reads
poll the broker until a condition holds or a deadline passes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from boltstream.broker.kafka import consumer_kwargs, producer_kwargs
from boltstream.config import Settings
from boltstream.schemas import Codec
from boltstream.schemas.packed import as_lists

STOP_TIMEOUT = 20.0
# Short timers so tests never wait on production defaults.
WORKER_ENV = {"BOLTSTREAM_STREAM_TICK_S": "0.2", "BOLTSTREAM_STREAM_LOG_EVERY_S": "2"}


class WorkerProcess:
    """One ``boltstream stream worker`` subprocess with its log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log_path.parent
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash the changelog design is for."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (faust's graceful stop), SIGKILL after ``timeout``; returns the exit code."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self._log.close()
        return int(self.proc.returncode)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


async def produce(
    settings: Settings, topic: str, records: Iterable[tuple[bytes | None, bytes | None]], pace: float = 0.0,
    chunk: int = 50, **producer_settings: Any,
) -> list[Any]:
    """Produce ``records`` (key, value) in order and wait for every ack; returns the RecordMetadata list.

    ``pace`` > 0 spreads them out: ``chunk`` records, then that many seconds, and so on.
    ``producer_settings`` override :func:`producer_kwargs` (e.g. a long linger for bulk loads).
    """
    producer = AIOKafkaProducer(**producer_kwargs(settings, **producer_settings))
    await producer.start()
    try:
        futures = []
        for i, (key, value) in enumerate(records):
            futures.append(await producer.send(topic, value, key=key))
            if pace and (i + 1) % chunk == 0:
                await asyncio.sleep(pace)  # load shaping, not synchronisation
        return list(await asyncio.gather(*futures))
    finally:
        await producer.stop()


class TopicReader:
    """Reads a topic from the beginning, decoding each value with the codec (``expect`` record)."""

    def __init__(self, settings: Settings, topic: str, expect: str) -> None:
        self.settings = settings
        self.topic = topic
        self.expect = expect
        self.codec = Codec()
        self.records: list[dict[str, Any]] = []
        self.raw: list[Any] = []
        self._consumer = AIOKafkaConsumer(topic, **consumer_kwargs(settings, None, fetch_max_wait_ms=50))

    async def __aenter__(self) -> TopicReader:
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 200) -> int:
        """Fetch what is there now; returns how many new records."""
        batches = await self._consumer.getmany(timeout_ms=timeout_ms)
        n = 0
        for records in batches.values():
            for record in records:
                self.raw.append(record)
                # Token payloads decode as array.array; the tests compare plain lists.
                self.records.append(as_lists(self.codec.decode(record.value, topic=self.topic, expect=self.expect)))
                n += 1
        return n

    async def until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll until ``condition()`` holds; fail with ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
            await self.poll()

    async def until_samples(self, expected: Iterable[str], timeout: float, log_tail: Callable[[], str]) -> None:
        """Poll a batches topic until every ``expected`` sample id arrived; fail naming the missing ones
        and showing ``log_tail()`` (the worker's log) after ``timeout`` seconds."""
        want = set(expected)

        def missing() -> set[str]:
            return want - {s["sample_id"] for s in samples_of(self.records)}

        try:
            await self.until(lambda: not missing(), timeout, f"{len(want)} samples")
        except AssertionError:
            gone = sorted(missing())
            raise AssertionError(f"missing {len(gone)}: {gone[:10]}; worker log:\n{log_tail()}") from None

    async def quiet(self, idle: float, timeout: float) -> None:
        """Poll until nothing new arrived for ``idle`` seconds (or ``timeout``): late duplicates included."""
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last < idle:
            if await self.poll():
                last = time.monotonic()


def samples_of(batches: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every Sample of every TrainingBatch part, in arrival order (duplicates kept)."""
    return [sample for batch in batches for sample in batch["samples"]]
