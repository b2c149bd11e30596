"""A small shop database (customers, products, orders), generated in code from a seed.

Why generated: the example must run anywhere with nothing to download, and the
same seed must give the same rows so questions and their answers stay valid.
The rows are built once per (seed, process) and kept as SQLite's serialised
image; every :func:`connect` opens a fresh, read-only in-memory copy, so agent
threads never share a connection and a model's ``DROP TABLE`` cannot hurt the
next rollout.
"""

from __future__ import annotations

import functools
import random
import sqlite3

SCHEMA = """\
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL);
"""

# What the model is shown: one line per table, short enough for a small context.
SCHEMA_PROMPT = (
    "customers(id, name, city)\n"
    "products(id, name, category, price)\n"
    "orders(id, customer_id, product_id, quantity)"
)

FIRST_NAMES = ["Alice", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas",
               "Kofi", "Lena", "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
CITIES = ["Lisbon", "Oslo", "Lyon", "Porto", "Turin"]
PRODUCTS = {
    "fruit": ["apple", "banana", "cherry", "mango", "pear"],
    "tools": ["hammer", "saw", "drill", "wrench"],
    "books": ["atlas", "novel", "cookbook", "diary"],
    "toys": ["kite", "puzzle", "yoyo"],
}

# Bound on SQLite virtual-machine steps per query (checked every 1000 steps): a
# model's accidental cross join ends as an error instead of a hung rollout.
MAX_VM_STEPS = 2_000_000


def build(seed: int = 0, n_orders: int = 60) -> sqlite3.Connection:
    """A new in-memory database filled deterministically from ``seed``."""
    rng = random.Random(seed)
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.executescript(SCHEMA)
    customers = [(i + 1, name, rng.choice(CITIES)) for i, name in enumerate(FIRST_NAMES)]
    products = []
    for category, names in PRODUCTS.items():
        for name in names:
            products.append((len(products) + 1, name, category, rng.randint(2, 60)))
    orders = [(i + 1, rng.randint(1, len(customers)), rng.randint(1, len(products)), rng.randint(1, 5))
              for i in range(n_orders)]
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
    conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", products)
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", orders)
    conn.commit()
    return conn


@functools.lru_cache(maxsize=8)
def _image(seed: int) -> bytes:
    conn = build(seed)
    try:
        return conn.serialize()
    finally:
        conn.close()


def connect(seed: int = 0) -> sqlite3.Connection:
    """A private, read-only copy of the seeded database (cheap: a memcpy of its image)."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.deserialize(_image(seed))
    conn.execute("PRAGMA query_only = ON")
    steps = {"n": 0}

    def budget() -> int:
        steps["n"] += 1000
        return 1 if steps["n"] > MAX_VM_STEPS else 0  # non-zero aborts the query

    conn.set_progress_handler(budget, 1000)
    return conn


def query(sql: str, seed: int = 0, max_rows: int = 10) -> list[tuple]:
    """Run one statement on a fresh copy; raises ``sqlite3.Error`` for anything SQLite rejects."""
    conn = connect(seed)
    try:
        return conn.execute(sql).fetchmany(max_rows)
    finally:
        conn.close()
