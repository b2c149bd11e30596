"""Seeded comparison questions: two people compared in a sentence, a question about one side, and three
options (the two, and one name the sentence never mentions).

Half of the questions ask for the side the sentence names first and half for the other, so picking
by position scores 0.5 at best on two names and a third of that by chance on three options. Train
and test splits never share a question.
"""

from __future__ import annotations

import random

from ..task_files import write_splits

NAMES = ["Anna", "Ben", "Carla", "Dev", "Elif", "Femi", "Gus", "Hana", "Ines", "Jon", "Kai", "Lea", "Milo",
         "Nora", "Otto", "Pia", "Raj", "Sara", "Theo", "Uma"]
# (comparative in the sentence, question asking for its side, question asking for the other side)
RELATIONS = [
    ("older", "Who is older?", "Who is younger?"),
    ("taller", "Who is taller?", "Who is shorter?"),
    ("faster", "Who is faster?", "Who is slower?"),
    ("heavier", "Who is heavier?", "Who is lighter?"),
    ("richer", "Who is richer?", "Who is poorer?"),
    ("stronger", "Who is stronger?", "Who is weaker?"),
]


def generate(n: int, seed: int, split: str, exclude: set[str] | None = None) -> list[dict]:
    """``n`` tasks, deterministic for a seed: ``question``, ``options`` and the ``answer`` name."""
    rng = random.Random(seed)
    seen, tasks = set(exclude or ()), []
    while len(tasks) < n:
        a, b, other = rng.sample(NAMES, 3)
        word, same, opposite = rng.choice(RELATIONS)
        ask_same = len(tasks) % 2 == 0
        options = [a, b, other]
        rng.shuffle(options)
        question = f"{a} is {word} than {b}. {same if ask_same else opposite}"
        if question in seen:
            continue
        seen.add(question)
        tasks.append({"id": f"{split}-{len(tasks):04d}", "question": question, "options": options,
                      "answer": a if ask_same else b})
    return tasks


def train_test(n_train: int = 256, n_test: int = 32, seed: int = 0) -> tuple[list[dict], list[dict]]:
    test = generate(n_test, seed + 1, "test")
    return generate(n_train, seed, "train", exclude={t["question"] for t in test}), test


if __name__ == "__main__":
    raise SystemExit(write_splits("choose", train_test))
