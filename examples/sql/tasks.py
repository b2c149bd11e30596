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
}

_FILLERS = {
    "city": db.CITIES,
    "product": [p for names in db.PRODUCTS.values() for p in names],
    "category": list(db.PRODUCTS),
    "customer": db.FIRST_NAMES,
}


def all_questions(seed: int = 0) -> list[dict]:
    """Every (template, filler) question with its answer on the database of ``seed``."""
    out = []
    for kind, (question, sql, filler) in TEMPLATES.items():
        for x in _FILLERS[filler]:
            rows = db.query(sql.format(x=x), seed)
            out.append({"question": question.format(x=x), "answer": str(rows[0][0]), "kind": kind,
                        "sql": sql.format(x=x)})
    return out


def train_test(n_train: int = 64, n_test: int = 16, seed: int = 0, db_seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint splits, shuffled by ``seed``; test is drawn first so it is stable as n_train grows.

    Each task is ``{"task_id", "id", "question", "answer", "kind", "db_seed"}``
    (``id`` too, because ``boltstream tasks publish`` keys tasks by it).
    """
    pool = all_questions(db_seed)
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
    p.add_argument("--easy-first", action="store_true",
                   help="order the training tasks single-table questions first, joins last (a curriculum: "
                        "the runner takes tasks in file order)")
    args = p.parse_args(argv)
    train, test = train_test(args.n_train, args.n_test, args.seed)
    if args.easy_first:
        train = easy_first(train)
    for path, rows in ((args.train, train), (args.test, test)):
        with open(path, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in rows)
        sys.stdout.write(f"wrote {len(rows)} tasks to {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
