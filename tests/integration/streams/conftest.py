"""Fixtures for the stream app's integration tests: worker processes started per test, always stopped."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from boltstream.config import Settings
from tests.integration.streams.stream_helpers import WORKER_ENV, WorkerProcess


@pytest.fixture
def start_worker(
    settings: Settings, settings_env: dict[str, str], boltstream_cmd: list[str], tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """``start_worker(app_id, *args, **env)``: a worker process; all are stopped after the test."""
    workers: list[WorkerProcess] = []

    def start(app_id: str, *args: str, **env: str) -> WorkerProcess:
        full_env = {**settings_env, **WORKER_ENV, **env}
        log_path = tmp_path / f"worker-{len(workers)}.log"
        argv = [*boltstream_cmd, "stream", "worker", "--app-id", app_id, *args]
        worker = WorkerProcess(argv, full_env, log_path)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture
def app_id(settings: Settings) -> str:
    return f"{settings.namespace}stream-{uuid.uuid4().hex[:6]}"
