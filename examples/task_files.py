"""The command every example's ``tasks`` module runs as: its seeded train/test split written as JSONL."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

Split = Callable[..., tuple[list[dict[str, Any]], list[dict[str, Any]]]]


def write_splits(name: str, train_test: Split, argv: Sequence[str] | None = None) -> int:
    """``python -m boltstream.examples.<name>.tasks [--train F] [--test F] [--seed N]``."""
    p = argparse.ArgumentParser(description=f"write the {name} agent's tasks as JSONL")
    p.add_argument("--train", default=f"{name}_train.jsonl")
    p.add_argument("--test", default=f"{name}_test.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for path, tasks in zip((args.train, args.test), train_test(seed=args.seed), strict=True):
        with open(path, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in tasks)
    return 0
