"""Seeded sentences about a person, and the four fields to extract from each.

Every sentence names a person, their age, city and job, in one of several word orders, so the
model must find each field rather than copy a position. Train and test splits never share a
sentence.
"""

from __future__ import annotations

import random

from ..task_files import write_splits

FIRST = ["Maria", "John", "Aisha", "Wei", "Olga", "Carlos", "Priya", "Tom", "Fatima", "Lars", "Yuki", "Ana",
         "Peter", "Nadia", "Omar", "Grace", "Ivan", "Lena", "Kofi", "Sofia"]
LAST = ["Lopez", "Smith", "Khan", "Chen", "Petrova", "Silva", "Patel", "Brown", "Haddad", "Berg", "Sato",
        "Costa", "Novak", "Ali", "Mensah", "Rossi", "Meyer", "Kim", "Dubois", "Walsh"]
CITIES = ["Lisbon", "Denver", "Nairobi", "Osaka", "Krakow", "Lima", "Dublin", "Austin", "Porto", "Hanoi",
          "Quito", "Leeds", "Accra", "Turin", "Perth", "Malmo"]
JOBS = ["nurse", "baker", "pilot", "teacher", "plumber", "chemist", "lawyer", "farmer", "welder", "dentist",
        "architect", "librarian", "mechanic", "chef", "journalist", "electrician"]
TEMPLATES = [
    "{name} is a {age}-year-old {job} who lives in {city}.",
    "Living in {city}, {name} ({age}) works as a {job}.",
    "At {age}, {name} moved to {city} to start a new job as a {job}.",
    "The {job} {name}, aged {age}, is based in {city}.",
    "In {city} you can meet {name}, a {job} who turned {age} this year.",
    "{name} has worked as a {job} in {city} since turning {age}.",
]
FIELDS = ("name", "age", "city", "job")


def generate(n: int, seed: int, split: str, exclude: set[str] | None = None) -> list[dict]:
    """``n`` tasks, deterministic for a seed: ``sentence`` and the ``expected`` fields."""
    rng = random.Random(seed)
    seen, tasks = set(exclude or ()), []
    while len(tasks) < n:
        fields = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "age": rng.randint(19, 78),
                  "city": rng.choice(CITIES), "job": rng.choice(JOBS)}
        sentence = rng.choice(TEMPLATES).format(**fields)
        if sentence in seen:
            continue
        seen.add(sentence)
        tasks.append({"id": f"{split}-{len(tasks):04d}", "sentence": sentence, "expected": fields})
    return tasks


def train_test(n_train: int = 256, n_test: int = 32, seed: int = 0) -> tuple[list[dict], list[dict]]:
    test = generate(n_test, seed + 1, "test")
    return generate(n_train, seed, "train", exclude={t["sentence"] for t in test}), test


if __name__ == "__main__":
    raise SystemExit(write_splits("extract", train_test))
