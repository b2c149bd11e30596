"""How many CPU threads the generation thread uses: all its CPUs while it has them, one while others compete.

Why: torch runs a decode step as ~150 parallel regions (a matrix product, an
attention call, ...) on an OpenMP team. Between regions the team's helper
thread either sleeps, and the next region pays to wake it (tens of
microseconds each, a third of a small model's decode step), or spins, and then
holds a core that another process may need. The worker spins (``boltstream
serve`` sets ``GOMP_SPINCOUNT``, boltstream/cli.py), which on two quiet cores
makes one demo step's generation 1.57x faster (benchmarks/bench_agent_step.py,
float32: 10.65 s -> 6.78 s). But with one busy process beside it, two spinning
threads made the same generation 1.6x slower than sleeping ones (12.6 s ->
20.4 s), while one thread took 11.8 s. So the worker measures, while it
generates, how much CPU the *other* processes used on the CPUs it may run on
(``/proc/stat`` minus its own CPU time) and runs with the cores they leave it:
two on a quiet two-core box, one beside a busy learner.

Linux only (``/proc/stat``); elsewhere, or with a fixed ``--threads``, the
thread count never changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection

log = logging.getLogger(__name__)

# Seconds of generation between two decisions: long enough that /proc/stat's 10 ms ticks average out.
INTERVAL_S = 0.5
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat cpuN columns: user nice system idle iowait irq softirq steal (guest time is inside user)
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def threads_for(cpus: int, others: float, max_threads: int) -> int:
    """Threads to run with: the cores the other processes leave (``cpus`` minus the cores they kept busy,
    rounded), at least one, at most ``max_threads``."""
    return max(1, min(max_threads, round(cpus - others)))


def others_cores(busy_s: float, own_s: float, wall_s: float) -> float:
    """Cores the other processes kept busy over ``wall_s`` seconds, given the busy CPU seconds of the CPUs
    (``busy_s``) and this process's own CPU seconds (``own_s``) in that time."""
    if wall_s <= 0:
        return 0.0
    return max(0.0, (busy_s - own_s) / wall_s)


def busy_seconds(cpus: Collection[int], stat: str) -> float:
    """Busy CPU seconds of ``cpus`` (numbers) since boot, from the text of ``/proc/stat``."""
    total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            cols = rest.split()
            total += sum(int(cols[i]) for i in _BUSY_COLUMNS if i < len(cols))
    return total / _TICK


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


class CpuShare:
    """The generation thread's thread count, re-decided every :data:`INTERVAL_S` seconds of generation.

    ``fixed`` > 0 pins the count. :meth:`begin` at the start of a batch starts a fresh window (time the
    worker sat idle says nothing about generating), keeping the last decision; :meth:`threads` at each
    step returns the count to use now."""

    def __init__(self, max_threads: int, fixed: int = 0, *, read_stat: Callable[[], str] = _read_stat,
                 clock: Callable[[], float] = time.monotonic, own: Callable[[], float] = time.process_time,
                 cpus: Collection[int] | None = None) -> None:
        self.max_threads = max(1, max_threads)
        self.current = fixed if fixed > 0 else self.max_threads
        self._read_stat, self._clock, self._own = read_stat, clock, own
        self._cpus = set(cpus if cpus is not None else _allowed_cpus())
        self._adaptive = fixed <= 0 and self.max_threads > 1 and self._readable()
        self._start: tuple[float, float, float] | None = None

    def _readable(self) -> bool:
        try:
            busy_seconds(self._cpus, self._read_stat())
        except (OSError, ValueError):
            return False
        return True

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), busy_seconds(self._cpus, self._read_stat()), self._own()

    def begin(self) -> None:
        """A batch starts: measure from now."""
        if self._adaptive:
            self._start = self._sample()

    def threads(self) -> int:
        """The thread count for the next step (a new decision once a window is long enough)."""
        if not self._adaptive or self._start is None:
            return self.current
        now = self._clock()
        if now - self._start[0] < INTERVAL_S:
            return self.current
        end = self._sample()
        others = others_cores(end[1] - self._start[1], end[2] - self._start[2], end[0] - self._start[0])
        self._start = end
        decided = threads_for(len(self._cpus), others, self.max_threads)
        if decided != self.current:
            log.info("generation threads %d -> %d (other processes kept %.1f of %d cores busy)",
                     self.current, decided, others, len(self._cpus))
            self.current = decided
        return self.current


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))
