"""What to change when a run is not learning, read off its step records.

Why: a run that learns nothing looks like a run that learns slowly until someone
reads the metrics. The usual causes show in them: every attempt of a group scores
alike (the advantages are 0, there is nothing to learn from; unless those groups scored
the best the run has seen: solved), the policy's entropy
collapsed (it samples one answer), or the updates are so large that most tokens are
clipped. :func:`stuck_hint` turns the latest records into one line that says which
and what to try; ``boltstream train``/``demo`` print it when it first appears.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

NO_SPREAD_SHARE = 0.5  # at least this share of a step's groups scored alike...
NO_SPREAD_STEPS = 3  # ...for this many steps in a row
ENTROPY_FLOOR = 0.05  # mean token entropy (nats) below which sampling has collapsed
CLIP_CEILING = 0.2  # clip fraction above which the steps are too large


def stuck_hint(steps: Sequence[Mapping[str, Any]]) -> str | None:
    """A one-line hint when the last ``steps`` (step records, oldest first) show learning stuck, else None."""
    if not steps:
        return None
    last = steps[-1]
    recent = steps[-NO_SPREAD_STEPS:]
    shares = [r.get("groups_without_spread") for r in recent]
    if (len(recent) == NO_SPREAD_STEPS and all(v is not None and v >= NO_SPREAD_SHARE for v in shares)
            and not _solved(steps)):
        share = sum(shares) / len(shares)
        return (f"{share:.0%} of the groups in the last {NO_SPREAD_STEPS} steps scored alike, so their advantages "
                "are 0: raise the agent's sampling temperature (the demo's --temperature) or the group size "
                "(--group-size), or give partial credit (intermediate rewards, a graded final reward)")
    entropy = last.get("entropy")
    if entropy is not None and entropy < ENTROPY_FLOOR:
        return (f"the policy's entropy collapsed to {entropy:.3f} nats a token at step {last['step']}: it samples "
                "one answer; lower the learning rate (--lr) or add a KL penalty (--kl-coef)")
    clip = last.get("clip_fraction")
    if clip is not None and clip > CLIP_CEILING:
        return (f"{clip:.0%} of the tokens were clipped at step {last['step']}: the updates are too large; lower "
                "the learning rate (--lr) or train on more groups a step (--groups-per-step)")
    return None


def _solved(steps: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the last step's alike groups sit at the best group reward of a run that has seen others
    (they were solved: nothing is wrong). A run whose groups never differed is not solved, only silent."""
    best = [r["group_reward_max"] for r in steps if r.get("group_reward_max") is not None]
    worst = [r["group_reward_min"] for r in steps if r.get("group_reward_min") is not None]
    alike = steps[-1].get("alike_reward_mean")
    return bool(best and worst and alike is not None and max(best) > min(worst) + 1e-9 and alike >= max(best) - 1e-9)
