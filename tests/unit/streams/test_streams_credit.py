"""boltstream.streams.credit: returns, GRPO advantages, loss weights, trajectory mode.

Expected numbers are worked out by hand in the comments, not recomputed by the code under test.
"""

from __future__ import annotations

import math

import pytest

from boltstream.schemas.packed import as_lists
from boltstream.streams import (
    CreditConfig,
    discounted_returns,
    group_baseline,
    group_credit,
    grpo_advantage,
    merge_turns,
    rollout_returns,
    step_rewards,
)
from tests.unit.streams.factory import trajectory, turn


def test_gamma_below_one_with_intermediate_rewards() -> None:
    # r = [0, -0.1, 0], final 1.0, gamma 0.9:
    # G2 = 0 + 1.0 = 1.0 ; G1 = -0.1 + 0.9 * 1.0 = 0.8 ; G0 = 0 + 0.9 * 0.8 = 0.72
    assert discounted_returns([0.0, -0.1, 0.0], 1.0, 0.9) == pytest.approx([0.72, 0.8, 1.0])


def test_gamma_one_gives_every_call_the_episode_reward_plus_later_rewards() -> None:
    # G2 = 1 ; G1 = -0.1 + 1 = 0.9 ; G0 = 0 + 0.9 = 0.9
    assert discounted_returns([0.0, -0.1, 0.0], 1.0, 1.0) == pytest.approx([0.9, 0.9, 1.0])
    assert discounted_returns([0.0, 0.0, 0.0], 0.5, 1.0) == [0.5, 0.5, 0.5]
    assert discounted_returns([], 1.0, 1.0) == []


def test_gamma_zero_keeps_only_own_rewards() -> None:
    assert discounted_returns([0.2, 0.0], 1.0, 0.0) == pytest.approx([0.2, 1.0])


def test_step_rewards_sum_per_turn() -> None:
    traj = trajectory("a", [turn(0, [1], [2], rewards=[-0.1, 0.5]), turn(1, [3], [4])])
    assert step_rewards(traj) == pytest.approx([0.4, 0.0])


def test_failure_reward_used_and_recorded() -> None:
    failed = trajectory("a", [turn(0, [1], [2]), turn(1, [3], [4], rewards=[-0.1])], final_reward=None, status="failed")
    returns = rollout_returns(failed, CreditConfig(failure_reward=-1.0))
    # G1 = -0.1 + (-1.0) = -1.1 ; G0 = 0 + 1.0 * -1.1 = -1.1
    assert returns.call_returns == pytest.approx((-1.1, -1.1))
    assert returns.episode_return == pytest.approx(-1.1)
    assert (returns.final_reward, returns.failure_reward_used) == (-1.0, True)
    ok = rollout_returns(trajectory("b", [turn(0, [1], [2])], final_reward=0.0), CreditConfig(failure_reward=-1.0))
    assert (ok.final_reward, ok.failure_reward_used) == (0.0, False)


def test_rollout_without_trained_calls_has_the_final_reward_as_episode_return() -> None:
    returns = rollout_returns(trajectory("a", [], final_reward=0.7), CreditConfig())
    assert (returns.call_returns, returns.episode_return) == ((), 0.7)


def test_group_baseline_sample_and_population_std() -> None:
    # returns 1, 0, 0, 1: mean 0.5; squared deviations 4 * 0.25 = 1
    # sample std = sqrt(1 / 3) ; population std = sqrt(1 / 4) = 0.5
    assert group_baseline([1.0, 0.0, 0.0, 1.0]) == pytest.approx((0.5, math.sqrt(1 / 3)))
    assert group_baseline([1.0, 0.0, 0.0, 1.0], unbiased=False) == pytest.approx((0.5, 0.5))
    assert group_baseline([0.3]) == (0.3, 0.0)
    assert group_baseline([]) == (0.0, 0.0)


def test_grpo_advantage_with_and_without_std() -> None:
    cfg = CreditConfig(std_normalize=True, eps=1e-6)
    assert grpo_advantage(1.0, 0.5, 0.5, cfg) == pytest.approx(0.5 / 0.500001)
    assert grpo_advantage(0.0, 0.5, 0.5, CreditConfig(std_normalize=False)) == -0.5
    assert grpo_advantage(0.3, 0.3, 0.0, cfg) == 0.0
    assert grpo_advantage(1.0, 0.0, 0.0, CreditConfig(std_normalize=True, eps=0.0)) == 0.0  # no spread, no eps: no signal


def test_group_advantages_with_std() -> None:
    group = [
        trajectory("a", [turn(0, [1], [2])], final_reward=1.0),
        trajectory("b", [turn(0, [1], [3])], final_reward=0.0),
        trajectory("c", [turn(0, [1], [4])], final_reward=0.0),
        trajectory("d", [turn(0, [1], [5])], final_reward=1.0),
    ]
    credit = group_credit(group, CreditConfig(std_normalize=True, eps=1e-6))
    std = math.sqrt(1 / 3)  # see test_group_baseline_sample_and_population_std
    assert (credit.mean, credit.std) == pytest.approx((0.5, std))
    assert [s["advantage"] for s in credit.samples] == pytest.approx(
        [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    )
    assert [s["reward"] for s in credit.samples] == [1.0, 0.0, 0.0, 1.0]
    no_std = group_credit(group, CreditConfig(std_normalize=False))
    assert [s["advantage"] for s in no_std.samples] == [0.5, -0.5, -0.5, 0.5]


def test_group_without_spread_gives_zero_advantage_even_with_intermediate_rewards() -> None:
    # Both attempts: AIR +0.1 on the first call, final 0 -> G = [0.1, 0.0], episode returns 0.1 and 0.1.
    group = [trajectory(a, [turn(0, [1], [2], rewards=[0.1]), turn(1, [1, 2, 9], [3])], final_reward=0.0)
             for a in ("a", "b")]
    credit = group_credit(group, CreditConfig(std_normalize=True, eps=1e-6))
    assert credit.std == 0.0
    # (0.0 - 0.1) / (0 + 1e-6) would be -1e5 for the second calls
    assert [s["advantage"] for s in credit.samples] == [0.0, 0.0, 0.0, 0.0]
    assert grpo_advantage(1.1, 1.0, 5e-7, CreditConfig(std_normalize=True, eps=1e-6)) == 0.0


def test_episode_call_credit_the_default_gives_every_call_the_rollout_advantage() -> None:
    group = [
        # G = [0.1 + 1.0, 1.0], episode return 1.1
        trajectory("a", [turn(0, [1], [2], rewards=[0.1]), turn(1, [1, 2, 9], [3])], final_reward=1.0),
        # G = [0.0], episode return 0.0
        trajectory("b", [turn(0, [1], [4])], final_reward=0.0),
    ]
    per_call = group_credit(group, CreditConfig(std_normalize=True, eps=0.0, std_unbiased=False, call_credit="return"))
    episode = group_credit(group, CreditConfig(std_normalize=True, eps=0.0, std_unbiased=False))
    # mean 0.55, population std 0.55
    assert [s["advantage"] for s in per_call.samples] == pytest.approx([1.0, 0.45 / 0.55, -1.0])
    assert [s["advantage"] for s in episode.samples] == pytest.approx([1.0, 1.0, -1.0])
    assert [s["reward"] for s in episode.samples] == pytest.approx([1.1, 1.1, 0.0])
    with pytest.raises(ValueError, match="call_credit"):
        CreditConfig(call_credit="tokens")  # type: ignore[arg-type]


def test_group_with_gamma_intermediate_rewards_and_a_failure() -> None:
    group = [
        # A: r = [-0.2, 0], final 1.0, gamma 0.5: G1 = 1.0 ; G0 = -0.2 + 0.5 * 1.0 = 0.3
        trajectory("A", [turn(0, [1], [2], rewards=[-0.2]), turn(1, [1, 2, 7], [3])], final_reward=1.0),
        # B: failed, no final reward -> failure_reward 0.0: G0 = 0.0
        trajectory("B", [turn(0, [1], [4])], final_reward=None, status="failed"),
        # C: r = [0.5], final 0.5: G0 = 0.5 + 0.5 = 1.0
        trajectory("C", [turn(0, [1], [5], rewards=[0.5])], final_reward=0.5),
    ]
    credit = group_credit(group, CreditConfig(std_normalize=True, gamma=0.5, eps=0.0, std_unbiased=False,
                                              call_credit="return"))
    # episode returns 0.3, 0.0, 1.0 -> mean 1.3 / 3
    # deviations -0.4/3, -1.3/3, 1.7/3 -> squares sum (0.16 + 1.69 + 2.89) / 9 = 4.74 / 9
    # population variance 4.74 / 27
    mean, std = 1.3 / 3, math.sqrt(4.74 / 27)
    assert (credit.mean, credit.std) == pytest.approx((mean, std))
    assert [s["sample_id"] for s in credit.samples] == ["A:0", "A:1", "B:0", "C:0"]
    assert [s["reward"] for s in credit.samples] == pytest.approx([0.3, 1.0, 0.0, 1.0])
    assert [s["advantage"] for s in credit.samples] == pytest.approx(
        [(-0.4 / 3) / std, (1.7 / 3) / std, (-1.3 / 3) / std, (1.7 / 3) / std]
    )
    assert [r.failure_reward_used for r in credit.returns] == [False, True, False]


def test_single_rollout_group_has_zero_advantage() -> None:
    credit = group_credit([trajectory("a", [turn(0, [1], [2])], final_reward=1.0)])
    assert (credit.mean, credit.std, credit.samples[0]["advantage"]) == (1.0, 0.0, 0.0)


def test_inverse_calls_loss_weights() -> None:
    group = [
        trajectory("a", [turn(0, [1], [2]), turn(1, [5], [6])], final_reward=1.0),  # T = 2 -> 1/2
        trajectory("b", [turn(0, [1], [3])], final_reward=0.0),  # T = 1 -> 1
        trajectory("c", [turn(0, [1], [3]), turn(1, [8], [9]), turn(2, [10], [11]), turn(3, [12], [13])]),  # 1/4
    ]
    weighted = group_credit(group, CreditConfig(loss_weight="inverse_calls"))
    assert [s["loss_weight"] for s in weighted.samples] == [0.5, 0.5, 1.0, 0.25, 0.25, 0.25, 0.25]
    plain = group_credit(group, CreditConfig())
    assert {s["loss_weight"] for s in plain.samples} == {1.0}


def test_per_call_sample_layout() -> None:
    traj = trajectory(
        "t1:0", [turn(0, [1, 2], [3, 4], logprobs=[-0.1, -0.2], agent="coder", temperature=0.7)], rollout_id="r1"
    )
    (sample,) = group_credit([traj]).samples
    assert sample["behaviour_logprobs"].tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2])  # float32
    assert as_lists(sample) | {"behaviour_logprobs": []} == {
        "sample_id": "t1:0:0",
        "rollout_id": "r1",
        "attempt_id": "t1:0",
        "task_id": "t1",
        "call_index": 0,
        "token_ids": [1, 2, 3, 4],
        "prompt_length": 2,
        "loss_mask": [False, False, True, True],
        "behaviour_logprobs": [],
        "advantage": 0.0,
        "loss_weight": 1.0,
        "reward": 1.0,
        "policy_version": 3,
        "agent_name": "coder",
        "temperature": 0.7,
    }


def test_missing_logprobs_become_zero_when_allowed() -> None:
    traj = trajectory("a", [turn(0, [1], [2, 3], logprobs=[])])
    assert group_credit([traj]).samples[0]["behaviour_logprobs"].tolist() == [0.0, 0.0, 0.0]


def test_trajectory_mode_merges_extending_calls_and_masks_inserted_tokens() -> None:
    turns = [
        turn(0, [1, 2], [3, 4], logprobs=[-0.1, -0.2]),
        turn(1, [1, 2, 3, 4, 5, 6], [7], logprobs=[-0.3]),  # extends call 0; 5, 6 = tool output
        turn(2, [1, 2, 3, 4, 5, 6, 7], [8, 9], logprobs=[-0.4, -0.5]),  # extends call 1, nothing inserted
        turn(3, [20, 21], [22], logprobs=[-0.6]),  # a fresh context
    ]
    assert merge_turns(turns) == [[0, 1, 2], [3]]
    traj = trajectory("a", turns, final_reward=1.0)
    cfg = CreditConfig(trajectory_mode=True, loss_weight="inverse_calls")
    first, second = group_credit([traj], cfg).samples
    assert first["sample_id"] == "a:0"
    assert first["token_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert first["prompt_length"] == 2
    assert first["loss_mask"].tolist() == [False, False, True, True, False, False, True, True, True]
    assert first["behaviour_logprobs"].tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5])
    assert first["loss_weight"] == 0.5
    assert second["sample_id"] == "a:3"
    assert second["token_ids"].tolist() == [20, 21, 22]
    assert second["loss_mask"].tolist() == [False, False, True]


def test_trajectory_mode_uses_the_first_calls_return() -> None:
    turns = [turn(0, [1], [2], rewards=[-0.5]), turn(1, [1, 2, 3], [4])]
    traj = trajectory("a", turns, final_reward=1.0)
    # gamma 0.5: G1 = 1.0 ; G0 = -0.5 + 0.5 * 1.0 = 0.0
    (merged,) = group_credit([traj], CreditConfig(trajectory_mode=True, gamma=0.5)).samples
    assert merged["reward"] == 0.0


def test_trajectory_mode_does_not_merge_across_policy_versions_or_agents() -> None:
    assert merge_turns([turn(0, [1], [2], policy_version=1), turn(1, [1, 2, 3], [4], policy_version=2)]) == [
        [0],
        [1],
    ]
    assert merge_turns([turn(0, [1], [2], agent="a"), turn(1, [1, 2, 3], [4], agent="b")]) == [[0], [1]]
    assert merge_turns([turn(0, [1, 2], [3]), turn(1, [1, 2], [4])]) == [[0], [1]]  # prompt does not extend
    assert merge_turns([]) == []


def test_trajectory_mode_does_not_merge_across_temperatures() -> None:
    """One sample is scored at one temperature, so calls sampled at different ones stay apart."""
    turns = [
        turn(0, [1], [2], logprobs=[-0.1], temperature=0.7),
        turn(1, [1, 2, 3], [4], logprobs=[-0.2], temperature=0.7),  # merges: same temperature
        turn(2, [1, 2, 3, 4], [5], logprobs=[-0.3], temperature=1.0),  # extends, but another temperature
        turn(3, [1, 2, 3, 4, 5], [6], logprobs=[-0.4], temperature=None),  # unknown is not 1.0 either
    ]
    assert merge_turns(turns) == [[0, 1], [2], [3]]
    first, second, third = group_credit([trajectory("a", turns)], CreditConfig(trajectory_mode=True)).samples
    assert (first["temperature"], second["temperature"], third["temperature"]) == (0.7, 1.0, None)
    assert first["token_ids"].tolist() == [1, 2, 3, 4] and first["loss_mask"].tolist() == [False, True, False, True]
    assert second["token_ids"].tolist() == [1, 2, 3, 4, 5] and second["prompt_length"] == 4


def test_group_credit_counts_a_repeated_attempt_once() -> None:
    a = trajectory("a", [turn(0, [1], [2])], final_reward=1.0)
    b = trajectory("b", [turn(0, [1], [3])], final_reward=0.0)
    credit = group_credit([a, b, a], CreditConfig(std_normalize=True, std_unbiased=False, eps=0.0))
    assert [s["sample_id"] for s in credit.samples] == ["a:0", "b:0"]
    assert [s["advantage"] for s in credit.samples] == [1.0, -1.0]  # mean 0.5, population std 0.5
