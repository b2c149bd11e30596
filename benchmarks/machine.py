"""What the machine can do, measured in the benchmark's own run: the bounds a hot path is compared with.

Every timing on a CPU depends on facts a reader needs next to it (native bf16 or
not, cores, torch's thread count and OpenMP wait policy: :func:`cpu_facts`), and a
speed means little without the bound the hardware sets on the same box, measured
in the same run (these machines are shared and their speed drifts):

* compute: a large matrix product's GFLOP/s in the dtype measured;
* memory: a large copy's GB/s (bytes copied per second, the buffer's size over
  the time) and a large reduction's read GB/s. A decode step must read every
  weight once, so ``weight bytes / GB/s`` bounds its time from below; the copy's
  rate is the looser bound (a copy also writes), the read rate the tighter one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from boltstream.cli import omp_env
from boltstream.weights.models import cpu_facts, describe_cpu

__all__ = ["as_command", "bounds", "cpu_facts", "describe_cpu", "write_report"]


def as_command(command: str) -> None:
    """Give this process the OpenMP settings of ``boltstream <command>`` (the worker spins, the rest sleep),
    so an engine measured in-process runs as it does when served. Before torch loads: the OpenMP runtime
    reads them once."""
    if "torch" in sys.modules:
        raise RuntimeError("as_command() must run before torch is imported")
    for var, value in omp_env(command).items():
        os.environ.setdefault(var, value)


def _best(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bounds(size_mib: int = 512, matmul: int = 2048, repeats: int = 5, dtype: str = "float32") -> dict[str, float]:
    """``copy_gb_s`` (a ``size_mib`` buffer copied, its size over the best time), ``read_gb_s`` (a sum over
    it) and ``matmul_gflop_s`` (a ``matmul`` x ``matmul`` product in ``dtype``: bf16 runs on other units
    than float32 where the CPU has them), each the best of ``repeats``."""
    import torch

    n = size_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), repeats)
    read = _best(lambda: src.sum(), repeats)
    a = torch.randn(matmul, matmul).to(getattr(torch, dtype))
    b = torch.randn(matmul, matmul).to(getattr(torch, dtype))
    mm = _best(lambda: a @ b, repeats)
    nbytes = n * 4
    return {"copy_gb_s": nbytes / copy / 1e9, "read_gb_s": nbytes / read / 1e9,
            "matmul_gflop_s": 2 * matmul**3 / mm / 1e9}


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """The benchmark's JSON at ``path`` (its folder made), and where it went."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))
    print(f"-> {path}")
