"""``boltstream tasks publish data.jsonl|data.parquet``: put a task dataset on the tasks topic.

Why validation happens here, before the broker: a runner that meets a bad
task can only dead-letter it, far from the person who wrote the file. So every
line is checked up front and every problem is reported with its line number
(Parquet: its 1-based row number), all of them, not just the first.

Policy (decided, documented in docs/producers.md): by default the good lines
are published and the command exits 1 at the end if any line was bad, with
the count; ``--strict`` publishes nothing when any line is bad; ``--dry-run``
only validates. A task needs an id: the ``--id-field`` value (string or
integer); when the field is absent the id is the first 16 hex chars of the
SHA-256 of the canonical JSON of the task, so re-publishing the same file
gives the same ids. Duplicate ids within one file are errors (the second and
later occurrences). Records are keyed by task id.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boltstream.config import Settings, flags_from_dataclass, load

log = logging.getLogger(__name__)
MAX_ID_LEN = 1024
# Bytes of a Task record besides its payload: the id (at most MAX_ID_LEN), the split, group size and
# timestamp, Avro and Kafka framing. A payload must leave this much of the broker's message size free.
TASK_RECORD_OVERHEAD = MAX_ID_LEN + 512


@dataclass(frozen=True)
class TaskLine:
    """One validated task: what becomes a ``Task`` record."""

    line: int
    task_id: str
    payload_json: str


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line/row number, parsed value or an Exception) for a JSONL or Parquet file."""
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - pyarrow is a dev dependency
            raise SystemExit(f"reading Parquet needs pyarrow: {exc}") from exc
        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for i, text in enumerate(fh, start=1):
            if not text.strip():
                continue  # blank lines are allowed (trailing newline, spacing)
            try:
                yield i, json.loads(text)
            except ValueError as exc:
                yield i, ValueError(f"invalid JSON: {exc}")


def validate(rows: Iterator[tuple[int, Any]], id_field: str = "id",
             max_bytes: int | None = None) -> tuple[list[TaskLine], list[BadLine]]:
    """Split rows into good tasks and bad lines (with reasons). Pure; no I/O."""
    good: list[TaskLine] = []
    bad: list[BadLine] = []
    seen: dict[str, int] = {}
    for line, value in rows:
        if isinstance(value, Exception):
            bad.append(BadLine(line, str(value)))
            continue
        if not isinstance(value, dict):
            bad.append(BadLine(line, f"a task must be a JSON object, got {type(value).__name__}"))
            continue
        try:
            payload = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str,
                                 allow_nan=False)
        except ValueError as exc:
            bad.append(BadLine(line, f"not representable as JSON: {exc}"))
            continue
        raw_id = value.get(id_field)
        if raw_id is None:
            task_id = hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
        elif isinstance(raw_id, bool) or not isinstance(raw_id, str | int):
            bad.append(BadLine(line, f"{id_field!r} must be a string or an integer, got {type(raw_id).__name__}"))
            continue
        else:
            task_id = str(raw_id).strip()
            if not task_id:
                bad.append(BadLine(line, f"{id_field!r} is empty"))
                continue
            if len(task_id) > MAX_ID_LEN:
                bad.append(BadLine(line, f"{id_field!r} is longer than {MAX_ID_LEN} characters"))
                continue
        if task_id in seen:
            bad.append(BadLine(line, f"duplicate task id {task_id!r} (first on line {seen[task_id]})"))
            continue
        if max_bytes is not None and len(payload.encode("utf-8")) > max_bytes:
            bad.append(BadLine(line, f"task is larger than the broker's message size ({max_bytes} bytes)"))
            continue
        seen[task_id] = line
        good.append(TaskLine(line, task_id, payload))
    return good, bad


async def publish(settings: Settings, tasks: list[TaskLine], *, split: str | None = None,
                  group_size: int | None = None) -> int:
    """Produce Task records keyed by task id and wait for every ack; returns how many were acked."""
    from aiokafka import AIOKafkaProducer

    from boltstream.broker.kafka import producer_kwargs
    from boltstream.schemas import Codec

    codec = Codec.from_registry_url(settings.schema_registry_url)
    topic = settings.topic("tasks")
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    try:
        now = time.time_ns()
        futures = []
        for t in tasks:
            value = codec.encode("Task", {"task_id": t.task_id, "payload_json": t.payload_json, "split": split,
                                          "group_size": group_size, "created_ns": now}, topic=topic)
            futures.append(await producer.send(topic, value, key=t.task_id.encode("utf-8")))
        await asyncio.gather(*futures)
        return len(futures)
    finally:
        await producer.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream tasks", description="Publish a task dataset to the tasks topic.")
    sub = p.add_subparsers(dest="action", required=True)
    pub = sub.add_parser("publish", help="validate a JSONL/Parquet file and publish one Task per line")
    pub.add_argument("path", type=Path, help="data.jsonl or data.parquet (one task object per line/row)")
    pub.add_argument("--split", default=None, help="label stored with every task (train, test, ...)")
    pub.add_argument("--id-field", default="id", help="field holding the task id (default: id)")
    pub.add_argument("--group-size", type=int, default=None, help="attempts per task (default: the runner's)")
    pub.add_argument("--strict", action="store_true", help="publish nothing if any line is bad")
    pub.add_argument("--dry-run", action="store_true", help="validate only")
    flags_from_dataclass(pub, Settings, only=("bootstrap_servers", "namespace"))
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if not args.path.is_file():
        sys.stderr.write(f"boltstream tasks: no such file: {args.path}\n")
        return 2
    if args.group_size is not None and args.group_size < 1:
        sys.stderr.write("boltstream tasks: --group-size must be >= 1\n")
        return 2
    settings = load(Settings, {"bootstrap_servers": args.bootstrap_servers, "namespace": args.namespace})
    good, bad = validate(read_rows(args.path), args.id_field,
                         max_bytes=settings.max_message_bytes - TASK_RECORD_OVERHEAD)
    for b in bad:
        sys.stderr.write(f"{args.path}:{b.line}: {b.reason}\n")
    if args.dry_run or (args.strict and bad):
        verdict = "not published (--strict)" if not args.dry_run else "dry run"
        sys.stdout.write(f"{len(good)} valid, {len(bad)} bad; {verdict}\n")
        return 1 if bad else 0
    acked = asyncio.run(publish(settings, good, split=args.split, group_size=args.group_size)) if good else 0
    sys.stdout.write(f"published {acked} tasks to {settings.topic('tasks')}; {len(bad)} bad lines skipped\n")
    if bad:
        sys.stderr.write(f"boltstream tasks: {len(bad)} bad line(s) in {args.path}\n")
        return 1
    return 0
