"""Seeded questions about the corpus's islands: the capital or the main export of one island.

Train and test ask about different islands, so what is learned is to look things up and read the
entry, not the answers themselves.
"""

from __future__ import annotations

import argparse
import json
import random

from .corpus import CORPUS

QUESTIONS = {"capital": "What is the capital of the island of {name}?",
             "export": "What is the main export of the island of {name}?"}


def generate(islands: list[str], n: int, seed: int, split: str) -> list[dict]:
    """``n`` tasks about ``islands`` (both questions of each before any repeats), deterministic for a seed."""
    rng = random.Random(seed)
    pairs = [(name, kind) for name in islands for kind in QUESTIONS]
    rng.shuffle(pairs)
    return [{"id": f"{split}-{i:04d}", "question": QUESTIONS[kind].format(name=name),
             "answer": CORPUS[name][kind]} for i, (name, kind) in enumerate((pairs * (n // len(pairs) + 1))[:n])]


def train_test(n_train: int = 256, n_test: int = 32, seed: int = 0) -> tuple[list[dict], list[dict]]:
    islands = sorted(CORPUS)
    random.Random(seed).shuffle(islands)
    return generate(islands[16:], n_train, seed, "train"), generate(islands[:16], n_test, seed + 1, "test")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the lookup agent's tasks as JSONL")
    p.add_argument("--train", default="lookup_train.jsonl")
    p.add_argument("--test", default="lookup_test.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for path, tasks in zip((args.train, args.test), train_test(seed=args.seed), strict=True):
        with open(path, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in tasks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
