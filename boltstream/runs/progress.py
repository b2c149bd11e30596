"""What ``boltstream train`` / ``demo`` show while they run: a live table on a terminal, lines elsewhere.

A run lasts many minutes; most of them are spent in evaluations and learner steps. On a
terminal :class:`LiveDisplay` redraws a table of the components every second. Anywhere else (a
log file, CI, ``nohup``, a pipe) a redrawn table prints nothing useful, so
:class:`ProgressLines` writes one flushed line per event instead: the phase the run enters,
evaluation k of n attempts, learner step k of n with its reward and an ETA, each policy version
the worker serves, and the time budget left. A heartbeat repeats the current state when nothing
else was said for ``heartbeat_s`` (30 s), so a reader never waits a minute for a sign of life.

Both share one interface, called by :func:`boltstream.runs.train.run`: ``plan`` (steps and time
budget), ``phase``, ``evaluation`` and ``update`` (each time the run polls the learner).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from boltstream.learner.timeline import format_timeline
from boltstream.processes import Processes


def choose_display(prog: str, no_live: bool, stream: TextIO | None = None) -> Any:
    """The live table on a terminal unless ``no_live``; progress lines otherwise."""
    stream = stream or sys.stdout
    if not no_live and stream.isatty():
        return LiveDisplay(prog)
    return ProgressLines(prog, stream)


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class ProgressLines:
    """One line per event, flushed; a heartbeat line when nothing was said for ``heartbeat_s``."""

    def __init__(self, prog: str, stream: TextIO, heartbeat_s: float = 30.0) -> None:
        self.prog, self.stream, self.heartbeat_s = prog, stream, heartbeat_s
        self.started = time.monotonic()
        self.deadline: float | None = None
        self.steps: int | None = None
        self.state = "starting"
        self.last_line = self.started
        self.train_started: float | None = None
        self.step_seen = 0
        self.version_seen: int | None = None
        self.eval_said = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="progress-heartbeat", daemon=True)

    def __enter__(self) -> ProgressLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def say(self, text: str) -> None:
        now = time.monotonic()
        budget = f" | budget left {_clock(self.deadline - now)}" if self.deadline is not None else ""
        with self._lock:
            self.stream.write(f"{self.prog} [{_clock(now - self.started)}] {text}{budget}\n")
            self.stream.flush()
            self.last_line = now

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self.last_line >= self.heartbeat_s:
                self.say(f"{self.state} ...")

    def plan(self, steps: int, budget_s: float, started: float) -> None:
        self.steps, self.deadline = steps, started + budget_s

    def hint(self, text: str) -> None:
        """A run that may not be learning: what to change (boltstream.learner.hints)."""
        self.say(f"not learning? {text}")

    def phase(self, text: str) -> None:
        self.state = text
        self.say(text)

    def evaluation(self, label: str, done: int, total: int) -> None:
        """Attempt ``done`` of ``total``: said at the first, the last, and at most every 10 s between."""
        self.state = f"evaluation {label}: {done} of {total} attempts"
        now = time.monotonic()
        if done in (1, total) or now - self.eval_said >= 10.0:
            self.eval_said = now
            self.say(self.state)

    def update(self, rows: list[dict[str, Any]], version: int | None, procs: Processes, worker_port: int,
               group_size: int) -> None:
        now = time.monotonic()
        if self.train_started is None:
            self.train_started = now
        for row in rows[self.step_seen:]:
            step = int(row["step"])
            of = f" of {self.steps}" if self.steps else ""
            eta = ""
            if self.steps and step < self.steps:
                eta = f", ETA {_clock((now - self.train_started) / step * (self.steps - step))}"
            reward = row.get("reward_mean")
            shown = "nan" if reward is None else f"{reward:.3f}"
            self.say(f"step {step}{of}: reward {shown}, {row.get('samples', 0)} samples{eta}")
            if "timeline" in row:
                self.say(f"step {step} time: {format_timeline(row['timeline'])}")
        self.step_seen = max(self.step_seen, len(rows))
        if version is not None and version != self.version_seen:
            if self.version_seen is not None:
                self.say(f"checkpoint v{version} served")
            self.version_seen = version
        self.state = f"training: {self.step_seen}{f' of {self.steps}' if self.steps else ''} steps, " \
                     f"policy v{version} served"


class LiveDisplay:
    """A rich table of what each component is doing, refreshed while the run goes on."""

    def __init__(self, prog: str = "boltstream") -> None:
        from rich.live import Live

        self.prog = prog
        self.live = Live(refresh_per_second=1, transient=False)
        self.started = time.monotonic()
        self.last = 0.0
        self.spans = 0.0
        self.state = "starting"
        self.steps: int | None = None

    def __enter__(self) -> LiveDisplay:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def plan(self, steps: int, budget_s: float, started: float) -> None:
        self.steps = steps

    def hint(self, text: str) -> None:
        """Printed above the live table, where it stays."""
        self.live.console.print(f"[bold]not learning?[/bold] {text}")

    def phase(self, text: str) -> None:
        self.state = text
        self.live.update(f"{self.prog}: {text}")

    def evaluation(self, label: str, done: int, total: int) -> None:
        self.phase(f"evaluation {label}: {done} of {total} attempts")

    def update(self, rows: list[dict[str, Any]], version: int | None, procs: Processes, worker_port: int,
               group_size: int) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:
            return
        from rich.table import Table

        spans = worker_counter(worker_port, "boltstream_inference_spans_total")
        rate = (spans - self.spans) / (now - self.last) if self.last and spans >= self.spans else 0.0
        self.last, self.spans = now, spans
        t = Table(title=f"{self.prog} — {now - self.started:.0f}s")
        t.add_column("component")
        t.add_column("state")
        for name, proc in procs.procs.items():
            t.add_row(name, "running" if proc.poll() is None else f"exited {proc.returncode}")
        last = rows[-1] if rows else {}
        t.add_row("LLM calls captured (spans)", f"{spans:.0f} ({rate:.1f}/s)")
        t.add_row("rollouts trained", str(sum(int(r.get("groups", 0)) for r in rows) * group_size))
        t.add_row("samples trained", str(sum(int(r.get("samples", 0)) for r in rows)))
        t.add_row("learner step", f"{last.get('step', 0)}{f' of {self.steps}' if self.steps else ''}")
        t.add_row("training reward", f"{last.get('reward_mean', float('nan')):.3f}" if rows else "-")
        t.add_row("policy version served", str(version))
        if "timeline" in last:
            t.add_row("last step's time", format_timeline(last["timeline"]))
        self.live.update(t)


def worker_counter(port: int, name: str) -> float:
    """One counter from the inference worker's Prometheus ``/metrics`` (0 when unreachable)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
