"""The allocator boltstream preloads into its children: finding the library, the environment, a real child."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from boltstream.allocator import (
    ALLOCATOR_ENV,
    AllocatorError,
    active_allocator,
    child_env,
    find_library,
    replacement_in,
    resolve,
    with_preload,
)
from boltstream.processes import Processes, free_port, wait_until

DIRS = ["/usr/lib/x86_64-linux-gnu", "/usr/lib"]


def test_resolve_prefers_the_minimal_tcmalloc_in_the_first_directory_that_has_it() -> None:
    have = {"/usr/lib/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"}
    assert resolve("tcmalloc", DIRS, have.__contains__) == "/usr/lib/libtcmalloc_minimal.so.4"
    assert resolve("tcmalloc", DIRS, {"/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"}.__contains__) == \
        "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"
    assert resolve(" JEMALLOC ", DIRS, {"/usr/lib/libjemalloc.so.2"}.__contains__) == "/usr/lib/libjemalloc.so.2"


def test_resolve_gives_none_for_glibc_or_a_library_that_is_not_installed() -> None:
    for choice in ("glibc", "none", "", "GLIBC"):
        assert resolve(choice, DIRS, lambda p: True) is None
    assert resolve("tcmalloc", DIRS, lambda p: False) is None


def test_resolve_rejects_an_unknown_name_or_a_missing_path_naming_the_variable() -> None:
    with pytest.raises(AllocatorError, match=f"{ALLOCATOR_ENV}='mimalloc': expected one of tcmalloc, jemalloc, glibc"):
        resolve("mimalloc", DIRS, lambda p: True)
    with pytest.raises(AllocatorError, match=f"{ALLOCATOR_ENV}=/opt/x.so: no such file"):
        resolve("/opt/x.so", DIRS, lambda p: False)
    assert resolve("/opt/x.so", DIRS, lambda p: True) == "/opt/x.so"


def test_with_preload_puts_the_library_first_once() -> None:
    assert with_preload({"A": "1"}, "/l/t.so") == {"A": "1", "LD_PRELOAD": "/l/t.so"}
    assert with_preload({"LD_PRELOAD": "/x.so:/y.so"}, "/l/t.so")["LD_PRELOAD"] == "/l/t.so /x.so /y.so"
    assert with_preload({"LD_PRELOAD": "/x.so /l/t.so"}, "/l/t.so")["LD_PRELOAD"] == "/x.so /l/t.so"


def test_child_env_leaves_the_environment_alone_when_switched_off() -> None:
    env = {ALLOCATOR_ENV: "glibc", "LD_PRELOAD": "/x.so"}
    assert child_env(env) == env


def test_replacement_in_reads_a_maps_text() -> None:
    line = "7f00-7f10 r-xp 00000000 08:01 42   {}\n"
    assert replacement_in(line.format("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10")) == "tcmalloc"
    assert replacement_in(line.format("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")) == "jemalloc"
    assert replacement_in(line.format("/usr/lib/x86_64-linux-gnu/libc.so.6")) is None
    assert active_allocator() in ("glibc", "tcmalloc", "jemalloc")


def _mapped(pid: int) -> str:
    """The child's maps once the dynamic loader is done with it (libc is mapped after every preload)."""
    def ready() -> str | None:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return None
        return maps if "/libc.so" in maps or "/libc-" in maps else None

    return str(wait_until(ready, 30, f"pid {pid}'s libraries to be mapped"))


TCMALLOC = find_library("tcmalloc")


@pytest.mark.skipif(TCMALLOC is None, reason="libtcmalloc-minimal4 is not installed on this machine")
def test_a_started_worker_runs_on_tcmalloc_unless_switched_off(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ALLOCATOR_ENV, "LD_PRELOAD")}
    on = Processes(tmp_path / "on", env)
    off = Processes(tmp_path / "off", {**env, ALLOCATOR_ENV: "glibc"})
    argv = ("serve", "--model", "tiny", "--served-model-name", "policy", "--no-capture", "--no-reload")
    try:
        worker = on.start("worker", *argv, "--port", str(free_port()), "--workdir", str(tmp_path / "w1"))
        assert replacement_in(_mapped(worker.pid)) == "tcmalloc"
        plain = off.start("worker", *argv, "--port", str(free_port()), "--workdir", str(tmp_path / "w2"))
        assert replacement_in(_mapped(plain.pid)) is None
    finally:
        on.stop_all()
        off.stop_all()


@pytest.mark.skipif(TCMALLOC is None, reason="libtcmalloc-minimal4 is not installed on this machine")
def test_glibc_settings_are_not_applied_under_tcmalloc_and_are_under_glibc() -> None:
    import subprocess
    import sys

    code = ("from boltstream.allocator import active_allocator, keep_heap_for_requests\n"
            "print(active_allocator(), keep_heap_for_requests())")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    on = subprocess.run([sys.executable, "-c", code], env={**env, "LD_PRELOAD": str(TCMALLOC)},
                        capture_output=True, text=True, timeout=60)
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert on.stdout.split() == ["tcmalloc", "False"], on.stderr
    assert off.stdout.split() == ["glibc", "True"], off.stderr
