"""Pace the runner to the learner: at most K tasks per policy version the inference worker serves.

Why: rollouts run on the same machines as training. A runner that never stops
produces groups faster than the learner consumes them; they go stale (dropped
by the learner's ``max_staleness``) after costing the CPU or GPU time the
learner needed. With ``--tasks-per-version K`` the runner starts K tasks, then
waits until the worker serves a newer policy (a long-poll on its ``/health``,
no busy polling) before it starts the next K. K = the learner's groups per step
makes every step's data come from the policy just trained (on-policy, like a
synchronous loop) while keeping the pipeline's crash safety; a larger K lets
generation run ahead of training by K / groups-per-step steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

LONG_POLL_S = 30.0
RETRY_S = 2.0


def health_url(base_url: str) -> str:
    """``http://host:port/v1`` (or ``.../rollout/.../v1``) -> ``http://host:port/health``."""
    parts = urllib.parse.urlsplit(base_url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))


class PolicyPacer:
    """Admits ``tasks_per_version`` tasks per served policy version; ``run()`` follows the version."""

    def __init__(self, base_url: str, tasks_per_version: int, on_change: Callable[[], None]) -> None:
        if tasks_per_version < 1:
            raise ValueError(f"tasks_per_version must be >= 1, got {tasks_per_version}")
        self.url = health_url(base_url)
        self.tasks_per_version = tasks_per_version
        self.version: int | None = None
        self.started = 0
        self._on_change = on_change
        self._full = asyncio.Event()

    def room(self) -> int:
        """Tasks that may start now (0 until the served version is known)."""
        return 0 if self.version is None else max(0, self.tasks_per_version - self.started)

    def started_one(self) -> None:
        self.started += 1
        if self.started >= self.tasks_per_version:
            self._full.set()

    def _get(self, min_version: int | None) -> int:
        query = "" if min_version is None else "?" + urllib.parse.urlencode(
            {"min_version": min_version, "timeout": LONG_POLL_S})
        with urllib.request.urlopen(self.url + query, timeout=LONG_POLL_S + 10) as resp:
            return int(json.loads(resp.read())["policy_version"])

    async def _version(self, min_version: int | None, stop: asyncio.Event) -> int | None:
        try:
            return await in_daemon_thread(self._get, min_version)
        except Exception as exc:  # worker restarting or not up yet: keep the last version, retry
            log.warning("policy pacing: %s unreachable (%s); retrying in %.0fs", self.url, exc, RETRY_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RETRY_S)
            return None

    async def run(self, stop: asyncio.Event) -> None:
        while self.version is None and not stop.is_set():
            self.version = await self._version(None, stop)
        self._on_change()
        while not stop.is_set():
            await self._full.wait()
            log.info("policy pacing: %d task(s) started on policy version %s; waiting for a newer one",
                     self.started, self.version)
            while not stop.is_set():
                got = await self._version((self.version or 0) + 1, stop)
                if got is not None and got > (self.version or 0):
                    self.version, self.started = got, 0
                    self._full.clear()
                    self._on_change()
                    break


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of its own that nothing waits for.

    Why: a long poll in flight when the runner stops would hold ``asyncio.run``'s exit (it joins the
    default executor's threads) for up to ``LONG_POLL_S``; cancelling the await leaves this thread to
    finish alone, and a daemon thread does not hold the interpreter's exit either.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting task, raised there
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="boltstream-policy-long-poll", daemon=True).start()
    return await done
