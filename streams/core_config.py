"""Knobs of the pure stream core: how rollouts are assembled and how credit is assigned.

Why frozen dataclasses: the stream app builds them once from its own config (env
vars / CLI) and hands them to pure functions; being immutable and validated up
front, a bad value fails at start-up with the field's name, not mid-stream.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Literal

from boltstream.config import opt
from boltstream.errors import ConfigError

from .air import DEFAULT_AIR_RULES, AirRule

logger = logging.getLogger(__name__)

LossWeightMode = Literal["none", "inverse_calls"]
LOSS_WEIGHT_MODES: tuple[str, ...] = ("none", "inverse_calls")
CallCreditMode = Literal["return", "episode"]
CALL_CREDIT_MODES: tuple[str, ...] = ("return", "episode")


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(name, value, "must be a finite number")
    return float(value)


@dataclass(frozen=True)
class AssemblyConfig:
    """How the spans of one rollout attempt become a Trajectory.

    - ``agent_match``: regex (``re.search``) over agent names; only matching calls
      are trained. None trains every call (a call with no agent name only
      matches when ``agent_match`` is None).
    - ``air_rules``: Automatic Intermediate Reward rules (see ``boltstream.streams.air``).
    - ``require_logprobs``: a call without behaviour logprobs is dropped (reported in
      ``dropped_calls``). With False it is kept and its logprobs are left empty in
      the Turn (the sample then carries 0.0; the learner must recompute them).
    - ``reparent_floating_llm``: move LLM spans whose parent is missing under the
      tightest span that contains them in time.
    """

    agent_match: str | None = None
    air_rules: tuple[AirRule, ...] = DEFAULT_AIR_RULES
    require_logprobs: bool = True
    reparent_floating_llm: bool = True

    def __post_init__(self) -> None:
        if self.agent_match is not None:
            if not isinstance(self.agent_match, str):
                raise ValueError(f"agent_match: must be a regex string or None, got {self.agent_match!r}")
            try:
                re.compile(self.agent_match)
            except re.error as exc:
                raise ValueError(f"agent_match: invalid regex {self.agent_match!r}: {exc}") from None
        rules = tuple(self.air_rules)
        for rule in rules:
            if not isinstance(rule, AirRule):
                raise ValueError(f"air_rules: every rule must be an AirRule, got {type(rule).__name__}")
        names = [rule.name for rule in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"air_rules: rule names must be unique, got {names}")
        object.__setattr__(self, "air_rules", rules)


@dataclass(frozen=True)
class CreditConfig:
    """LightningRL credit assignment and GRPO advantage settings (``boltstream stream worker --help``).

    - ``call_credit``: "episode" (the default) gives every call its rollout's episode return, as
      Agent Lightning does. "return" compares a later call's G_t (which excludes rewards earned
      before it) with a baseline of episode returns, so with intermediate rewards later calls read
      as worse than they are: the calculator's answer call, after a +0.1 for using the tool, was
      pushed down on every rollout (docs/learner.md).
    - ``eps``: a group whose episode returns spread by no more than ``eps`` teaches nothing: every
      advantage is 0 (dividing its calls' within-rollout differences by eps would give |A| ~ 1e5).
    - ``std_normalize`` is off by default (Dr. GRPO): dividing by the group's std blew a group whose
      returns differ only by an intermediate reward up to the size of a right/wrong split, and paired
      bare loops went 0.20 -> 0.17 held-out with it, 0.20 -> 0.44 without (docs/learner.md).
    """

    gamma: float = opt(1.0, "discount over a rollout's calls, G_t = r_t + gamma * G_t+1 (1: every call "
                            "gets the episode return)")
    eps: float = opt(1e-6, "added to the group std; groups whose returns spread less teach nothing")
    std_normalize: bool = opt(False, "divide advantages by the group's return std (GRPO) instead of "
                                     "return - group mean (Dr. GRPO)")
    std_unbiased: bool = opt(True, "sample std (n - 1, as torch/verl/TRL) rather than population std")
    loss_weight: LossWeightMode = opt("none", "per-sample loss weight: none, or 1/T_i for a rollout of "
                                              "T_i samples (long rollouts do not dominate)")
    trajectory_mode: bool = opt(False, "merge calls whose prompt extends the previous prompt + response "
                                       "into one sample, masking the inserted tokens")
    failure_reward: float = opt(0.0, "final reward of a rollout that has none (failed / abandoned)")
    call_credit: CallCreditMode = opt("episode", "episode: every call gets its rollout's advantage (Agent "
                                                 "Lightning); return: each call's from its own return G_t")

    def __post_init__(self) -> None:
        if self.call_credit not in CALL_CREDIT_MODES:
            raise ConfigError("call_credit", self.call_credit, f"one of {', '.join(CALL_CREDIT_MODES)}")
        gamma = _finite("gamma", self.gamma)
        if not 0.0 <= gamma <= 1.0:
            raise ConfigError("gamma", gamma, "must be in [0, 1]")
        eps = _finite("eps", self.eps)
        if eps < 0.0:
            raise ConfigError("eps", eps, "must be >= 0")
        if self.loss_weight not in LOSS_WEIGHT_MODES:
            raise ConfigError("loss_weight", self.loss_weight, f"one of {', '.join(LOSS_WEIGHT_MODES)}")
        for name in ("std_normalize", "std_unbiased", "trajectory_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "must be a bool")
        object.__setattr__(self, "gamma", gamma)
        object.__setattr__(self, "eps", eps)
        object.__setattr__(self, "failure_reward", _finite("failure_reward", self.failure_reward))
