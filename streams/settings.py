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

from .air import DEFAULT_AIR_RULES, AirRule

logger = logging.getLogger(__name__)

LossWeightMode = Literal["none", "inverse_calls"]
LOSS_WEIGHT_MODES: tuple[str, ...] = ("none", "inverse_calls")
CallCreditMode = Literal["return", "episode"]
CALL_CREDIT_MODES: tuple[str, ...] = ("return", "episode")


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
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
    """LightningRL credit assignment and GRPO advantage settings.

    - ``gamma``: discount over a rollout's LLM calls, G_t = r_t + gamma * G_{t+1}
      (final reward at the last call); 1.0 gives every call the episode reward.
    - ``eps``: added to the group std, A = (G - mean) / (std + eps). A group whose
      episode returns spread by no more than ``eps`` teaches nothing: every advantage is 0
      (dividing its calls' within-rollout differences by eps would give |A| ~ 1e5).
    - ``call_credit``: what a call's advantage is computed from. "return": its own
      return G_t (LightningRL per-call credit); "episode": the rollout's episode return
      G_0, so every call of a rollout shares one advantage. With intermediate rewards
      "return" compares a later call's G_t (which excludes rewards earned before it)
      with a baseline of episode returns, so later calls read as worse than they are;
      "episode" avoids that at the cost of per-call resolution.
    - ``std_normalize``: False gives A = G - mean (Dr. GRPO style).
    - ``std_unbiased``: sample std (n - 1, as torch.std / verl / TRL) or population std (n).
    - ``loss_weight``: "none" (1.0) or "inverse_calls" (1 / T_i, T_i = samples of rollout i).
    - ``trajectory_mode``: merge consecutive calls whose prompt extends the previous
      prompt + response into one sample, masking the inserted tokens.
    - ``failure_reward``: final reward used when a rollout has none (failed / abandoned).
    """

    gamma: float = 1.0
    eps: float = 1e-6
    std_normalize: bool = True
    std_unbiased: bool = True
    loss_weight: LossWeightMode = "none"
    trajectory_mode: bool = False
    failure_reward: float = 0.0
    call_credit: CallCreditMode = "return"

    def __post_init__(self) -> None:
        if self.call_credit not in CALL_CREDIT_MODES:
            raise ValueError(f"call_credit: must be one of {CALL_CREDIT_MODES}, got {self.call_credit!r}")
        gamma = _finite("gamma", self.gamma)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma: must be in [0, 1], got {gamma}")
        eps = _finite("eps", self.eps)
        if eps < 0.0:
            raise ValueError(f"eps: must be >= 0, got {eps}")
        if self.loss_weight not in LOSS_WEIGHT_MODES:
            raise ValueError(f"loss_weight: must be one of {LOSS_WEIGHT_MODES}, got {self.loss_weight!r}")
        for name in ("std_normalize", "std_unbiased", "trajectory_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "gamma", gamma)
        object.__setattr__(self, "eps", eps)
        object.__setattr__(self, "failure_reward", _finite("failure_reward", self.failure_reward))
