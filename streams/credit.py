"""LightningRL credit assignment and GRPO advantages: Trajectories -> Samples.

Why: the learner optimises single LLM calls, but rewards belong to whole
rollouts (plus a few intermediate ones). This module decides how much of which
reward each call gets, pure and deterministic so replays give the same numbers.

- Per-call return (over the *trained* calls of a rollout, in order):
  G_{T-1} = r_{T-1} + R_final,  G_t = r_t + gamma * G_{t+1},
  r_t = sum of the intermediate rewards attached to call t. gamma = 1 with no
  intermediate rewards gives every call the episode reward (Agent Lightning).
- A rollout with no final reward (failed / abandoned) uses ``failure_reward``;
  :class:`RolloutReturns` records that (``failure_reward_used``) and it is logged
  (the Sample schema has no field for it).
- GRPO baseline over the group (all attempts of one task): mean and std of the
  episode returns G_{i,0} (a rollout without trained calls counts with
  G_0 = R_final); A_{i,t} = (G_{i,t} - mean) / (std + eps), or G - mean with
  ``std_normalize=False``; 0 for a group without spread (std <= eps).
  ``call_credit="episode"`` (the default) uses G_{i,0} for every call of rollout i;
  ``"return"`` uses each call's G_{i,t}. Sample std (n - 1) by default like
  torch.std/verl/TRL; a group of one has std 0.
- Loss weight: 1.0, or 1 / T_i with T_i = number of samples of rollout i (its
  trained calls; in trajectory mode a merged sample counts once).
- Trajectory mode: consecutive calls whose prompt starts with the previous call's
  prompt + response (same policy version, agent and sampling temperature: one
  sample is scored at one temperature) become one sample; tokens the
  environment inserted between them (tool output, observations) get
  loss_mask False and behaviour logprob 0. A merged sample carries the return
  and advantage of its first call.
"""

from __future__ import annotations

import logging
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from boltstream.schemas.packed import F32, I32, as_array

from .core_config import CreditConfig

logger = logging.getLogger(__name__)

Sample = dict[str, Any]
Trajectory = Mapping[str, Any]


@dataclass(frozen=True)
class RolloutReturns:
    """Returns of one rollout attempt: G_t per trained call and the episode return G_0."""

    attempt_id: str
    call_returns: tuple[float, ...]
    episode_return: float
    final_reward: float
    failure_reward_used: bool


def step_rewards(trajectory: Trajectory) -> list[float]:
    """r_t: the sum of intermediate rewards attached to each turn."""
    return [float(sum(r["value"] for r in turn.get("rewards") or ())) for turn in trajectory["turns"]]


def discounted_returns(rewards: Sequence[float], final_reward: float, gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_{t+1}, with ``final_reward`` added at the last step."""
    returns = [0.0] * len(rewards)
    following = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = rewards[t] + (final_reward if t == len(rewards) - 1 else gamma * following)
        returns[t] = g
        following = g
    return returns


def rollout_returns(trajectory: Trajectory, config: CreditConfig) -> RolloutReturns:
    """Per-call returns of one trajectory; a missing final reward becomes ``config.failure_reward``."""
    final = trajectory.get("final_reward")
    used_failure = final is None
    if used_failure:
        final = config.failure_reward
        log = logger.warning if trajectory.get("status", "ok") == "ok" else logger.info
        log(
            "attempt %s (status %s) has no final reward; using failure_reward %s",
            trajectory["attempt_id"],
            trajectory.get("status"),
            final,
        )
    returns = discounted_returns(step_rewards(trajectory), float(final), config.gamma)
    episode = returns[0] if returns else float(final)
    return RolloutReturns(trajectory["attempt_id"], tuple(returns), episode, float(final), used_failure)


def group_baseline(episode_returns: Sequence[float], *, unbiased: bool = True) -> tuple[float, float]:
    """(mean, std) of the group's episode returns; std is 0 for fewer than two values."""
    n = len(episode_returns)
    if n == 0:
        return 0.0, 0.0
    mean = math.fsum(episode_returns) / n
    if n < 2:
        return mean, 0.0
    ddof = 1 if unbiased else 0
    var = math.fsum((g - mean) ** 2 for g in episode_returns) / (n - ddof)
    return mean, math.sqrt(var)


def grpo_advantage(value: float, mean: float, std: float, config: CreditConfig) -> float:
    """A = (G - mean) / (std + eps), or G - mean when ``std_normalize`` is off.

    A group without spread (std <= eps) gives 0: its attempts did equally well, and a
    call whose G_t differs from the episode returns (an intermediate reward earlier in
    the rollout) would otherwise be divided by eps alone.
    """
    centred = value - mean
    if not config.std_normalize:
        return centred
    if std <= config.eps:  # eps >= 0, so this also covers std + eps == 0
        return 0.0
    return centred / (std + config.eps)


def merge_turns(turns: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Indices of turns merged into one sample each (trajectory mode).

    Turn j joins the current sample when its prompt starts with the previous
    turn's prompt + response and it has the same policy version, agent name and
    temperature (the learner scores a whole sample at one temperature).
    """
    groups: list[list[int]] = []
    previous: array | None = None
    for j, turn in enumerate(turns):
        prompt = as_array(turn["prompt_token_ids"], I32)
        if groups and previous is not None:
            last = turns[groups[-1][-1]]
            if (
                len(prompt) >= len(previous)
                and prompt[: len(previous)] == previous
                and turn.get("policy_version", -1) == last.get("policy_version", -1)
                and turn.get("agent_name") == last.get("agent_name")
                and turn.get("temperature") == last.get("temperature")
            ):
                groups[-1].append(j)
                previous = prompt + as_array(turn["response_token_ids"], I32)
                continue
        groups.append([j])
        previous = prompt + as_array(turn["response_token_ids"], I32)
    return groups


_ZERO = array("f", [0.0])


def _logprobs(turn: Mapping[str, Any]) -> array:
    logprobs = as_array(turn.get("response_logprobs") or (), F32)
    return logprobs if logprobs else _ZERO * len(turn["response_token_ids"])


def trajectory_samples(
    trajectory: Trajectory,
    returns: RolloutReturns,
    mean: float,
    std: float,
    config: CreditConfig,
) -> list[Sample]:
    """Samples of one trajectory given the group baseline (``mean``, ``std``)."""
    turns = trajectory["turns"]
    groups = merge_turns(turns) if config.trajectory_mode else [[j] for j in range(len(turns))]
    weight = 1.0 / len(groups) if (config.loss_weight == "inverse_calls" and groups) else 1.0
    samples = []
    for group in groups:
        first = turns[group[0]]
        # array.array all the way (the Sample's token payloads are packed bytes on the wire): the
        # decoded turns' arrays are concatenated in C, never turned into Python lists.
        tokens = array("i", as_array(first["prompt_token_ids"], I32))
        prompt_length = len(tokens)
        mask = array("B", bytes(prompt_length))
        logprobs = _ZERO * prompt_length
        for j in group:
            turn = turns[j]
            inserted = as_array(turn["prompt_token_ids"], I32)[len(tokens) :]
            response = as_array(turn["response_token_ids"], I32)
            tokens += inserted
            tokens += response
            mask.frombytes(bytes(len(inserted)) + b"\x01" * len(response))
            logprobs += _ZERO * len(inserted)
            logprobs += _logprobs(turn)
        g = returns.call_returns[group[0]] if config.call_credit == "return" else returns.episode_return
        samples.append(
            {
                "sample_id": f"{trajectory['attempt_id']}:{first['call_index']}",
                "rollout_id": trajectory["rollout_id"],
                "attempt_id": trajectory["attempt_id"],
                "task_id": trajectory["task_id"],
                "call_index": int(first["call_index"]),
                "token_ids": tokens,
                "prompt_length": prompt_length,
                "loss_mask": mask,
                "behaviour_logprobs": logprobs,
                "advantage": grpo_advantage(g, mean, std, config),
                "loss_weight": weight,
                "reward": g,
                "policy_version": int(first.get("policy_version", -1)),
                "agent_name": first.get("agent_name"),
                "temperature": first.get("temperature"),
            }
        )
    return samples


@dataclass
class GroupCredit:
    """Samples of a GRPO group plus the baseline they were normalised with."""

    samples: list[Sample] = field(default_factory=list)
    mean: float = 0.0
    std: float = 0.0
    returns: list[RolloutReturns] = field(default_factory=list)


def group_credit(trajectories: Iterable[Trajectory], config: CreditConfig | None = None,
                 baseline: tuple[float, float] | None = None) -> GroupCredit:
    """Samples with advantages for all attempts of one task (one GRPO group).

    Trajectories repeated with the same ``attempt_id`` count once (first kept).
    ``baseline`` (mean, std) replaces the group's own when given: a trajectory with no
    group (streams/baselines.py) is compared with its agent's recent returns.
    """
    config = config or CreditConfig()
    unique: dict[str, Trajectory] = {}
    for trajectory in trajectories:
        unique.setdefault(trajectory["attempt_id"], trajectory)
    returns = [rollout_returns(t, config) for t in unique.values()]
    if baseline is None:
        mean, std = group_baseline([r.episode_return for r in returns], unbiased=config.std_unbiased)
    else:
        mean, std = baseline
    samples: list[Sample] = []
    for trajectory, rollout in zip(unique.values(), returns, strict=True):
        samples.extend(trajectory_samples(trajectory, rollout, mean, std, config))
    return GroupCredit(samples, mean, std, returns)
