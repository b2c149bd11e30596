"""What to change when a run is not learning, read off its step records.

Why: a run that learns nothing looks like a run that learns slowly until someone
reads the metrics. The usual causes show in them: every attempt of a group scores
alike (the advantages are 0, there is nothing to learn from; unless those groups scored
the best the run has seen, above zero: solved), the policy's entropy
collapsed (it samples one answer), or the updates are so large that most tokens are
clipped. :func:`stuck_hint` turns the latest records into a :class:`Hint` that says which
and what to try; ``boltstream train``/``demo`` print each kind once, when it first appears.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

NO_SPREAD_SHARE = 0.5  # at least this share of a step's groups scored alike...
NO_SPREAD_STEPS = 3  # ...for this many steps in a row
ENTROPY_FLOOR = 0.05  # mean token entropy (nats) below which sampling has collapsed
CLIP_CEILING = 0.2  # clip fraction above which the steps are too large


class Hint(NamedTuple):
    """``kind`` (``no_spread``, ``entropy`` or ``clip``) names the cause, so a run says each cause once
    even as its numbers move; ``text`` is the line for the user."""

    kind: str
    text: str


def stuck_hint(steps: Sequence[Mapping[str, Any]]) -> Hint | None:
    """A hint when the last ``steps`` (step records, oldest first) show learning stuck, else None."""
    if not steps:
        return None
    last = steps[-1]
    recent = steps[-NO_SPREAD_STEPS:]
    shares = [r.get("groups_without_spread") for r in recent]
    if (len(recent) == NO_SPREAD_STEPS and all(v is not None and v >= NO_SPREAD_SHARE for v in shares)
            and not _solved(steps)):
        share = sum(shares) / len(shares)
        alike = last.get("alike_reward_mean")
        at = f" (at {alike:.3f} on average at step {last['step']})" if alike is not None else ""
        return Hint("no_spread", f"{share:.0%} of the groups in the last {NO_SPREAD_STEPS} steps scored alike{at}, "
                    "so their advantages are 0: raise the training temperature (--train-temperature) or the "
                    "group size (--group-size), or give partial credit (intermediate rewards, a graded final "
                    "reward)")
    entropy = last.get("entropy")
    if entropy is not None and entropy < ENTROPY_FLOOR:
        return Hint("entropy", f"the policy's entropy collapsed to {entropy:.3f} nats a token at step "
                    f"{last['step']}: it samples one answer; lower the learning rate (--lr) or add a KL penalty "
                    "(--kl-coef)")
    clip = last.get("clip_fraction")
    if clip is not None and clip > CLIP_CEILING:
        return Hint("clip", f"{clip:.0%} of the tokens were clipped at step {last['step']}: the updates are too "
                    "large; lower the learning rate (--lr) or train on more groups a step (--groups-per-step)")
    return None


def _solved(steps: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the last step's alike groups sit at the best group reward of a run that has seen lower ones,
    and above zero (they were solved: nothing is wrong). A run whose groups never differed is not solved,
    only silent; nor is one whose best is to earn nothing (every attempt 0, having once drawn a penalty:
    a policy that stopped trying scores exactly that)."""
    best = [r["group_reward_max"] for r in steps if r.get("group_reward_max") is not None]
    worst = [r["group_reward_min"] for r in steps if r.get("group_reward_min") is not None]
    alike = steps[-1].get("alike_reward_mean")
    if not (best and worst and alike is not None):
        return False
    top = max(best)
    return top > 0.0 and top > min(worst) + 1e-9 and alike >= top - 1e-9
