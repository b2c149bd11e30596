"""Peak RSS of one child process, measured from outside it (tests and benchmarks share this).

Why a launcher in between: Linux carries a parent's memory high-water mark into a child's
``ru_maxrss`` across fork + exec, so a child started from a test process that holds torch
(500 MiB) reports at least 500 MiB whatever it does itself (measured: a 1,000-span export
"peaked" at 523 MiB). A small Python launcher starts the child and reads its rusage with
``wait4``: the child inherits only the launcher's few MiB.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCHER = """
import json, os, subprocess, sys, threading
result, limit, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
child = subprocess.Popen(argv)
timer = threading.Timer(limit, child.kill)
timer.start()
_, status, usage = os.wait4(child.pid, 0)
timer.cancel()
with open(result, "w") as f:
    json.dump({"code": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss}, f)
"""


@dataclasses.dataclass(frozen=True)
class Measured:
    code: int
    peak_mib: float
    seconds: float
    output: str


def run_measured(argv: list[str], env: dict[str, str], timeout: float) -> Measured:
    """Run ``argv`` (its stdout and stderr together in ``output``); its own peak RSS in MiB."""
    with tempfile.TemporaryDirectory(prefix="peak-rss-") as tmp:
        result = Path(tmp) / "result.json"
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(result), str(timeout), *argv], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout + 30)
        seconds = time.perf_counter() - started
        if not result.is_file():
            raise AssertionError(f"the launcher failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
        measured = json.loads(result.read_text())
    return Measured(measured["code"], measured["maxrss_kib"] / 1024, seconds, proc.stdout)
