"""Progress lines of ``boltstream train`` / ``demo`` when stdout is not a terminal."""

from __future__ import annotations

import io
import re
import threading

from boltstream.processes import Processes
from boltstream.runs.progress import LiveDisplay, ProgressLines, choose_display

LINE = re.compile(r"^boltstream demo \[\d+:\d\d\] (.*?)(?: \| budget left (\d+):(\d\d))?$")


def said(stream: io.StringIO) -> list[str]:
    out = []
    for line in stream.getvalue().splitlines():
        m = LINE.match(line)
        assert m, line
        out.append(m.group(1))
    return out


def test_a_pipe_gets_lines_and_a_terminal_the_live_table() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(choose_display("boltstream demo", False, io.StringIO()), ProgressLines)
    assert isinstance(choose_display("boltstream demo", False, Tty()), LiveDisplay)
    assert isinstance(choose_display("boltstream demo", True, Tty()), ProgressLines)


def test_one_line_per_event(tmp_path) -> None:
    out = io.StringIO()
    lines = ProgressLines("boltstream demo", out)
    lines.plan(steps=2, budget_s=600.0, started=lines.started)
    lines.phase("evaluation before: 2 held-out tasks x 2")
    for k in range(1, 5):
        lines.evaluation("before", k, 4)
    procs = Processes(tmp_path, {})
    lines.update([], 0, procs, 0, 4)
    lines.update([{"step": 1, "reward_mean": 0.25, "samples": 16}], 0, procs, 0, 4)
    lines.update([{"step": 1, "reward_mean": 0.25, "samples": 16}], 1, procs, 0, 4)
    lines.update([{"step": 1, "reward_mean": 0.25, "samples": 16}, {"step": 2, "reward_mean": None, "samples": 8}],
                 2, procs, 0, 4)
    text = said(out)
    assert text[:3] == ["evaluation before: 2 held-out tasks x 2", "evaluation before: 1 of 4 attempts",
                        "evaluation before: 4 of 4 attempts"], "attempts 2 and 3 came within 10 s: not said"
    assert re.fullmatch(r"step 1 of 2: reward 0\.250, 16 samples, ETA \d+:\d\d", text[3]), text[3]
    assert text[4:] == ["checkpoint v1 served", "step 2 of 2: reward nan, 8 samples", "checkpoint v2 served"]
    budget = LINE.match(out.getvalue().splitlines()[0])
    assert budget is not None and int(budget.group(2)) * 60 + int(budget.group(3)) in (599, 600)


def test_the_heartbeat_repeats_the_state_when_nothing_was_said() -> None:
    wrote = threading.Event()

    class Stream(io.StringIO):
        def flush(self) -> None:
            super().flush()
            if "..." in self.getvalue():
                wrote.set()

    out = Stream()
    with ProgressLines("boltstream demo", out, heartbeat_s=0.5) as lines:
        lines.phase("starting the inference worker (tiny)")
        assert wrote.wait(10.0), out.getvalue()
    assert said(out)[:2] == ["starting the inference worker (tiny)", "starting the inference worker (tiny) ..."]
