"""Seeded questions over the shop database, with answers computed by reference SQL.

Every question has one short answer (a number or a name) so the reward can be
an exact match. The answer is not written by hand: it is what the reference
query returns on the seeded database, so questions and data never drift apart.
Train and test splits never share a question.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from . import db

# kind -> (question template, reference SQL template, what fills {x})
TEMPLATES: dict[str, tuple[str, str, str]] = {
    "city_count": ("How many customers live in {x}?",
                   "SELECT COUNT(*) FROM customers WHERE city = '{x}'", "city"),
    "price": ("What is the price of the {x}?",
              "SELECT price FROM products WHERE name = '{x}'", "product"),
    "category_count": ("How many products are in the {x} category?",
                       "SELECT COUNT(*) FROM products WHERE category = '{x}'", "category"),
    "customer_city": ("In which city does {x} live?",
                      "SELECT city FROM customers WHERE name = '{x}'", "customer"),
    "customer_orders": ("How many orders did {x} place?",
                        "SELECT COUNT(*) FROM orders JOIN customers ON customers.id = orders.customer_id "
                        "WHERE customers.name = '{x}'", "customer"),
    "product_quantity": ("How many units of the {x} were ordered in total?",
                         "SELECT COALESCE(SUM(quantity), 0) FROM orders JOIN products "
                         "ON products.id = orders.product_id WHERE products.name = '{x}'", "product"),
    "price_below": ("How many products cost less than {x}?",
                    "SELECT COUNT(*) FROM products WHERE price < {x}", "price"),
    "price_above": ("How many products cost more than {x}?",
                    "SELECT COUNT(*) FROM products WHERE price > {x}", "price"),
    "quantity_count": ("How many orders have a quantity of {x}?",
                       "SELECT COUNT(*) FROM orders WHERE quantity = {x}", "quantity"),
}

_FILLERS = {
    "city": db.CITIES,
    "product": [p for names in db.PRODUCTS.values() for p in names],
    "category": list(db.PRODUCTS),
    "customer": db.FIRST_NAMES,
    "price": list(range(4, 61, 4)),  # never 50: the writer's worked example is "more than 50"
    "quantity": list(range(1, 6)),
}

# Named sets of kinds (``--kinds``). ``mixed`` (the default; runs a-f of examples/sql/README.md):
# lookups by name, two counts and two joins, which the untrained 135M model gets ~6 % of at
# T = 0.7: too rare a success for a group of 8 to learn from. ``counts``: one table, one filter,
# a COUNT(*), the shape of the writer's worked example: ~22 % at T = 0.7 and ~50 % greedily, so
# most groups have spread and sharpening alone pays.
KIND_SETS: dict[str, tuple[str, ...]] = {
    "mixed": ("city_count", "price", "category_count", "customer_city", "customer_orders", "product_quantity"),
    "counts": ("price_below", "price_above", "quantity_count", "city_count", "category_count"),
}
KIND_SETS["all"] = tuple(TEMPLATES)


def kinds_named(spec: str) -> tuple[str, ...]:
    """Set names (``mixed``, ``counts``, ``all``) and template names, comma-separated, in order, each once.

    Unknown names are a ValueError naming them (the CLI's error message).
    """
    out: list[str] = []
    for name in (part.strip() for part in spec.split(",") if part.strip()):
        if name not in KIND_SETS and name not in TEMPLATES:
            raise ValueError(f"unknown question kind {name!r}: one of {', '.join([*KIND_SETS, *TEMPLATES])}")
        out.extend(k for k in KIND_SETS.get(name, (name,)) if k not in out)
    if not out:
        raise ValueError("no question kinds named")
    return tuple(out)


def all_questions(seed: int = 0, kinds: tuple[str, ...] | None = None) -> list[dict]:
    """Every (template, filler) question of ``kinds`` (default ``mixed``) with its answer on the database of ``seed``."""
    out = []
    for kind in kinds or KIND_SETS["mixed"]:
        question, sql, filler = TEMPLATES[kind]
        for x in _FILLERS[filler]:
            rows = db.query(sql.format(x=x), seed)
            out.append({"question": question.format(x=x), "answer": str(rows[0][0]), "kind": kind,
                        "sql": sql.format(x=x)})
    return out


def train_test(n_train: int = 64, n_test: int = 16, seed: int = 0, db_seed: int = 0,
               kinds: tuple[str, ...] | None = None) -> tuple[list[dict], list[dict]]:
    """Disjoint splits, shuffled by ``seed``; test is drawn first so it is stable as n_train grows.

    Each task is ``{"task_id", "id", "question", "answer", "kind", "db_seed"}``
    (``id`` too, because ``boltstream tasks publish`` keys tasks by it).
    """
    pool = all_questions(db_seed, kinds)
    if n_train + n_test > len(pool):
        raise ValueError(f"only {len(pool)} distinct questions; asked for {n_train} + {n_test}")
    random.Random(seed).shuffle(pool)
    test, train = pool[:n_test], pool[n_test:n_test + n_train]

    def tasks(rows: list[dict], split: str) -> list[dict]:
        return [{"task_id": f"sql-{split}-{i:04d}", "id": f"sql-{split}-{i:04d}", "question": r["question"],
                 "answer": r["answer"], "kind": r["kind"], "db_seed": db_seed} for i, r in enumerate(rows)]

    return tasks(train, "train"), tasks(test, "test")


JOIN_KINDS = ("customer_orders", "product_quantity")


def easy_first(tasks: list[dict]) -> list[dict]:
    """Single-table questions before the ones that need a join; the order within each kept (stable)."""
    return sorted(tasks, key=lambda t: t["kind"] in JOIN_KINDS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write SQL agent tasks as JSONL")
    p.add_argument("--train", default="sql_train.jsonl")
    p.add_argument("--test", default="sql_test.jsonl")
    p.add_argument("--n-train", type=int, default=64)
    p.add_argument("--n-test", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="mixed",
                   help="comma-separated sets ('mixed': lookups, counts, joins; 'counts': single-table COUNT "
                        f"questions; 'all') or templates ({', '.join(TEMPLATES)})")
    p.add_argument("--easy-first", action="store_true",
                   help="order the training tasks single-table questions first, joins last (a curriculum: "
                        "the runner takes tasks in file order)")
    args = p.parse_args(argv)
    try:
        train, test = train_test(args.n_train, args.n_test, args.seed, kinds=kinds_named(args.kinds))
    except ValueError as exc:
        p.error(str(exc))
    if args.easy_first:
        train = easy_first(train)
    for path, rows in ((args.train, train), (args.test, test)):
        with open(path, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in rows)
        sys.stdout.write(f"wrote {len(rows)} tasks to {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
