"""Which malloc the processes boltstream starts use: tcmalloc, preloaded, where it is installed.

Why: glibc's malloc serves the learner badly either way. With its defaults its mmap threshold
rises after the first backward pass, so freed activations stay in a fragmented heap the process
keeps (the demo's learner: 4.2 GB peak RSS); pinning the threshold (``mallopt``) makes every
allocation above it a fresh ``mmap`` the kernel zero-fills, ~1.4x the compute of a training step
and of a prefill. tcmalloc keeps freed memory in size-classed caches it reuses: measured on
SmolLM2-135M + LoRA, demo-shaped steps (``benchmarks/bench_allocators.py``), it is as fast as
glibc's defaults with a lower peak than the pinned threshold (numbers: docs/learner.md, Memory).

An allocator can only be swapped before a process starts, so :func:`child_env` adds the library
to ``LD_PRELOAD`` in the environment of each child (:func:`boltstream.processes.spawn`). The
library is the distribution's (Debian: ``libtcmalloc-minimal4``); where it is absent the children
keep glibc with the ``mallopt`` settings below, and a log line says so.
``BOLTSTREAM_ALLOCATOR`` chooses: ``tcmalloc`` (default), ``jemalloc``, ``glibc`` (preload
nothing), or the path of a shared object.

The glibc malloc settings a long-running process fixes at start (``mallopt``), for when glibc
serves malloc.

The processes boltstream starts (learner, inference worker, stream app) run on tcmalloc where it
is installed (preloaded, above): these settings are then not applied
(:func:`mallopt` returns False and logs it), since tcmalloc ignores them and needs none. Without
tcmalloc they are what keeps memory in check, at a price in compute:

Why: glibc adapts its thresholds to what the process frees, which serves short programs
well and servers badly. Two cases here:

* the learner (:mod:`boltstream.learner.memory`): freed activations raised the mmap
  threshold until every one came from a heap that is never given back (4.2 GB vs 2.3 GB peak);
* the inference worker (:func:`keep_heap_for_requests`): each captured call builds and frees
  tens of KiB (a 4,000-token prompt is 16 KiB of ids, its encoded span 20 KiB). With the
  default 128 KiB trim threshold, glibc hands such freed memory at the heap's top back to the
  kernel and faults it in again for the next call: measured in ``benchmarks/bench_exporter.py``,
  a 4,000 + 500 token capture cost 62 µs of CPU with the defaults, 40 µs with the heap kept.

The price: setting any of these thresholds also switches off glibc's dynamic mmap threshold, so
every allocation at or above 128 KiB (``M_MMAP_THRESHOLD``'s start) is a fresh ``mmap`` the
kernel zero-fills, and for a model's activations that is most of them: a SmolLM2-135M forward +
backward or a batched prefill took ~1.35-1.55x as long as with glibc's defaults
(``benchmarks/bench_allocators.py``), which is why tcmalloc is preferred.

A platform without glibc keeps its allocator's behaviour: the functions return False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from boltstream.errors import BoltstreamError

log = logging.getLogger(__name__)

ALLOCATOR_ENV = "BOLTSTREAM_ALLOCATOR"
DEFAULT = "tcmalloc"
GLIBC = "glibc"
# Shared objects by kind, preferred first: tcmalloc's minimal build has no heap profiler to load.
LIBRARIES: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}
_logged: set[str] = set()


class AllocatorError(BoltstreamError):
    """``BOLTSTREAM_ALLOCATOR`` names no known allocator and no shared object that exists."""


def library_dirs() -> list[str]:
    """Where distributions install shared libraries, this platform's multiarch directory first."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    return [*dirs, "/usr/lib64", "/usr/lib", "/usr/local/lib"]


def resolve(choice: str, dirs: Sequence[str], exists: Callable[[str], bool]) -> str | None:
    """The shared object to preload for ``choice`` (a kind, ``glibc``, or a path), or None for none.

    A kind whose library is in none of ``dirs`` gives None (the caller falls back to glibc); a
    path that does not exist, or an unknown name, is an :class:`AllocatorError`.
    """
    choice = choice.strip()
    if choice.lower() in (GLIBC, "none", ""):
        return None
    if "/" in choice:
        if not exists(choice):
            raise AllocatorError(f"{ALLOCATOR_ENV}={choice}: no such file")
        return choice
    names = LIBRARIES.get(choice.lower())
    if names is None:
        raise AllocatorError(f"{ALLOCATOR_ENV}={choice!r}: expected one of "
                             f"{', '.join([*LIBRARIES, GLIBC])} or the path of a shared object")
    for name in names:
        for d in dirs:
            path = f"{d}/{name}"
            if exists(path):
                return path
    return None


def with_preload(env: Mapping[str, str], path: str) -> dict[str, str]:
    """``env`` with ``path`` first in ``LD_PRELOAD`` (kept as it is when already there)."""
    current = env.get("LD_PRELOAD", "").replace(":", " ").split()
    if path in current:
        return dict(env)
    return {**env, "LD_PRELOAD": " ".join([path, *current])}


def find_library(choice: str) -> str | None:
    """:func:`resolve` against this machine's library directories."""
    return resolve(choice, library_dirs(), lambda p: Path(p).is_file())


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a child process starts with: the chosen allocator preloaded when it is found.

    Logs once per choice which allocator the children get.
    """
    choice = env.get(ALLOCATOR_ENV, os.environ.get(ALLOCATOR_ENV, DEFAULT))
    path = find_library(choice)
    if choice not in _logged:
        _logged.add(choice)
        if path:
            log.info("child processes use %s (LD_PRELOAD=%s; %s=glibc turns it off)", choice, path, ALLOCATOR_ENV)
        elif choice.strip().lower() in (GLIBC, "none", ""):
            log.info("child processes use glibc malloc (%s=%s)", ALLOCATOR_ENV, choice)
        else:
            log.info("%s not found in %s: child processes use glibc malloc with the mallopt settings "
                     "(install libtcmalloc-minimal4 for the faster learner)", choice, ", ".join(library_dirs()))
    return with_preload(env, path) if path else dict(env)


# ------------------------------------------------------------------ glibc's settings, when glibc serves malloc

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
REQUEST_HEAP_TRIM_BYTES = 64 << 20  # freed heap the worker keeps before giving memory back
REQUEST_HEAP_PAD_BYTES = 4 << 20  # grow the heap in steps of this much, not a page at a time


def _mallopt() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn


REPLACEMENTS = tuple(LIBRARIES)  # allocators child_env may preload


def replacement_in(maps: str) -> str | None:
    """The replacement allocator (``tcmalloc``, ``jemalloc``) mapped in a ``/proc/<pid>/maps`` text, or None."""
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1]
        for kind in REPLACEMENTS:
            if name.startswith(f"lib{kind}"):
                return kind
    return None


def active_allocator() -> str:
    """``tcmalloc`` or ``jemalloc`` when one serves this process's malloc (preloaded), else ``glibc``."""
    try:
        with open("/proc/self/maps") as f:
            return replacement_in(f.read()) or "glibc"
    except OSError:
        return "glibc"


def mallopt(param: int, value: int) -> bool:
    """``mallopt(param, value)``; False where there is no glibc, glibc's malloc is not the one in use
    (a preloaded allocator ignores glibc's settings), or glibc refuses the value."""
    allocator = active_allocator()
    if allocator != "glibc":
        log.info("malloc is %s in this process: glibc malloc setting %d not applied", allocator, param)
        return False
    fn = _mallopt()
    if fn is None:
        log.info("no glibc mallopt here: malloc setting %d left as it is", param)
        return False
    ok = bool(fn(param, value))
    if not ok:
        log.warning("mallopt(%d, %d) refused", param, value)
    return ok


def keep_heap_for_requests() -> bool:
    """Keep up to 64 MiB of freed heap instead of returning it to the kernel after every request."""
    return mallopt(M_TRIM_THRESHOLD, REQUEST_HEAP_TRIM_BYTES) and mallopt(M_TOP_PAD, REQUEST_HEAP_PAD_BYTES)
