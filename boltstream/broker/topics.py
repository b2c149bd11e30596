"""Topic admin: create, list and describe boltstream's topics (``boltstream topics ...``).

Topics are created explicitly rather than relying on broker auto-creation so
that partition counts, compaction for ``checkpoints`` and unlimited retention
for ``spans`` (the replayable source of truth) are what the design says,
on Tansu, Redpanda and Kafka alike. Creation is idempotent: a topic that
already exists is left as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    InvalidConfigurationError,
    PolicyViolationError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    UnsupportedVersionError,
    for_code,
)

from boltstream import config
from boltstream.broker.kafka import admin_kwargs, consumer_kwargs, log_end_offsets, wait_for_broker
from boltstream.config import Settings
from boltstream.errors import BoltstreamError

log = logging.getLogger(__name__)

# Topics that are the replayable record (spans) or forensics (dlq): their retention is
# explicit and configurable; checkpoints keeps the latest event per model.
RETAINED_TOPICS = ("spans", "dlq")
TOPIC_CONFIGS: Mapping[str, Mapping[str, str]] = {"checkpoints": {"cleanup.policy": "compact"}}
_CONFIG_REJECTED = {
    InvalidConfigurationError.errno,
    PolicyViolationError.errno,
    UnsupportedVersionError.errno,
}


class TopicError(BoltstreamError):
    """The broker refused to create or describe a topic."""


def topic_names(settings: Settings, names: Iterable[str] | None = None) -> dict[str, str]:
    """Short name -> full topic name (namespace prefixed) for ``names`` (default: all of config.TOPICS)."""
    return {short: settings.topic(short) for short in (names if names is not None else config.TOPICS)}


def topic_configs(settings: Settings, short: str) -> dict[str, str]:
    """Creation configs of one topic; spans/dlq retention comes from Settings so a week of traffic can be sized."""
    configs = dict(TOPIC_CONFIGS.get(short, {}))
    if short in RETAINED_TOPICS:
        configs["retention.ms"] = str(settings.log_retention_ms)
        configs["retention.bytes"] = str(settings.log_retention_bytes)
    return configs


def _new_topic(settings: Settings, short: str, full: str, with_configs: bool) -> NewTopic:
    configs = topic_configs(settings, short) if with_configs else {}
    return NewTopic(full, settings.partitions, settings.replication_factor, topic_configs=configs)


async def ensure_topics(
    settings: Settings, names: Iterable[str] | None = None, timeout: float = 30.0
) -> dict[str, bool]:
    """Create the namespaced topics that do not exist yet; returns full name -> created now.

    If the broker rejects a topic's configs (some managed Kafkas forbid
    ``retention.ms=-1``), the topic is created without them and a warning
    logged: a topic with default retention beats no topic. Returns only after
    the broker's metadata lists every topic with its partitions, so a
    producer started right after never sees UnknownTopicOrPartition.
    """
    wanted = topic_names(settings, names)
    created: dict[str, bool] = {}
    admin = AIOKafkaAdminClient(**admin_kwargs(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        todo = {short: full for short, full in wanted.items() if full not in existing}
        created = {full: False for full in wanted.values()}
        if todo:
            resp = await admin.create_topics(
                [_new_topic(settings, s, f, with_configs=True) for s, f in todo.items()]
            )
            retry: dict[str, str] = {}
            for name, code, message in _topic_errors(resp):
                short = next(s for s, f in todo.items() if f == name)
                if code == 0:
                    created[name] = True
                elif code == TopicAlreadyExistsError.errno:
                    pass
                elif code in _CONFIG_REJECTED and short in TOPIC_CONFIGS:
                    log.warning(
                        "broker rejected configs %s for %s (%s); creating it with broker defaults",
                        dict(TOPIC_CONFIGS[short]),
                        name,
                        message or for_code(code).message,
                    )
                    retry[short] = name
                else:
                    raise TopicError(f"cannot create topic {name}: {for_code(code).message} {message or ''}")
            if retry:
                resp = await admin.create_topics(
                    [_new_topic(settings, s, f, with_configs=False) for s, f in retry.items()]
                )
                for name, code, message in _topic_errors(resp):
                    if code == 0:
                        created[name] = True
                    elif code != TopicAlreadyExistsError.errno:
                        raise TopicError(
                            f"cannot create topic {name}: {for_code(code).message} {message or ''}"
                        )
        await _wait_for_metadata(admin, list(wanted.values()), timeout)
    finally:
        await admin.close()
    for name, was_created in created.items():
        if was_created:
            log.info("created topic %s (%d partitions)", name, settings.partitions)
    return created


def _topic_errors(resp: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for entry in resp.topic_errors:
        name, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else None
        out.append((name, code, message))
    return out


async def _wait_for_metadata(admin: AIOKafkaAdminClient, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        described = await admin.describe_topics(names)
        ready = {t["topic"] for t in described if t["error_code"] == 0 and t["partitions"]}
        missing = sorted(set(names) - ready)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TopicError(f"topics not visible in broker metadata after {timeout:.0f}s: {missing}")
        await asyncio.sleep(0.05)


async def held_records(settings: Settings, topics: Iterable[str]) -> dict[str, int]:
    """Full topic name -> records it holds (log end - log start, all partitions), for those that exist.

    Existence comes from a listing of every topic, never from a metadata request naming the
    topic, which makes a broker with auto-creation (Tansu) create it.
    """
    admin = AIOKafkaAdminClient(**admin_kwargs(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        present = [t for t in topics if t in existing]
        described = await admin.describe_topics(present) if present else []
    finally:
        await admin.close()
    tps = [TopicPartition(t["topic"], p["partition"]) for t in described for p in t["partitions"]]
    held = dict.fromkeys(present, 0)
    if not tps:
        return held
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None))
    await consumer.start()
    try:
        first = await consumer.beginning_offsets(tps)
    finally:
        await consumer.stop()
    for tp, end in (await log_end_offsets(settings, tps)).items():
        held[tp.topic] += max(0, end - first[tp])
    return held


async def recreate_topics(settings: Settings, names: Iterable[str], timeout: float = 30.0) -> None:
    """Delete the namespaced topics ``names`` and create them again, empty (``boltstream replay --overwrite``).

    Why a loop: deletion is asynchronous on Kafka (a create fails until it is done), and Tansu
    re-creates a deleted topic, with the broker's defaults, on the next metadata request that
    names it (any client still polling it). So: delete what exists, create; accept the result
    only once every topic exists with ``settings.partitions`` partitions and holds no record,
    else delete again, up to ``timeout``. A topic the broker re-created before us keeps the
    broker's configs (logged).
    """
    wanted = topic_names(settings, names)
    deadline = time.monotonic() + timeout
    while True:
        admin = AIOKafkaAdminClient(**admin_kwargs(settings))
        await admin.start()
        try:
            present = sorted(set(await admin.list_topics()) & set(wanted.values()))
            if present:
                resp = await admin.delete_topics(present)
                for name, code, *_ in resp.topic_error_codes:
                    if code not in (0, UnknownTopicOrPartitionError.errno):
                        raise TopicError(f"cannot delete topic {name}: {for_code(code).message}")
        finally:
            await admin.close()
        created = await ensure_topics(settings, list(wanted), timeout=max(1.0, deadline - time.monotonic()))
        held = await held_records(settings, wanted.values())
        partitions = {t["topic"]: t["partitions"] for t in await describe_topics(settings, wanted.values())}
        stale = {name: f"{held.get(name, 0)} records, {partitions.get(name, 0)} partitions"
                 for name in wanted.values() if held.get(name, 0) or partitions.get(name) != settings.partitions}
        if not stale:
            for name in (n for n, fresh in created.items() if not fresh and n in present):
                log.warning("topic %s was re-created by the broker before us (auto-creation): it is empty, with "
                            "the broker's default configs", name)
            return
        if time.monotonic() > deadline:
            raise TopicError(f"could not recreate {sorted(stale)} empty within {timeout:.0f}s: {stale}")
        log.info("recreated topics not empty yet (%s); deleting again", stale)
        await asyncio.sleep(0.2)


async def list_topics(settings: Settings, all_topics: bool = False) -> list[str]:
    """Sorted topic names in ``settings.namespace`` (every topic with ``all_topics``)."""
    admin = AIOKafkaAdminClient(**admin_kwargs(settings))
    await admin.start()
    try:
        names = await admin.list_topics()
    finally:
        await admin.close()
    return sorted(n for n in names if all_topics or n.startswith(settings.namespace))


async def describe_topics(settings: Settings, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Partitions, leaders and explicitly set configs of the namespace's topics (or ``names``, full).

    Configs come from DescribeConfigs; a broker that does not implement it
    yields ``configs: {}`` rather than an error, since describe is for humans.
    """
    admin = AIOKafkaAdminClient(**admin_kwargs(settings))
    await admin.start()
    try:
        if names is None:
            names = sorted(n for n in await admin.list_topics() if n.startswith(settings.namespace))
        names = list(names)
        if not names:
            return []
        metadata = await admin.describe_topics(names)
        configs: dict[str, dict[str, str]] = {n: {} for n in names}
        try:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, n) for n in names]
            )
            for resp in responses:
                for res in resp.resources:
                    if res[0] == 0:
                        configs[res[3]] = {e[0]: e[1] for e in res[4] if e[1] is not None}
        except Exception as exc:  # describe is for humans: configs are best-effort
            log.warning("broker did not describe topic configs: %s", exc)
    finally:
        await admin.close()
    out = []
    for t in sorted(metadata, key=lambda t: t["topic"]):
        parts = sorted(t["partitions"], key=lambda p: p["partition"])
        out.append(
            {
                "topic": t["topic"],
                "error": None if t["error_code"] == 0 else for_code(t["error_code"]).message,
                "partitions": len(parts),
                "leaders": {p["partition"]: p["leader"] for p in parts},
                "replicas": max((len(p["replicas"]) for p in parts), default=0),
                "configs": configs.get(t["topic"], {}),
            }
        )
    return out


# ---------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream topics", description="Create, list or describe the topics.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--bootstrap-servers", help="host:port[,host:port] (env BOLTSTREAM_BOOTSTRAP_SERVERS)"
    )
    common.add_argument("--namespace", help="topic name prefix (env BOLTSTREAM_NAMESPACE)")
    common.add_argument("--state-file", help="embedded stack state file (env BOLTSTREAM_STATE_FILE)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the broker")
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", parents=[common], help="create missing topics (idempotent)")
    c.add_argument("--partitions", type=int, help="partitions per topic (env BOLTSTREAM_PARTITIONS)")
    c.add_argument("names", nargs="*", help=f"short names (default: all of {', '.join(config.TOPICS)})")
    ls = sub.add_parser("list", parents=[common], help="list the namespace's topics")
    ls.add_argument("--all", action="store_true", help="every topic on the broker")
    d = sub.add_parser("describe", parents=[common], help="partitions, leaders and configs")
    d.add_argument("names", nargs="*", help="short names (default: every topic in the namespace)")
    return p


def main(argv: list[str]) -> int:
    """``boltstream topics create|list|describe``."""
    args = parser().parse_args(argv)
    explicit = {
        "bootstrap_servers": args.bootstrap_servers,
        "namespace": args.namespace,
        "state_file": args.state_file,
        "partitions": getattr(args, "partitions", None),
    }
    settings = config.load(Settings, explicit=explicit)
    # A clear "broker not reachable" error instead of an aiokafka traceback.
    asyncio.run(wait_for_broker(settings, timeout=args.timeout))
    if args.action == "create":
        unknown = [n for n in args.names if n not in config.TOPICS]
        if unknown:
            raise TopicError(f"unknown topic short name(s) {unknown}; known: {', '.join(config.TOPICS)}")
        created = asyncio.run(ensure_topics(settings, args.names or None))
        if args.json:
            sys.stdout.write(json.dumps({"created": created}) + "\n")
        else:
            for name, was_created in created.items():
                sys.stdout.write(f"{name}: {'created' if was_created else 'exists'}\n")
        return 0
    if args.action == "list":
        names = asyncio.run(list_topics(settings, all_topics=args.all))
        sys.stdout.write(
            (json.dumps(names) if args.json else "\n".join(names)) + ("\n" if names or args.json else "")
        )
        return 0
    full = [settings.topic(n) for n in args.names] or None
    described = asyncio.run(describe_topics(settings, full))
    if args.json:
        sys.stdout.write(json.dumps(described) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"topics in {settings.namespace!r} at {settings.bootstrap_servers}")
    for col in ("topic", "partitions", "replicas", "configs", "error"):
        table.add_column(col, overflow="fold")
    for t in described:
        cfg = ", ".join(f"{k}={v}" for k, v in sorted(t["configs"].items()))
        table.add_row(t["topic"], str(t["partitions"]), str(t["replicas"]), cfg, t["error"] or "")
    Console().print(table)
    return 0
