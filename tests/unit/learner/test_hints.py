"""The not-learning hints, on step records written by hand."""

from __future__ import annotations

from boltstream.learner import hints


def step(n: int, alike: float = 0.0, entropy: float = 1.0, clip: float = 0.0) -> dict:
    return {"step": n, "groups_without_spread": alike, "entropy": entropy, "clip_fraction": clip}


def test_groups_that_score_alike_for_three_steps_ask_for_more_spread() -> None:
    steps = [step(1, 0.25), step(2, 0.5), step(3, 0.75), step(4, 1.0)]
    hint = hints.stuck_hint(steps)
    assert hint is not None and hint.kind == "no_spread"
    assert hint.text.startswith("75% of the groups in the last 3 steps scored alike, so")  # (.5+.75+1)/3
    assert "--group-size" in hint.text and "temperature" in hint.text
    assert hints.stuck_hint(steps[:3]) is None  # 0.25 at step 1: not three steps in a row yet
    assert hints.stuck_hint([step(1, 1.0), step(2, 1.0)]) is None  # fewer than three steps


def test_groups_alike_because_they_are_solved_get_no_hint() -> None:
    def solved(n: int, alike_reward: float) -> dict:
        return {**step(n, 0.75), "alike_reward_mean": alike_reward, "group_reward_min": 0.0, "group_reward_max": 1.1}

    # the run has seen groups from 0 to 1.1; the alike ones score 1.1: solved, nothing to change
    assert hints.stuck_hint([solved(1, 1.1), solved(2, 1.1), solved(3, 1.1)]) is None
    # alike ones that average below the best (some failed alike): still no signal from them
    stuck = hints.stuck_hint([solved(1, 0.4), solved(2, 0.4), solved(3, 0.4)])
    assert stuck is not None and stuck.text.startswith("75% of the groups in the last 3 steps scored alike (at 0.400")
    # a run whose groups never differed (every attempt 1.0, always) is silent, not solved
    same = [{**step(n, 1.0), "alike_reward_mean": 1.0, "group_reward_min": 1.0, "group_reward_max": 1.0}
            for n in (1, 2, 3)]
    assert hints.stuck_hint(same) is not None


def test_groups_alike_at_nothing_after_a_penalty_are_stuck_not_solved() -> None:
    # a retrieval agent's run: step 1's attempts earned 0 or an intermediate penalty of -0.075 (best group
    # 0.0, worst -0.075), then every attempt of every group earned 0: the policy stopped trying
    first = {**step(1, 0.375), "alike_reward_mean": 0.0, "group_reward_min": -0.075, "group_reward_max": 0.0}
    then = [{**step(n, 1.0), "alike_reward_mean": 0.0, "group_reward_min": 0.0, "group_reward_max": 0.0}
            for n in (2, 3, 4)]
    assert hints.stuck_hint([first, *then[:1]]) is None  # two steps: not yet
    stuck = hints.stuck_hint([first, *then])
    assert stuck is not None and stuck.kind == "no_spread"
    assert stuck.text.startswith("100% of the groups in the last 3 steps scored alike (at 0.000 on average at step 4)")
    # the same run had its alike groups scored 0.25 after seeing 0.0: solved (the best, above zero)
    up = [{**r, "alike_reward_mean": 0.25, "group_reward_max": 0.25} for r in then]
    assert hints.stuck_hint([first, *up]) is None


def test_a_run_whose_rewards_spread_gets_no_hint() -> None:
    assert hints.stuck_hint([step(n, alike=0.25, entropy=0.8, clip=0.02) for n in range(1, 9)]) is None
    assert hints.stuck_hint([]) is None


def test_entropy_collapse_and_large_updates_are_named() -> None:
    collapsed = hints.stuck_hint([step(1), step(2, entropy=0.01)])
    assert collapsed is not None and collapsed.kind == "entropy"
    assert "entropy collapsed to 0.010" in collapsed.text and "--lr" in collapsed.text
    clipped = hints.stuck_hint([step(1), step(2, clip=0.35)])
    assert clipped is not None and clipped.kind == "clip"
    assert clipped.text.startswith("35% of the tokens were clipped at step 2")
    assert hints.stuck_hint([step(1, clip=0.2)]) is None  # the ceiling itself is fine
