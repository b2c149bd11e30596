"""The learner process's memory: glibc's mmap threshold pinned, and where resident memory sits.

Why the threshold: glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes
(128 KiB at start) with its own ``mmap``, which ``free`` returns to the kernel at once.
But each time such a block is freed, glibc *raises* the threshold to that block's size
(up to 32 MiB on 64-bit), so after the first backward pass every activation tensor of a
training step (0.1-8 MiB each for SmolLM2) comes from the malloc heap instead, and a
freed heap is kept by the process, fragmented, and grows step after step. Measured on
SmolLM2-135M + LoRA, 16 samples of ~190 tokens, 1,024 tokens per micro-batch
(``benchmarks/bench_learner_memory.py``): 4.2 GB peak RSS with the rising threshold, 2.3 GB
with it pinned, where the step's own saved activations are ~1.15 GB per micro-batch.
Setting the threshold explicitly (``mallopt``) turns the rising off; the same as starting
the process with ``MALLOC_MMAP_THRESHOLD_=131072``, but it holds however the learner is
started (CLI, docker compose, a test harness).

Its price: every allocation of 128 KiB or more is then a fresh ``mmap`` the kernel
zero-fills, and a step's activations are nearly all that big, so a forward+backward took
~1.4x as long as with glibc's defaults (``benchmarks/bench_allocators.py``). A learner that
``boltstream train`` / ``demo`` starts therefore runs on tcmalloc where it is installed
(:mod:`boltstream.allocator` preloads it), which reuses freed blocks from size-classed caches:
glibc's speed, a peak below the pinned threshold's (docs/learner.md, Memory). Under tcmalloc
:func:`pin_mmap_threshold` applies nothing (glibc's malloc is not the one in use) and returns
False; the pin is what keeps a learner on glibc within its memory.
"""

from __future__ import annotations

import logging
import resource

from boltstream.allocator import M_MMAP_THRESHOLD, mallopt

logger = logging.getLogger(__name__)

GLIBC_MAX_MMAP_THRESHOLD_KB = 32 * 1024  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
STATUS_FIELDS = {"VmRSS": "rss_mb", "VmHWM": "peak_rss_mb", "RssAnon": "anon_mb", "RssFile": "file_mb"}


def pin_mmap_threshold(kib: int) -> bool:
    """Serve every allocation of at least ``kib`` KiB with its own mmap, for the rest of the process.

    Returns False (and changes nothing) where glibc's malloc is not the one in use (no glibc, or
    tcmalloc / jemalloc preloaded) or glibc refuses the value.
    """
    if not 0 < kib <= GLIBC_MAX_MMAP_THRESHOLD_KB:
        raise ValueError(f"mmap threshold must be 1..{GLIBC_MAX_MMAP_THRESHOLD_KB} KiB, got {kib}")
    ok = mallopt(M_MMAP_THRESHOLD, kib * 1024)
    if ok:
        logger.debug("malloc mmap threshold pinned at %d KiB", kib)
    return ok


def parse_status(text: str) -> dict[str, float]:
    """MiB figures of a ``/proc/<pid>/status`` text: rss, peak (high-water mark), anonymous and file-backed.

    File-backed pages are mostly the model weights (safetensors are memory-mapped) and torch's
    shared libraries; anonymous ones are activations, gradients, optimizer state and the heap.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            out[STATUS_FIELDS[key]] = round(int(value.split()[0]) / 1024, 1)  # kB
    return out


def memory_status() -> dict[str, float]:
    """This process's :func:`parse_status` figures (empty where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            return parse_status(f.read())
    except OSError:
        return {}


def reset_peak_rss() -> bool:
    """Restart the peak RSS count (``VmHWM``, ``ru_maxrss``) from the current RSS (Linux >= 4.0), so a
    benchmark can tell each phase's own peak; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (the demo reports the learner's; issue: 4 GB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux
