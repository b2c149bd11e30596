"""glibc malloc settings a long-running process fixes at start (``mallopt``), for when glibc serves malloc.

The processes boltstream starts (learner, inference worker, stream app) run on tcmalloc where it
is installed (:mod:`boltstream.allocator` preloads it): these settings are then not applied
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
from typing import Any

log = logging.getLogger(__name__)

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


REPLACEMENTS = ("tcmalloc", "jemalloc")  # allocators boltstream.allocator may preload


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
