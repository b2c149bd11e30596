"""Helpers for integration tests (the ``stack`` / ``settings`` fixtures live in tests/conftest.py).

Everything here talks to the real embedded stack; nothing is mocked.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import minio
import pytest

from boltstream import s3
from boltstream.config import Settings

BOLTSTREAM = Path(sys.executable).with_name("boltstream")
CLI_TIMEOUT = 120.0


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
