"""The lookup agent's corpus: 40 made-up islands, each with a capital and a main export.

Made up so that the model cannot know the answers: it must look them up. Built from a fixed seed,
so the corpus is the same everywhere (it ships as this code, not as a download).
"""

from __future__ import annotations

import random

SYLLABLES = ["ve", "ssa", "or", "lo", "ka", "thi", "mar", "un", "del", "ro", "sa", "ni", "ber", "ga", "tu",
             "lin", "mo", "ra", "ze", "quin"]
EXPORTS = ["copper", "salt", "wool", "tea", "amber", "cotton", "tin", "pearls", "rice", "timber", "honey",
           "coffee"]


def _word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def build(n: int = 40, seed: int = 7) -> dict[str, dict[str, str]]:
    """Island name -> {"capital", "export"}; names and capitals are all distinct."""
    rng = random.Random(seed)
    islands: dict[str, dict[str, str]] = {}
    capitals: set[str] = set()
    while len(islands) < n:
        name, capital = _word(rng, 2), _word(rng, 2)
        if name in islands or name in capitals or capital in capitals or capital in islands or name == capital:
            continue
        capitals.add(capital)
        islands[name] = {"capital": capital, "export": rng.choice(EXPORTS)}
    return islands


CORPUS = build()


def entry(name: str) -> str | None:
    """The corpus text about ``name`` (any case), or None."""
    for island, facts in CORPUS.items():
        if island.lower() == name.strip().lower():
            return f"{island} is an island. Its capital is {facts['capital']}. Its main export is {facts['export']}."
    return None
