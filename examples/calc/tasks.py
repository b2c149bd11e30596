"""Seeded single-operation word problems for the calculator agent.

One operation per problem (×, +, −, ÷) so a small model has room to learn
(it solves some from the start, so the reward is not sparse) without needing
multi-step planning. Train and test splits never share a (template, a, b).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator

TEMPLATES: dict[str, list[str]] = {
    "*": [
        "A baker fills {a} trays with {b} cookies each. How many cookies are there?",
        "A parking lot has {a} rows with {b} cars in each row. How many cars are there?",
        "Each of {a} boxes holds {b} pencils. How many pencils are there in total?",
    ],
    "+": [
        "Tom has {a} apples and buys {b} more. How many apples does he have now?",
        "A library had {a} books and received {b} new ones. How many books does it have?",
        "A bus carries {a} people and {b} more get on. How many people are on the bus?",
    ],
    "-": [
        "A tank holds {a} liters and {b} liters leak out. How many liters are left?",
        "Sara had {a} stickers and gave away {b}. How many stickers does she have left?",
        "A shop had {a} shirts and sold {b}. How many shirts are left?",
    ],
    "/": [
        "{a} candies are shared equally among {b} kids. How many candies does each kid get?",
        "A rope of {a} meters is cut into {b} equal pieces. How long is each piece in meters?",
        "{a} students are split into {b} equal teams. How many students are in each team?",
    ],
}


def _operands(op: str, rng: random.Random) -> tuple[int, int, int]:
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return a, b, a * b
    if op == "+":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return a, b, a + b
    if op == "-":
        a = rng.randint(20, 99)
        b = rng.randint(1, a - 1)
        return a, b, a - b
    b, q = rng.randint(2, 12), rng.randint(2, 12)
    return b * q, b, q


def generate(n: int, seed: int, split: str, exclude: set[str] | None = None) -> list[dict]:
    """n tasks, balanced over operations, deterministic for a seed; ids are content hashes."""
    rng = random.Random(seed)
    ops = list(TEMPLATES)
    tasks: list[dict] = []
    seen = set(exclude or ())
    while len(tasks) < n:
        op = ops[len(tasks) % len(ops)]
        template = rng.choice(TEMPLATES[op])
        a, b, answer = _operands(op, rng)
        question = template.format(a=a, b=b)
        if question in seen:
            continue
        seen.add(question)
        tasks.append({"id": f"{split}-{len(tasks):04d}", "question": question, "answer": answer, "op": op})
    return tasks


def train_test(n_train: int = 256, n_test: int = 32, seed: int = 0) -> tuple[list[dict], list[dict]]:
    test = generate(n_test, seed + 1, "test")
    train = generate(n_train, seed, "train", exclude={t["question"] for t in test})
    return train, test


def _iter_jsonl(tasks: list[dict]) -> Iterator[str]:
    for t in tasks:
        yield json.dumps(t) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write calculator tasks as JSONL")
    p.add_argument("--train", default="calc_train.jsonl")
    p.add_argument("--test", default="calc_test.jsonl")
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--n-test", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train, test = train_test(args.n_train, args.n_test, args.seed)
    for path, tasks in ((args.train, train), (args.test, test)):
        with open(path, "w") as f:
            f.writelines(_iter_jsonl(tasks))
        sys.stdout.write(f"wrote {len(tasks)} tasks to {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
