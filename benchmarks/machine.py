"""What the machine can do, measured in the benchmark's own run: the bounds a hot path is compared with.

Every timing on a CPU depends on facts a reader needs next to it (native bf16 or
not, cores, torch's thread count and OpenMP wait policy), and a speed means little
without the bound the hardware sets on the same box, measured in the same run
(these machines are shared and their speed drifts):

* compute: a large float32 matrix product's GFLOP/s;
* memory: a large copy's GB/s (bytes copied per second, the buffer's size over
  the time) and a large reduction's read GB/s. A decode step must read every
  weight once, so ``weight bytes / GB/s`` bounds its time from below; the copy's
  rate is the looser bound (a copy also writes), the read rate the tighter one.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from boltstream.weights.models import cpu_has_native_bf16


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name and the flags that change which kernels run, and torch's thread settings."""
    import torch

    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "native_bf16": cpu_has_native_bf16(),
            "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)")}


def describe(facts: dict[str, Any]) -> str:
    return (f"{facts['cpu']}, {facts['cores']} cores, native bf16 {'yes' if facts['native_bf16'] else 'no'} "
            f"(flags: {' '.join(facts['flags']) or 'none of avx2/avx512'}), torch {facts['torch']} "
            f"{facts['torch_threads']} threads, OMP_WAIT_POLICY={facts['omp_wait_policy']}")


def _best(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bounds(size_mib: int = 512, matmul: int = 2048, repeats: int = 5) -> dict[str, float]:
    """``copy_gb_s`` (a ``size_mib`` buffer copied, its size over the best time), ``read_gb_s`` (a sum over
    it) and ``matmul_gflop_s`` (float32 ``matmul`` x ``matmul``), each the best of ``repeats``."""
    import torch

    n = size_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), repeats)
    read = _best(lambda: src.sum(), repeats)
    a = torch.randn(matmul, matmul)
    b = torch.randn(matmul, matmul)
    mm = _best(lambda: a @ b, repeats)
    nbytes = n * 4
    return {"copy_gb_s": nbytes / copy / 1e9, "read_gb_s": nbytes / read / 1e9,
            "matmul_gflop_s": 2 * matmul**3 / mm / 1e9}
