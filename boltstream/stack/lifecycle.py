"""The embedded stack itself: start, inspect, crash-test and stop a broker + S3 pair, no Docker.

Both services run as background processes in their own session (so Ctrl-C in
the shell that ran ``boltstream stack up`` does not kill them) on free
loopback ports; :mod:`boltstream.stack.services` starts them,
:mod:`boltstream.stack.state` records them. ``stop_stack`` stops exactly the
processes recorded there.

``durable=True`` stores the broker's log in the same S3 endpoint (Tansu's
``s3://`` engine), so killing the broker loses nothing; see
:func:`kill_broker` / :func:`restart_broker`, used by crash tests.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from boltstream import s3
from boltstream.config import Settings, read_state
from boltstream.errors import BoltstreamError, StackError
from boltstream.processes import pid_alive, terminate, wait_dead
from boltstream.stack.services import (
    broker_bin,
    run_sync,
    start_broker,
    start_s3,
    start_tls,
    wait_broker,
    wait_s3,
)
from boltstream.stack.state import (
    CREDENTIALS_ENV,
    STATE_VERSION,
    alive,
    locked,
    resolve_state_file,
    settings_from_state,
    write_state,
)

log = logging.getLogger(__name__)

BROKER_BUCKET_SUFFIX = "-broker"


def start_stack(
    state_file: str | os.PathLike[str] | None = None,
    durable: bool = False,
    partitions: int | None = None,
    namespace: str | None = None,
    timeout: float = 60.0,
    die_with_parent: bool = False,
    secure: bool = False,
) -> dict[str, Any]:
    """Start broker + S3, wait until both answer, create topics and bucket; return the state.

    ``secure``: the broker is reached over TLS only (a generated self-signed certificate; see
    :mod:`boltstream.stack.tls`), and the state tells every client ``security_protocol=SSL`` and
    the ``ssl_cafile`` to verify it with.

    If the state file names a stack whose processes all live, nothing is
    started and that state is returned with ``already_running: True``. A
    stale state file (some pid dead) is cleaned up and replaced. On any
    failure every process started here is stopped before StackError is raised.

    ``die_with_parent`` (Linux) makes the kernel SIGTERM both processes when
    the calling thread dies, even by SIGKILL: for test sessions and the demo,
    whose stack must never outlive them. ``boltstream stack up`` leaves it off
    because its stack must outlive the command. Call this (and
    :func:`restart_broker`) from a long-lived thread when it is on.
    """
    path = resolve_state_file(state_file)
    with locked(path):
        existing = read_state(path)
        if existing:
            liveness = alive(existing)
            if liveness and all(liveness.values()):
                log.info("embedded stack already running (%s)", path)
                return {**existing, "already_running": True}
            log.warning("replacing stale stack state %s (alive: %s)", path, liveness)
            _stop_state(existing)
            path.unlink(missing_ok=True)
        state = _new_state(path, durable=durable, partitions=partitions, namespace=namespace,
                           die_with_parent=die_with_parent, secure=secure)
        try:
            _start_services(path, state, time.monotonic() + timeout)
        except BaseException:
            _stop_state(state)
            path.unlink(missing_ok=True)
            raise
    log.info("embedded stack up: kafka %s, s3 %s", state["bootstrap_servers"], state["s3_endpoint"])
    return state


def _new_state(path: Path, *, durable: bool, partitions: int | None, namespace: str | None,
               die_with_parent: bool, secure: bool) -> dict[str, Any]:
    """The state of a stack about to start: its settings, binaries and log files (no process yet)."""
    defaults = Settings()
    log_prefix = path.with_suffix("")
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "state_file": str(path.resolve()),
        "durable": durable,
        "die_with_parent": die_with_parent,
        "namespace": namespace if namespace is not None else defaults.namespace,
        "partitions": partitions if partitions is not None else defaults.partitions,
        "s3_bucket": defaults.s3_bucket,
        "s3_access_key": defaults.s3_access_key,
        "s3_secret_key": defaults.s3_secret_key,
        "s3_region": defaults.s3_region,
        "broker_bucket": defaults.s3_bucket + BROKER_BUCKET_SUFFIX,
        "broker_bin": broker_bin(),
        "pids": {},
        "proc_starts": {},
        "logs": {"broker": f"{log_prefix}.broker.log", "s3": f"{log_prefix}.s3.log"},
        "secure": secure,
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    state["broker_storage"] = f"s3://{state['broker_bucket']}/" if durable else "memory://tansu/"
    if secure:
        state["tls_dir"] = f"{log_prefix}.tls"
        state["logs"]["tls"] = f"{log_prefix}.tls.log"
    return state


def _start_services(path: Path, state: dict[str, Any], deadline: float) -> None:
    """Start S3 (and the TLS front when secure) and the broker, wait for both, create bucket and topics.

    The state file is written as soon as the broker process exists, so ``down`` can clean up
    even if this process dies; the caller stops everything when this raises.
    """
    start_s3(state)
    if state["durable"]:
        # Tansu's s3:// engine needs its bucket before it starts.
        write_state(path, state)
        wait_s3(state, deadline)
        s3.ensure_bucket(s3.make_client(settings_from_state(state)), state["broker_bucket"])
    if state["secure"]:
        start_tls(state)
    start_broker(state, state.get("broker_port"))
    write_state(path, state)  # from here on `down` can clean up even if we die
    wait_s3(state, deadline)
    wait_broker(state, deadline)
    settings = settings_from_state(state)
    s3.ensure_bucket(s3.make_client(settings), state["s3_bucket"])
    from boltstream.broker.topics import ensure_topics

    run_sync(ensure_topics(settings, timeout=max(1.0, deadline - time.monotonic())))
    write_state(path, state)


def _stop_state(state: dict[str, Any], timeout: float = 10.0) -> None:
    """Stop the state's processes, broker first (it may still flush to S3)."""
    starts = state.get("proc_starts", {})
    pids = state.get("pids", {})
    errors = []
    for name in sorted(pids, key=lambda n: n != "broker"):
        try:
            terminate(int(pids[name]), starts.get(name), timeout)
        except BoltstreamError as exc:
            errors.append(f"{name}: {exc}")
    if errors:
        raise StackError("could not stop: " + "; ".join(errors))


def stop_stack(state_file: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> bool:
    """Stop exactly the processes the state file records and remove it; False if there was none."""
    path = resolve_state_file(state_file)
    with locked(path):
        state = read_state(path)
        if not state:
            log.info("no embedded stack state at %s", path)
            return False
        _stop_state(state, timeout)
        path.unlink(missing_ok=True)
    log.info("embedded stack down (%s)", path)
    return True


def stack_status(state_file: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The recorded state plus liveness: ``running`` is true only when every process lives."""
    path = resolve_state_file(state_file)
    state = read_state(path)
    if not state:
        return {"running": False, "state_file": str(path.resolve()), "alive": {}}
    liveness = alive(state)
    return {
        **state,
        "state_file": str(path.resolve()),
        "alive": liveness,
        "running": bool(liveness) and all(liveness.values()),
        "credentials_env": dict(CREDENTIALS_ENV),
    }


def kill_broker(state_file: str | os.PathLike[str] | None = None, sig: int = signal.SIGKILL) -> None:
    """Kill the broker (default SIGKILL, a crash) and wait until it is gone; S3 keeps running."""
    path = resolve_state_file(state_file)
    state = read_state(path)
    if not state:
        raise StackError(f"no embedded stack state at {path}")
    pid, start = int(state["pids"]["broker"]), state.get("proc_starts", {}).get("broker")
    if pid_alive(pid, start):
        os.kill(pid, sig)
    if not wait_dead(pid, start, 10.0):
        raise StackError(f"broker pid {pid} did not die after signal {sig}")


def restart_broker(state_file: str | os.PathLike[str] | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Start the broker again on the SAME address and storage (stopping it first if it runs).

    Same port so clients (and the state file's readers) need no new address;
    with ``durable`` storage the restarted broker serves everything written before.
    """
    path = resolve_state_file(state_file)
    with locked(path):
        state = read_state(path)
        if not state:
            raise StackError(f"no embedded stack state at {path}")
        terminate(int(state["pids"]["broker"]), state.get("proc_starts", {}).get("broker"))
        port = int(state.get("broker_port") or state["bootstrap_servers"].rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        while True:  # the old listener may need a moment to release the port
            start_broker(state, port)
            try:
                wait_broker(state, deadline)
                break
            except StackError:
                terminate(int(state["pids"]["broker"]), state["proc_starts"].get("broker"))
                if time.monotonic() > deadline:
                    raise
        write_state(path, state)
    log.info("broker restarted (pid %d) on %s", state["pids"]["broker"], state["bootstrap_servers"])
    return state


@contextlib.contextmanager
def embedded_stack(
    directory: str | os.PathLike[str],
    durable: bool = False,
    partitions: int | None = None,
    namespace: str | None = None,
    timeout: float = 60.0,
    secure: bool = False,
) -> Iterator[Settings]:
    """``with embedded_stack(tmpdir) as settings:`` a private stack, always stopped on exit.

    Its processes are tied to this process (``die_with_parent``), so not even
    a SIGKILLed test run leaves them behind.
    """
    state_file = Path(directory) / "stack.json"
    state = start_stack(
        state_file,
        durable=durable,
        partitions=partitions,
        namespace=namespace,
        timeout=timeout,
        die_with_parent=True,
        secure=secure,
    )
    try:
        yield settings_from_state(state)
    finally:
        if not state.get("already_running"):
            stop_stack(state_file)
