"""Rewrite the golden byte fixtures in this folder: ONLY on purpose, after a deliberate schema change.

    .venv/bin/python tests/golden/regenerate.py          # rewrite tests/golden/*.bin
    .venv/bin/python tests/golden/regenerate.py --check  # exit 1 if any fixture differs

The fixtures pin the exact bytes on the wire: ``<record>.single.bin`` (Avro single-object encoding)
and ``<record>.confluent.bin`` (Confluent wire format, schema ids from ``GOLDEN_SCHEMA_IDS``), each
the encoding of ``tests/unit/schemas/record_examples.py``'s example. Data already in Kafka topics was
written this way, so a test failing against them means the change would break reading old data or
other consumers: regenerate only when that is intended (a new schema version), and say so in the commit.

When a record gets a new schema version, move its fixtures into ``v<N>/`` (N = the version they were
written with) BEFORE regenerating: those bytes stand for the data already in topics, are never
rewritten, and must keep decoding into today's shape (``OLDER_VERSIONS`` in record_examples.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent
_ROOT = GOLDEN_DIR.parents[1]
if __name__ == "__main__" and str(_ROOT) not in sys.path:  # run as a script: make `tests.` importable
    sys.path.insert(0, str(_ROOT))

from boltstream.schemas import Codec, InMemorySchemaRegistry  # noqa: E402
from boltstream.schemas.loader import default_catalog, snake_case  # noqa: E402
from tests.unit.schemas.record_examples import EXAMPLES  # noqa: E402

logger = logging.getLogger(__name__)

#: Fixed Confluent schema ids of the golden fixtures (registered in this order, from 101).
GOLDEN_SCHEMA_IDS: dict[str, int] = {
    "Task": 101,
    "Span": 102,
    "Trajectory": 103,
    "Sample": 104,
    "TrainingBatch": 105,
    "CheckpointEvent": 106,
    "DeadLetter": 107,
    "ReplayDone": 108,
}

TOPICS: dict[str, str] = {
    "Task": "boltstream.tasks",
    "Span": "boltstream.spans",
    "Trajectory": "boltstream.trajectories",
    "Sample": "boltstream.samples",
    "TrainingBatch": "boltstream.batches",
    "CheckpointEvent": "boltstream.checkpoints",
    "DeadLetter": "boltstream.dlq",
    "ReplayDone": "exp1.replay",
}


def golden_registry(version: int | None = None) -> InMemorySchemaRegistry:
    """An in-memory registry holding the newest schema of every record (or schema ``version`` of
    each, or its newest one older than that: the registry the ``v<version>/`` fixtures were written
    against) under its golden id."""
    first = min(GOLDEN_SCHEMA_IDS.values())
    registry = InMemorySchemaRegistry(first_id=first)
    catalog = default_catalog()
    for record, schema_id in sorted(GOLDEN_SCHEMA_IDS.items(), key=lambda kv: kv[1]):
        # A record whose newest version is older than ``version`` was written with that newest one.
        known = [sv.version for sv in catalog.versions(record)]
        at = None if version is None else max(v for v in known if v <= version)
        got = registry.register(f"{TOPICS[record]}-value", catalog.get(record, at).schema_json)
        assert got == schema_id, (record, got, schema_id)
    return registry


def golden_path(record: str, framing: str, version: int | None = None) -> Path:
    """``tests/golden/<snake_name>.<single|confluent>.bin`` (today's schema), or the frozen fixture
    ``tests/golden/v<version>/<snake_name>.<framing>.bin`` written with an older schema version."""
    folder = GOLDEN_DIR if version is None else GOLDEN_DIR / f"v{version}"
    return folder / f"{snake_case(record)}.{framing}.bin"


def golden_bytes() -> dict[Path, bytes]:
    """What the fixtures must contain, computed with today's codec and schemas."""
    single = Codec()
    confluent = Codec(registry=golden_registry())
    out: dict[Path, bytes] = {}
    for record, example in EXAMPLES.items():
        out[golden_path(record, "single")] = single.encode(record, example, topic=TOPICS[record])
        out[golden_path(record, "confluent")] = confluent.encode(record, example, topic=TOPICS[record])
    return out


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) every fixture; returns the process exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a fixture differs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    differ = 0
    for path, data in golden_bytes().items():
        old = path.read_bytes() if path.exists() else None
        if old == data:
            continue
        differ += 1
        if args.check:
            logger.error("%s differs from today's encoding", path.relative_to(_ROOT))
        else:
            path.write_bytes(data)
            logger.info("wrote %s (%d bytes)", path.relative_to(_ROOT), len(data))
    if not differ:
        logger.info("all golden fixtures are up to date")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
