"""The learner's memory settings: glibc's mmap threshold (the cause of its 4 GB peak), /proc figures, config."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from boltstream.errors import ConfigError
from boltstream.learner.config import load_config
from boltstream.learner.memory import memory_status, parse_status, pin_mmap_threshold, reset_peak_rss

# In a fresh interpreter: free an 8 MiB block (glibc then raises its mmap threshold to 8 MiB), then
# allocate 1 MiB and print whether it got a mapping of its own (mallinfo2's count of mmapped blocks).
PROBE = """
import ctypes, sys
from boltstream.learner.memory import pin_mmap_threshold
if sys.argv[1] == "pinned":
    assert pin_mmap_threshold(128)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(1 << 20)
print(libc.mallinfo2().hblks - before)
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc >= 2.33 only (mallinfo2)")
@pytest.mark.parametrize(("mode", "own_mapping"), [("glibc", 0), ("pinned", 1)])
def test_a_freed_big_block_moves_later_ones_to_the_heap_unless_the_threshold_is_pinned(mode: str,
                                                                                      own_mapping: int) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == own_mapping


@pytest.mark.parametrize("kib", [0, -1, 32 * 1024 + 1])
def test_pin_refuses_thresholds_glibc_does_not_take(kib: int) -> None:
    with pytest.raises(ValueError, match="mmap threshold"):
        pin_mmap_threshold(kib)


def test_parse_status_reads_mib_figures() -> None:
    text = ("Name:\tpython\nVmHWM:\t 4337280 kB\nVmRSS:\t 2097152 kB\nRssAnon:\t 1572864 kB\n"
            "RssFile:\t  524288 kB\nRssShmem:\t       0 kB\n")
    assert parse_status(text) == {"peak_rss_mb": 4235.6, "rss_mb": 2048.0, "anon_mb": 1536.0, "file_mb": 512.0}


def test_reset_peak_rss_starts_the_peak_again_from_the_current_rss() -> None:
    block = b"x" * (128 << 20)  # pages touched: the peak is at least 128 MiB above what remains below
    del block
    high = memory_status()["peak_rss_mb"]
    assert reset_peak_rss()
    now = memory_status()
    assert now["peak_rss_mb"] < high - 100
    assert now["peak_rss_mb"] >= now["rss_mb"] - 1


def test_config_pins_128_kib_by_default_and_takes_none_or_a_valid_value() -> None:
    assert load_config(env={}).malloc_mmap_threshold_kb == 128
    assert load_config(env={"BOLTSTREAM_LEARN_MALLOC_MMAP_THRESHOLD_KB": "none"}).malloc_mmap_threshold_kb is None
    assert load_config({"malloc_mmap_threshold_kb": 1024}, env={}).malloc_mmap_threshold_kb == 1024
    with pytest.raises(ConfigError, match="malloc_mmap_threshold_kb"):
        load_config({"malloc_mmap_threshold_kb": 0}, env={})
