"""Child processes: start them with a log file, tell whether they live, stop them for sure.

The embedded stack (:mod:`boltstream.stack`) and whole runs (:mod:`boltstream.runs`)
both start every component as a process of its own; they share this one way
to do it. A child runs in its own session, so Ctrl-C in the shell reaches
only the parent, which then stops the children itself; ``die_with_parent``
(Linux) also has the kernel stop a child when the parent dies without
cleaning up, even by SIGKILL. A pid recorded elsewhere (a state file) only
counts as the same process while its /proc start time still matches, so a
recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boltstream.allocator import child_env
from boltstream.errors import BoltstreamError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Popen objects of processes this interpreter started, kept so they are reaped (no zombies,
# no "subprocess still running" warnings) when this same process stops them.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


# free_port() draws from [PORT_FLOOR, start of the kernel's ephemeral range).
PORT_FLOOR = 20_000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_ATTEMPTS = 64


def _ephemeral_start() -> int | None:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on loopback that nothing uses now and that the kernel will not hand out by itself.

    Why not bind port 0: the port is chosen here and bound later by another process
    (a service, gloo's rendezvous store), and the kernel gives every OUTGOING
    connection of every process a local port from that same ephemeral range. A busy
    machine (broker and S3 clients, parallel tests) then took the chosen port in
    between: the two-rank DeepSpeed test failed with EADDRINUSE when rank 0's
    TCPStore could not listen. Below the ephemeral range only an explicit bind can
    take the port; each call draws at random there, so concurrent callers rarely
    meet. Falls back to port 0 where the range is unknown (not Linux) or too low.
    """
    start = _ephemeral_start()
    if start is not None and start - PORT_FLOOR >= 1024:
        for _ in range(_ATTEMPTS):
            port = random.randrange(PORT_FLOOR, start)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _pdeathsig_hook() -> Callable[[], None]:
    """A preexec hook asking Linux to SIGTERM the child when the thread that started it dies.

    prctl is looked up here, in the parent: only the bare call runs between
    fork and exec, where loading libraries is unsafe.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:  # pragma: no cover - runs in the child
        prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG

    return hook


def spawn(
    name: str,
    argv: list[str],
    log_path: str | os.PathLike[str],
    env: dict[str, str],
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session, stdout and stderr appended to ``log_path``.

    With ``die_with_parent`` the calling thread must live as long as the child
    should: the kernel ties the child to the thread, not the process.
    """
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


def proc_start_time(pid: int) -> str | None:
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
        current = proc_start_time(pid)
        return current is not None and (start_time is None or current == start_time)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_dead(pid: int, start_time: str | None, timeout: float) -> bool:
    """Wait up to ``timeout`` for ``pid`` to exit; False if it still runs."""
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


def terminate(pid: int, start_time: str | None = None, timeout: float = 10.0, group: bool = False) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; raise BoltstreamError if it still lives.

    ``group`` signals the child's whole process group (its session), so what the
    child started itself stops with it.
    """
    if not pid_alive(pid, start_time):
        _CHILDREN.pop(pid, None)
        return
    send = os.killpg if group else os.kill
    with contextlib.suppress(ProcessLookupError):
        send(pid, signal.SIGTERM)
    if wait_dead(pid, start_time, timeout):
        return
    log.warning("pid %d ignored SIGTERM for %.0fs; sending SIGKILL", pid, timeout)
    with contextlib.suppress(ProcessLookupError):
        send(pid, signal.SIGKILL)
    if not wait_dead(pid, start_time, 5.0):
        raise BoltstreamError(f"pid {pid} survived SIGKILL")


def log_tail(path: str | os.PathLike[str], lines: int = 20) -> str:
    """The last ``lines`` of a log, for an error message about the process that wrote it."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Processes:
    """``boltstream ...`` child processes with logs in one folder; stops every one of them, always.

    The children die with the thread that started them (``die_with_parent``),
    so a run killed by SIGKILL leaves no component behind.
    """

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``boltstream <args>`` as ``name`` (its log: ``<log_dir>/<name>.log``), with the allocator of
        :mod:`boltstream.allocator` preloaded where it is installed (learner, worker, stream app)."""
        argv = [sys.executable, "-m", "boltstream.cli", *args]
        proc = spawn(name, argv, self.log_path(name), child_env(self.env), die_with_parent=True)
        self.procs[name] = proc
        return proc

    def start_command(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start any program as ``name`` (an agent run the way its users run it), with ``env`` added."""
        proc = spawn(name, argv, self.log_path(name), {**self.env, **(env or {})}, die_with_parent=True)
        self.procs[name] = proc
        return proc

    def check(self) -> None:
        """Raise, with its log's tail, if any child exited with an error."""
        for name, proc in self.procs.items():
            if proc.poll() not in (None, 0):
                raise BoltstreamError(
                    f"{name} exited with {proc.returncode}; last log lines:\n{log_tail(self.log_path(name), 40)}"
                )

    def stop(self, name: str, timeout: float = 20.0) -> None:
        """Stop ``name`` and what it started (SIGTERM, SIGKILL after ``timeout``)."""
        proc = self.procs.pop(name, None)
        if proc is not None:
            terminate(proc.pid, timeout=timeout, group=True)

    def stop_all(self) -> None:
        """Stop every child, the last started first."""
        for name in list(self.procs)[::-1]:
            self.stop(name)


def wait_until(cond: Callable[[], Any], timeout: float, what: str, procs: Processes | None = None) -> Any:
    """Poll ``cond`` until it returns a truthy value; fail with ``what`` at the deadline.

    With ``procs``, a child that crashes fails the wait at once instead of at the deadline.
    """
    deadline = time.monotonic() + timeout
    delay = 0.05
    while time.monotonic() < deadline:
        if procs is not None:
            procs.check()
        value = cond()
        if value:
            return value
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
    raise BoltstreamError(f"timed out after {timeout:.0f}s waiting for {what}")
