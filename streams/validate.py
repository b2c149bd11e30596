"""Values a rollout must not carry into training: non-finite rewards, impossible logprobs, impossible times.

Why reject the whole rollout instead of repairing a value: a NaN reward turns
every advantage of its GRPO group into NaN (the group mean is NaN), and a
NaN/inf or positive behaviour logprob makes the importance ratio of every token
of the call meaningless; there is no neutral value to put in their place that
would not silently bias the update. A rejected rollout goes to the DLQ whole
with the reason (the stream app does that); its group closes without it, as
any group with a missing attempt does (``group_timeout_s``, ``complete=False``),
so the other attempts still train.

Rules (each a reason string naming the span or turn and the value):

* every reward is finite: final rewards, intermediate reward spans, AIR output;
* every behaviour logprob is finite and ``<= 0``. No tolerance above 0: our
  engine computes them with ``torch.log_softmax``, which is ``(x - max) -
  log(sum(exp(x - max)))`` and therefore never positive (the sum is >= 1 in
  floating point too), and the OpenAI API returns them the same way; a positive
  value means the engine reported something other than a log-probability;
* span times are non-negative and no span ends before it starts (clock or
  instrumentation bugs: the trajectory's timings and the floating-LLM repair,
  which places calls by time, would be wrong).

Pure functions, no I/O: :func:`span_problems` for the spans of a rollout,
:func:`trajectory_problems` for an assembled Trajectory (also what the group
stage checks on trajectories it consumes).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from .spans import reward_of

MAX_PROBLEMS = 5  # reasons quoted per rollout; the rest are counted


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def span_problems(spans: Iterable[Mapping[str, Any]]) -> list[str]:
    """Reasons the spans of one rollout cannot be trained on (times, reward values); empty when fine."""
    problems = []
    for span in spans:
        sid = span.get("span_id")
        start, end = span.get("start_time_ns") or 0, span.get("end_time_ns") or 0
        if start < 0 or end < 0:
            problems.append(f"span {sid}: negative time (start {start}, end {end})")
        elif end < start:
            problems.append(f"span {sid}: ends before it starts (start {start}, end {end})")
        info = reward_of(span)  # type: ignore[arg-type]
        if info is not None and not math.isfinite(info.value):
            problems.append(f"span {sid}: reward {info.name!r} is {info.value}")
    return problems


def logprob_problem(logprobs: Iterable[float]) -> str | None:
    """Why behaviour logprobs are unusable (the first bad one and its index), or None."""
    if isinstance(logprobs, array) and logprobs:
        # Fast path, in C, for decoded (float32) logprobs: their sum is finite only when none is NaN or
        # infinite (float32 values cannot overflow a double sum), and a maximum <= 0 means none is > 0.
        if math.isfinite(sum(logprobs)) and max(logprobs) <= 0:
            return None
    for index, value in enumerate(logprobs):
        if not _finite(value) or value > 0:
            return f"response_logprobs[{index}] = {value} (must be finite and <= 0)"
    return None


def trajectory_problems(trajectory: Mapping[str, Any]) -> list[str]:
    """Reasons an assembled Trajectory cannot be trained on (rewards, logprobs, times); empty when fine."""
    problems = []
    final = trajectory.get("final_reward")
    if final is not None and not _finite(final):
        problems.append(f"final_reward is {final}")
    for reward in trajectory.get("rewards") or ():
        if not _finite(reward.get("value")):
            problems.append(f"final reward {reward.get('name')!r} from {reward.get('source')} is {reward.get('value')}")
    for turn in trajectory.get("turns") or ():
        where = f"turn {turn.get('call_index')} (span {turn.get('span_id')})"
        for reward in turn.get("rewards") or ():
            if not _finite(reward.get("value")):
                problems.append(f"{where}: reward {reward.get('name')!r} is {reward.get('value')}")
        bad = logprob_problem(turn.get("response_logprobs") or ())
        if bad is not None:
            problems.append(f"{where}: {bad}")
    start, end = trajectory.get("start_time_ns") or 0, trajectory.get("end_time_ns") or 0
    if start < 0 or end < start:
        problems.append(f"rollout times start {start}, end {end} (must be >= 0, end >= start)")
    return problems


def summarise(problems: list[str]) -> str:
    """One reason line: the first :data:`MAX_PROBLEMS` problems, then how many more."""
    text = "; ".join(problems[:MAX_PROBLEMS])
    if len(problems) > MAX_PROBLEMS:
        text += f"; and {len(problems) - MAX_PROBLEMS} more"
    return text
