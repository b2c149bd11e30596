"""The generation thread's thread count: the arithmetic by hand, the decisions over a scripted /proc/stat."""

from __future__ import annotations

import pytest

from boltstream.inference import cpu_share
from boltstream.inference.cpu_share import CpuShare, busy_seconds, others_cores, threads_for

TICK = cpu_share._TICK

STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 100 5 50 2000 7 3 2 10 0 0
cpu1 200 0 25 3000 3 0 0 0 0 0
cpu2 400 0 0 0 0 0 0 0 0 0
intr 12345
"""


def test_busy_seconds_sums_the_busy_columns_of_the_given_cpus_only() -> None:
    # cpu0: user 100 + nice 5 + system 50 + irq 3 + softirq 2 + steal 10 = 170 (idle and iowait left out)
    assert busy_seconds({0}, STAT) == pytest.approx(170 / TICK)
    assert busy_seconds({0, 1}, STAT) == pytest.approx((170 + 225) / TICK)  # the "cpu" total line is not a CPU


def test_others_cores_is_the_busy_time_that_was_not_ours_per_second() -> None:
    assert others_cores(busy_s=3.0, own_s=2.0, wall_s=1.0) == 1.0
    assert others_cores(busy_s=1.0, own_s=1.2, wall_s=0.5) == 0.0  # ticks and process time disagree a little
    assert others_cores(busy_s=1.0, own_s=0.0, wall_s=0.0) == 0.0


@pytest.mark.parametrize(("cpus", "others", "max_threads", "want"), [
    (2, 0.0, 2, 2), (2, 0.3, 2, 2), (2, 0.7, 2, 1), (2, 2.0, 2, 1), (16, 3.2, 16, 13), (16, 0.0, 8, 8)])
def test_threads_for_leaves_the_cores_others_use(cpus: int, others: float, max_threads: int, want: int) -> None:
    assert threads_for(cpus, others, max_threads) == want


class Box:
    """A two-CPU /proc/stat, a clock and this process's CPU time, advanced by hand."""

    def __init__(self) -> None:
        self.now, self.busy_ticks, self.own = 100.0, 0, 0.0

    def stat(self) -> str:
        return f"cpu0 {self.busy_ticks} 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0\n"

    def run(self, seconds: float, ours: float, others: float) -> None:
        """``seconds`` pass with ``ours`` and ``others`` cores busy."""
        self.now += seconds
        self.own += ours * seconds
        self.busy_ticks += round((ours + others) * seconds * TICK)

    def share(self, fixed: int = 0) -> CpuShare:
        return CpuShare(2, fixed, read_stat=self.stat, clock=lambda: self.now, own=lambda: self.own, cpus={0, 1})


def test_one_thread_while_another_process_keeps_a_core_busy_and_two_once_it_stops() -> None:
    box = Box()
    share = box.share()
    share.begin()
    assert share.threads() == 2
    box.run(0.2, ours=1.4, others=0.6)
    assert share.threads() == 2  # the window is shorter than INTERVAL_S: no decision yet
    box.run(0.4, ours=1.4, others=0.6)
    assert share.threads() == 1
    box.run(0.6, ours=1.0, others=1.0)
    assert share.threads() == 1
    box.run(0.6, ours=1.0, others=0.1)
    assert share.threads() == 2


def test_idle_time_between_batches_is_not_measured() -> None:
    box = Box()
    share = box.share()
    share.begin()
    box.run(30.0, ours=0.0, others=2.0)  # the learner trains while the worker waits for its checkpoint
    share.begin()  # the next batch
    box.run(0.6, ours=2.0, others=0.0)
    assert share.threads() == 2


def test_a_fixed_count_never_changes_and_an_unreadable_stat_keeps_the_maximum() -> None:
    box = Box()
    fixed = box.share(fixed=1)
    fixed.begin()
    box.run(1.0, ours=1.0, others=0.0)
    assert fixed.threads() == 1

    def missing() -> str:
        raise FileNotFoundError("/proc/stat")

    blind = CpuShare(2, read_stat=missing, cpus={0, 1})
    blind.begin()
    assert blind.threads() == 2
