"""Which baseline for task-less traffic: how far each puts an advantage from the true one, same traffic.

    .venv/bin/python benchmarks/bench_baselines.py [--rollouts 20000] [--seeds 5]

Traffic without task ids has no GRPO group (docs/zero-code.md, "Which baseline applies"). A
rollout's true advantage is its reward minus what the policy expects on that prompt,
``r - p(prompt)``; a baseline estimates ``p(prompt)``. Simulated here: prompts of difficulty
``p ~ U(0, 1)`` plus a drift (the policy learns: ``--drift``, success probability gained over
the run, capped at 1), rewards ``Bernoulli(p)``; a share ``repeat`` of the traffic asks a prompt
several times within the prompt window (a user retrying, a popular question: groups of 2-6),
the rest asks it once. Compared on the same traffic, with the stream app's own functions
(``streams/baselines.py``: ``AgentBaselines`` for the running mean):

* ``fingerprint+agent`` (the default): repeated prompts are grouped by fingerprint and get
  their group's mean (GRPO, no std division); a prompt seen once gets the agent's running
  mean of the last ``window`` returns;
* ``agent only``: every rollout gets the agent's running mean (no fingerprint groups);
* ``none``: advantage = reward (the floor every baseline must beat).

Reported per configuration: the mean squared error of the advantage against the true one
(lower is better), and the share of rollouts whose advantage is exactly 0 (no signal). Ratios
against ``none`` in the same run. JSON goes to benchmarks/results/baselines.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from boltstream.streams.baselines import AgentBaselines

RESULTS = Path(__file__).parent / "results"
REPEATS = (0.0, 0.5, 0.9)
WINDOWS = (8, 32, 128)


def traffic(n: int, repeat: float, drift: float, rng: random.Random) -> list[list[tuple[float, float]]]:
    """Groups of (success probability, reward) in arrival order: a repeated prompt's attempts arrive
    together; the policy improves by ``drift`` (in success probability) over the run, as a trained one does."""
    groups, total = [], 0
    while total < n:
        p = min(1.0, rng.random() + drift * total / n)
        size = rng.randint(2, 6) if rng.random() < repeat else 1
        groups.append([(p, float(rng.random() < p)) for _ in range(size)])
        total += size
    return groups


def errors(groups: list[list[tuple[float, float]]], mode: str, window: int) -> tuple[float, float]:
    """(mean squared error against r - p, share of zero advantages) of one baseline over the traffic."""
    history = AgentBaselines(window)
    sq, zero, n = 0.0, 0, 0
    for group in groups:
        returns = [r for _, r in group]
        for p, r in group:
            if mode == "none":
                base = 0.0
            elif mode == "fingerprint+agent" and len(group) > 1:
                base = statistics.fmean(returns)
            else:
                base, _ = history.baseline("agent", r)
            advantage = r - base
            sq += (advantage - (r - p)) ** 2
            zero += advantage == 0.0
            n += 1
        for r in returns:
            history.add("agent", r)
    return sq / n, zero / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=20000)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--drift", type=float, default=0.3, help="success probability the policy gains over the run")
    args = p.parse_args()
    results: dict[str, dict[str, float]] = {}
    print(f"{'repeat':>6} {'window':>6} {'baseline':>18} {'MSE':>7} {'vs none':>8} {'adv = 0':>8}")
    for repeat in REPEATS:
        runs = [traffic(args.rollouts, repeat, args.drift, random.Random(seed)) for seed in range(args.seeds)]
        none = statistics.fmean(errors(g, "none", 1)[0] for g in runs)
        for window in WINDOWS:
            for mode in ("fingerprint+agent", "agent only"):
                mse, zero = (statistics.fmean(v) for v in zip(*(errors(g, mode, window) for g in runs), strict=True))
                results[f"repeat={repeat} window={window} {mode}"] = {"mse": mse, "mse_vs_none": mse / none,
                                                                       "zero_advantage_share": zero}
                print(f"{repeat:6.1f} {window:6d} {mode:>18} {mse:7.4f} {mse / none:8.3f} {zero:8.3f}")
        results[f"repeat={repeat} none"] = {"mse": none, "mse_vs_none": 1.0, "zero_advantage_share": 0.0}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "baselines.json").write_text(json.dumps({"rollouts": args.rollouts, "seeds": args.seeds, "drift": args.drift,
                                                        "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
