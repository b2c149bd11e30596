"""Run ``boltstream serve`` as a child process and know when it is ready (benchmarks, tests).

(``boltstream train`` and the demo start their worker with the other components through
:class:`boltstream.processes.Processes` and wait for its ``/health``.)

Readiness is the worker's own stdout line ``boltstream serve: ready on URL``,
written once the socket is bound and the app (model, broker producer,
checkpoint follower) has started, so callers block on that line with a
deadline instead of polling. Stopping is SIGTERM, a bounded wait, then SIGKILL.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

READY = re.compile(r"boltstream serve: ready on (http://\S+)")


def serve_argv(*args: str, python: str | None = None) -> list[str]:
    """argv for ``boltstream serve ARGS`` with the installation of ``python`` (default: this interpreter's;
    the vLLM worker has a virtualenv of its own)."""
    python = python or sys.executable
    exe = Path(python).with_name("boltstream")
    base = [str(exe)] if exe.exists() else [python, "-m", "boltstream.cli"]
    return [*base, "serve", *args]


class WorkerProcess:
    """One ``boltstream serve`` child; ``url`` is set once it is ready. Use as a context manager."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, python: str | None = None) -> None:
        self.args = list(args)
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.log_path = Path(log_path) if log_path else None
        self.url: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self, timeout: float = 120.0) -> str:
        """Start the worker and return its base URL (without ``/v1``) once it is ready."""
        err = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(serve_argv(*self.args, python=self.python), env=self.env, stdout=subprocess.PIPE, stderr=err,
                                         stdin=subprocess.DEVNULL, text=True)
        finally:
            if self.log_path:
                err.close()
        threading.Thread(target=self._pump, daemon=True, name="boltstream-worker-stdout").start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError(f"worker not ready within {timeout:.0f}s{self._tail()}") from None
            if line is None:
                self.stop()
                raise RuntimeError(f"worker exited with {self.proc.returncode} before it was ready{self._tail()}")
            m = READY.search(line)
            if m:
                self.url = m.group(1)
                return self.url

    def _pump(self) -> None:
        """Drain stdout for the worker's whole life (a full pipe would block it)."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return ":\n" + self.log_path.read_text(errors="replace")[-3000:]
        return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("worker %d ignored SIGTERM for %.0fs; killing it", self.proc.pid, timeout)
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def __enter__(self) -> WorkerProcess:
        if self.url is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
