"""Seeded questions about the corpus's islands: the capital or the main export of one island.

Train and test ask about different islands, so what is learned is to look things up and read the
entry, not the answers themselves.
"""

from __future__ import annotations

import random

from ..task_files import write_splits
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


if __name__ == "__main__":
    raise SystemExit(write_splits("lookup", train_test))
