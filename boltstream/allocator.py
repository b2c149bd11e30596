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
keep glibc with the mallopt settings of :mod:`boltstream.malloc`, and a log line says so.
``BOLTSTREAM_ALLOCATOR`` chooses: ``tcmalloc`` (default), ``jemalloc``, ``glibc`` (preload
nothing), or the path of a shared object.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

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
            log.info("%s not found in %s: child processes use glibc malloc with boltstream.malloc's settings "
                     "(install libtcmalloc-minimal4 for the faster learner)", choice, ", ".join(library_dirs()))
    return with_preload(env, path) if path else dict(env)
