"""boltstream.processes: children start with a log, are told apart from recycled pids, and always stop."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from boltstream.errors import BoltstreamError
from boltstream.processes import (
    LOOPBACK,
    Processes,
    free_port,
    pid_alive,
    proc_start_time,
    spawn,
    terminate,
    wait_dead,
    wait_until,
)

SLEEPER = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]
# Ignores SIGTERM, and says so only once the handler is in place.
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"]


def _ready(log: Path) -> None:
    wait_until(lambda: log.is_file() and "ready" in log.read_text(), 10, f"'ready' in {log}")


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind((LOOPBACK, port))


def test_free_port_is_never_one_the_kernel_hands_to_outgoing_connections() -> None:
    """The race behind the flaky two-rank DeepSpeed test: an ephemeral port can be taken before it is bound."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(50)}
    assert not [p for p in ports if low <= p <= high], (low, high)
    assert len(ports) > 40, "random draws: concurrent callers rarely get the same port"


def test_terminate_stops_a_child_and_a_recycled_pid_is_not_alive(tmp_path: Path) -> None:
    log = tmp_path / "sleeper.log"
    proc = spawn("sleeper", SLEEPER, log, dict(os.environ))
    _ready(log)
    start = proc_start_time(proc.pid)
    assert pid_alive(proc.pid, start)
    assert not pid_alive(proc.pid, "not-its-start-time")  # what a recycled pid looks like

    terminate(proc.pid, start, timeout=5)

    assert not pid_alive(proc.pid, start)
    assert proc.returncode == -15


def test_terminate_escalates_to_sigkill(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    proc = spawn("stubborn", STUBBORN, log, dict(os.environ))
    _ready(log)

    terminate(proc.pid, timeout=0.5)

    assert proc.returncode == -9


def test_terminate_group_stops_what_the_child_started(tmp_path: Path) -> None:
    log = tmp_path / "sh.log"
    proc = spawn("sh", ["sh", "-c", "sleep 60 & echo $!; wait"], log, dict(os.environ))
    grandchild = int(wait_until(lambda: log.read_text().strip(), 10, "the grandchild's pid"))
    assert pid_alive(grandchild)

    terminate(proc.pid, timeout=5, group=True)

    assert wait_dead(grandchild, None, 5), "the grandchild outlived its process group's SIGTERM"


def test_die_with_parent_stops_the_child_when_its_thread_ends(tmp_path: Path) -> None:
    log = tmp_path / "tied.log"
    started = []
    thread = threading.Thread(target=lambda: started.append(
        spawn("tied", SLEEPER, log, dict(os.environ), die_with_parent=True)))
    thread.start()
    thread.join(10)
    proc = started[0]
    try:
        assert wait_dead(proc.pid, None, 10), "the child outlived the thread that started it"
        assert proc.returncode == -15
    finally:
        terminate(proc.pid)


def test_processes_check_names_the_crashed_child_with_its_log(tmp_path: Path) -> None:
    procs = Processes(tmp_path / "logs", dict(os.environ))
    try:
        crashed = procs.start("bad", "no-such-command")
        wait_until(lambda: crashed.poll() is not None, 30, "the bad command to exit")
        with pytest.raises(BoltstreamError, match=r"(?s)bad exited with 2.*unknown command 'no-such-command'"):
            procs.check()
        with pytest.raises(BoltstreamError, match="bad exited"):  # a wait on the others fails at once
            wait_until(lambda: False, 30, "something", procs)
    finally:
        procs.stop_all()
    assert procs.procs == {}


def test_wait_until_returns_the_value_or_names_what_it_waited_for() -> None:
    assert wait_until(lambda: 42, 1, "the answer") == 42
    with pytest.raises(BoltstreamError, match="timed out after 0s waiting for nothing"):
        wait_until(lambda: None, 0.1, "nothing")
