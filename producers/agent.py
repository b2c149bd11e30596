"""Loading and calling the user's agent function: sync or async, one or two arguments, with a time limit.

The contract (docs/producers.md, "Runner"): ``module:function`` or
``path/to/file.py:function`` names either

* ``fn(task: dict) -> reward`` (ids and endpoints via ``boltstream.current_rollout()``), or
* ``fn(task: dict, ctx: RolloutContext) -> reward``,

``def`` or ``async def``. The return value is the final reward: a number, a
dict of named numbers, or None (no final reward, e.g. when the agent called
``emit_reward(..., final=True)`` itself).

Time limits. An ``async`` agent is cancelled at the limit (``asyncio.wait_for``).
A sync agent runs in a worker thread, and Python cannot kill a thread: at the
limit the rollout is recorded as ``timeout`` and the thread is ABANDONED (it
keeps its pool slot until it returns by itself; whatever it still emits lands
after the root span and is left to the stream app's grace rules). The runner
counts abandoned threads and exits with status 3 when they exceed
``max_abandoned`` so a supervisor restarts the process, the only way to really
stop them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boltstream.errors import ConfigError

from .context import RolloutContext, RolloutTimeout


def load_agent(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (or ``file.py:function``); the current directory is importable."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("--agent", spec, "expected module:function or path/to/file.py:function")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name).resolve()
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[path.stem] = module
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError("--agent", spec, f"cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError("--agent", spec, f"{module_name} has no callable {attr!r}")
    return fn


def wants_context(fn: Callable[..., Any]) -> bool:
    """True when ``fn`` takes a second positional argument (the RolloutContext)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def is_async(fn: Callable[..., Any]) -> bool:
    """``async def`` functions, and objects whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = type(fn).__dict__.get("__call__") if not inspect.isroutine(fn) else None
    return call is not None and inspect.iscoroutinefunction(call)


class AgentInvoker:
    """Calls the agent for one attempt with a time limit; tracks abandoned threads."""

    def __init__(self, fn: Callable[..., Any], workers: int, max_abandoned: int) -> None:
        self.fn = fn
        self.with_ctx = wants_context(fn)
        self.is_async = is_async(fn)
        self.max_abandoned = max_abandoned
        self._abandoned = 0
        self._lock = threading.Lock()
        self._pool = None if self.is_async else concurrent.futures.ThreadPoolExecutor(
            max_workers=workers + max_abandoned, thread_name_prefix="boltstream-agent")

    @property
    def abandoned(self) -> int:
        return self._abandoned

    def _args(self, task: dict[str, Any], ctx: RolloutContext) -> tuple[Any, ...]:
        return (task, ctx) if self.with_ctx else (task,)

    async def __call__(self, task: dict[str, Any], ctx: RolloutContext, timeout: float | None) -> Any:
        """The agent's return value; raises RolloutTimeout at the limit, the agent's exception otherwise."""
        if self.is_async:
            try:
                return await asyncio.wait_for(self.fn(*self._args(task, ctx)), timeout)
            except TimeoutError:
                raise RolloutTimeout(f"agent did not finish within {timeout:g}s (cancelled)") from None
        loop = asyncio.get_running_loop()
        cv = contextvars.copy_context()  # the thread sees the rollout's span, baggage and current_rollout()
        cfut = self._pool.submit(cv.run, self.fn, *self._args(task, ctx))  # type: ignore[union-attr]
        afut = asyncio.wrap_future(cfut, loop=loop)
        try:
            result = await asyncio.wait_for(asyncio.shield(afut), timeout)
        except TimeoutError:
            with self._lock:
                self._abandoned += 1
            cfut.add_done_callback(self._released)
            afut.add_done_callback(lambda f: f.cancelled() or f.exception())  # silence "never retrieved"
            raise RolloutTimeout(f"agent did not finish within {timeout:g}s (thread abandoned)") from None
        if inspect.isawaitable(result):  # a sync wrapper returning a coroutine
            result = await asyncio.wait_for(result, timeout)
        return result

    def _released(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._abandoned -= 1

    def over_limit(self) -> bool:
        return self._abandoned > self.max_abandoned

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
