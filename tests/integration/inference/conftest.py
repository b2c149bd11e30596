"""Start ``boltstream serve`` subprocesses against the test's stack, and read spans back from the broker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from boltstream.broker.kafka import producer_kwargs
from boltstream.config import Settings
from boltstream.inference.launch import WorkerProcess
from boltstream.schemas import Codec
from boltstream.weights.checkpoints import announce_checkpoint
from tests.integration.conftest import read_keyed

START_TIMEOUT = 90.0


@pytest.fixture
def start_worker(settings_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """``start_worker(*extra_args)`` -> a ready ``boltstream serve --model tiny`` worker; all stopped at the end."""
    workers: list[WorkerProcess] = []

    def start(*args: str, timeout: float = START_TIMEOUT) -> WorkerProcess:
        worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024", *args],
                               env=settings_env, log_path=tmp_path / f"worker-{len(workers)}.log")
        workers.append(worker)
        worker.start(timeout)
        return worker

    try:
        yield start
    finally:
        for w in workers:
            w.stop()


async def read_spans(settings: Settings, expected: int, timeout: float = 30.0) -> list[tuple[bytes, dict[str, Any]]]:
    """(key, Span) for the first ``expected`` records of the spans topic, all partitions, with a deadline."""
    return await read_keyed(settings, "spans", "Span", expected, timeout)


async def announce(settings: Settings, event: dict[str, Any]) -> None:
    """Produce a CheckpointEvent to the checkpoints topic (what the learner does after publishing)."""
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    try:
        await announce_checkpoint(producer, Codec(), settings.topic("checkpoints"), event)
    finally:
        await producer.stop()


@pytest.fixture
def spans_reader() -> Callable[..., Any]:
    return read_spans


@pytest.fixture
def announcer() -> Callable[..., Any]:
    return announce
