"""``boltstream status``: where a running pipeline stands, in one command (``--json`` for scripts).

What it reads, and from where:

* topics of the namespace with their log ends (:func:`boltstream.broker.kafka.log_end_offsets`,
  correct on the embedded broker too);
* consumer groups (``list_consumer_groups``) and, per group, the committed offset of
  every partition of the namespace's topics, through a consumer of that group that
  joins nothing (``committed()``): the admin client's ``list_consumer_group_offsets``
  is not used because the embedded broker (Tansu) answers it in a form aiokafka
  0.14 cannot decode (and Tansu answers 0, not "none", for a partition never
  committed). A topic is the group's when it committed on any of its partitions;
  lag = log end - committed, summed over all of the topic's partitions. What the broker does not answer is reported
  as ``"unknown"`` with the error, never a crash;
* the learner's last published step and version per model: the newest
  ``CheckpointEvent`` of each model on the checkpoints topic;
* each inference worker's served version and health: ``GET /health`` of every
  ``--worker URL``, plus the workers a ``boltstream train`` run recorded in its
  ``endpoints.json`` (``--run DIR``);
* live numbers from any component's Prometheus endpoint (``--metrics URL``): the
  learner's step, the spool depths (runner exporter, inference capture).

Settings come like every command's: flags > ``BOLTSTREAM_*`` > the embedded stack's
state file > defaults, so it works against the embedded stack and any broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from boltstream import config
from boltstream.config import Settings
from boltstream.errors import BoltstreamError

log = logging.getLogger(__name__)

UNKNOWN = "unknown"
ENDPOINTS_FILE = "endpoints.json"  # written by `boltstream train` into its run directory
# Prometheus series status reports, by what they stand for.
METRIC_SERIES = {
    "learner_step": "boltstream_learner_step",
    "learner_version": "boltstream_learner_policy_version",
    "runner_spool_pending": "boltstream_exporter_spool_pending",
    "runner_spool_bytes": "boltstream_exporter_spool_size_bytes",
    "worker_spool_pending": "boltstream_inference_spool_pending",
    "stream_rollouts_open": "boltstream_stream_rollouts_open",
}
# The learner's step paths: 1 taken, 0 fallen back to a slower path, with the reason as a label.
STEP_MODE_SERIES = "boltstream_learner_step_mode"
HTTP_TIMEOUT = 5.0


# ------------------------------------------------------------------ pure parts


def group_lag(ends: Mapping[tuple[str, int], int], committed: Mapping[tuple[str, int], int | None]
              ) -> dict[str, dict[str, Any]]:
    """Per topic the group consumes: committed offset, log end and lag of every partition, and their sum.

    A group consumes a topic when it committed an offset (> 0) on any of its partitions; its
    other partitions of that topic count from 0 (nothing committed: read from the start).
    Other topics are not the group's.
    """
    topics = {t for (t, _), offset in committed.items() if offset}
    out: dict[str, dict[str, Any]] = {}
    for (topic, partition), end in sorted(ends.items()):
        if topic not in topics:
            continue
        offset = committed.get((topic, partition)) or 0
        entry = out.setdefault(topic, {"lag": 0, "partitions": {}})
        lag = max(0, end - offset)
        entry["partitions"][str(partition)] = {"committed": offset, "end": end, "lag": lag}
        entry["lag"] += lag
    return out


def latest_checkpoints(events: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest event (highest version) per model: its version, learner step, time and location."""
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        model = str(e["model"])
        if model not in out or int(e["version"]) >= out[model]["version"]:
            out[model] = {"version": int(e["version"]), "learner_step": int(e.get("learner_step") or 0),
                          "created_ns": e.get("created_ns"), "uri": e.get("uri"), "kind": e.get("kind"),
                          "offsets": {(str(o["topic"]), int(o["partition"])): int(o["offset"])
                                      for o in e.get("offsets") or []}}
    return out


def learner_lag(offsets: Mapping[tuple[str, int], int], ends: Mapping[tuple[str, int], int]) -> int | None:
    """Records of the batches topic past a checkpoint's consumed offsets (the learner has no consumer group:
    its position is in its checkpoints); None when the checkpoint names no offsets."""
    known = [(tp, off) for tp, off in offsets.items() if tp in ends]
    if not known:
        return None
    return sum(max(0, ends[tp] - off) for tp, off in known)


def metric_values(text: str) -> dict[str, float]:
    """The :data:`METRIC_SERIES` found in a Prometheus text exposition (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {series: key for key, series in METRIC_SERIES.items()}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def step_fallbacks(text: str) -> dict[str, str]:
    """The learner's step paths that fell back to a slower one (path -> reason), from its exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.labels["path"]: sample.labels.get("reason", "")
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == STEP_MODE_SERIES and sample.value == 0}


def run_workers(run_dir: Path) -> list[str]:
    """Worker URLs a ``boltstream train`` run recorded (none when it recorded nothing)."""
    path = run_dir / ENDPOINTS_FILE
    if not path.is_file():
        raise BoltstreamError(f"--run {run_dir}: no {ENDPOINTS_FILE} (written by `boltstream train` when it "
                              "starts the worker)")
    try:
        data = json.loads(path.read_text())
        workers = [str(u) for u in data["workers"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BoltstreamError(f"{path}: not a run's endpoints file: {exc}") from exc
    return workers


def _check_url(url: str, option: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise BoltstreamError(f"{option} {url!r}: not an http(s) URL")
    return url.rstrip("/")


# ------------------------------------------------------------------ I/O


def _http(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as resp:
        return resp.read()  # type: ignore[no-any-return]


def worker_status(url: str) -> dict[str, Any]:
    """A worker's ``/health`` (served version, reloads, adapters) or its error, plus its spool depth."""
    base = url.removesuffix("/v1")
    try:
        health = json.loads(_http(f"{base}/health"))
    except (OSError, ValueError, urllib.error.URLError) as exc:
        return {"url": url, "healthy": False, "error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {
        "url": url, "healthy": health.get("status") == "ok", "model": health.get("model"),
        "policy_version": health.get("policy_version"), "reloads": health.get("reloads"),
        "reload_failures": health.get("reload_failures"), "last_reload_error": health.get("last_reload_error"),
        "adapters": {k: v.get("policy_version") for k, v in (health.get("adapters") or {}).items()},
    }
    try:
        out["spool_pending"] = metric_values(_http(f"{base}/metrics").decode()).get("worker_spool_pending",
                                                                                        UNKNOWN)
    except (OSError, ValueError, urllib.error.URLError):
        out["spool_pending"] = UNKNOWN
    return out


def endpoint_metrics(url: str) -> dict[str, Any]:
    """The :data:`METRIC_SERIES` an endpoint exports, and the learner's step fallbacks (when any)."""
    try:
        text = _http(url).decode()
        fallbacks = step_fallbacks(text)
        return {"url": url, **metric_values(text), **({"step_fallbacks": fallbacks} if fallbacks else {})}
    except (OSError, ValueError, urllib.error.URLError) as exc:
        return {"url": url, "error": f"{type(exc).__name__}: {exc}"}


async def _topic_ends(settings: Settings) -> dict[tuple[str, int], int]:
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    from boltstream.broker.kafka import admin_kwargs, log_end_offsets

    admin = AIOKafkaAdminClient(**admin_kwargs(settings))
    await admin.start()
    try:
        names = sorted(n for n in await admin.list_topics() if n.startswith(settings.namespace))
        described = await admin.describe_topics(names) if names else []
    finally:
        await admin.close()
    tps = [TopicPartition(t["topic"], p["partition"]) for t in described for p in t["partitions"]]
    ends = await log_end_offsets(settings, tps) if tps else {}
    return {(tp.topic, tp.partition): end for tp, end in ends.items()}


async def _groups(settings: Settings) -> list[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    from boltstream.broker.kafka import admin_kwargs

    admin = AIOKafkaAdminClient(**admin_kwargs(settings))
    await admin.start()
    try:
        groups = await admin.list_consumer_groups()
    finally:
        await admin.close()
    return sorted({str(g[0]) for g in groups})


async def _committed(settings: Settings, group: str, tps: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from boltstream.broker.kafka import consumer_kwargs

    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, group))
    await consumer.start()
    try:
        return {(t, p): await consumer.committed(TopicPartition(t, p)) for t, p in tps}
    finally:
        await consumer.stop()


async def _checkpoint_events(settings: Settings, ends: Mapping[tuple[str, int], int]) -> list[dict[str, Any]]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from boltstream.broker.kafka import consumer_kwargs
    from boltstream.schemas import Codec

    topic = settings.topic("checkpoints")
    tps = [TopicPartition(t, p) for (t, p), end in ends.items() if t == topic and end > 0]
    if not tps:
        return []
    codec = Codec.from_registry_url(settings.schema_registry_url)
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None))
    await consumer.start()
    events: list[dict[str, Any]] = []
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = asyncio.get_running_loop().time() + 20
        while any([await consumer.position(tp) < ends[(tp.topic, tp.partition)] for tp in tps]):
            if asyncio.get_running_loop().time() > deadline:
                raise BoltstreamError(f"could not read {topic} to its end within 20 s")
            for _, records in (await consumer.getmany(timeout_ms=200)).items():
                for r in records:
                    try:
                        events.append(codec.decode(r.value, topic=topic, expect="CheckpointEvent"))
                    except Exception as exc:  # one bad record must not hide the others
                        log.warning("%s@%d: not a CheckpointEvent: %s", topic, r.offset, exc)
    finally:
        await consumer.stop()
    return events


async def broker_status(settings: Settings) -> dict[str, Any]:
    """Topics with log ends, groups with lag, the newest checkpoint per model (see the module docstring)."""
    ends = await _topic_ends(settings)
    topics: dict[str, dict[str, Any]] = {}
    for (topic, partition), end in sorted(ends.items()):
        t = topics.setdefault(topic, {"records_end": 0, "partitions": {}})
        t["partitions"][str(partition)] = end
        t["records_end"] += end
    report: dict[str, Any] = {"bootstrap_servers": settings.bootstrap_servers, "namespace": settings.namespace,
                              "topics": topics}
    try:
        groups = await _groups(settings)
    except Exception as exc:
        report["groups"] = {"error": f"{UNKNOWN}: the broker did not list consumer groups: "
                                     f"{type(exc).__name__}: {exc}"}
        groups = None
    if groups is not None:
        report["groups"] = {}
        for group in groups:
            try:
                lag = group_lag(ends, await _committed(settings, group, ends))
            except Exception as exc:
                report["groups"][group] = {"lag": UNKNOWN, "error": f"{type(exc).__name__}: {exc}"}
                continue
            # Another namespace's group (a shared broker): nothing committed here and not named for it.
            if lag or group.startswith(settings.namespace):
                report["groups"][group] = {"lag": sum(t["lag"] for t in lag.values()), "topics": lag}
    try:
        learner = latest_checkpoints(await _checkpoint_events(settings, ends))
        for checkpoint in learner.values():
            offsets = checkpoint.pop("offsets")
            lag = learner_lag(offsets, ends)
            checkpoint["batches_lag"] = UNKNOWN if lag is None else lag
        report["learner"] = learner
    except Exception as exc:
        report["learner"] = {"error": f"{UNKNOWN}: {type(exc).__name__}: {exc}"}
    return report


def collect(settings: Settings, workers: Iterable[str], metrics: Iterable[str], timeout: float) -> dict[str, Any]:
    """The whole report (broker, workers, metrics endpoints)."""
    from boltstream.broker.kafka import wait_for_broker

    asyncio.run(wait_for_broker(settings, timeout=timeout))
    report = asyncio.run(broker_status(settings))
    report["workers"] = [worker_status(u) for u in workers]
    report["metrics"] = [endpoint_metrics(u) for u in metrics]
    return report


# ------------------------------------------------------------------ CLI


def format_report(r: Mapping[str, Any]) -> str:
    """The human-readable report (``--json`` prints the same data as JSON)."""
    lines = [f"broker {r['bootstrap_servers']}  namespace {r['namespace']!r}", "", "topics (log end, records):"]
    width = max((len(t) for t in r["topics"]), default=0)
    lines += [f"  {t:<{width}}  {v['records_end']}" for t, v in r["topics"].items()]
    lines += ["", "consumer groups (lag, records):"]
    groups = r["groups"]
    if "error" in groups:
        lines.append(f"  {groups['error']}")
    for g, v in groups.items() if "error" not in groups else ():
        if "error" in v:
            lines.append(f"  {g}: lag {UNKNOWN} ({v['error']})")
            continue
        parts = ", ".join(f"{t} {tv['lag']}" for t, tv in v["topics"].items()) or "no committed offsets"
        lines.append(f"  {g}: {parts}")
    lines += ["", "learner (newest checkpoint per model):"]
    learner = r["learner"]
    if "error" in learner:
        lines.append(f"  {learner['error']}")
    else:
        lines += [f"  {m}: version {c['version']}, step {c['learner_step']}, batches lag {c['batches_lag']}"
                  for m, c in learner.items()] or \
                 ["  no checkpoint published yet"]
    lines += ["", "inference workers:"]
    for w in r["workers"]:
        if not w.get("healthy"):
            lines.append(f"  {w['url']}: UNHEALTHY {w.get('error', '')}")
        else:
            extra = "".join(f", {a} v{v}" for a, v in w["adapters"].items())
            lines.append(f"  {w['url']}: {w['model']} v{w['policy_version']}{extra}, reloads {w['reloads']} "
                         f"(failed {w['reload_failures']}), spool {w['spool_pending']}")
    if not r["workers"]:
        lines.append("  none given (--worker URL, --run DIR)")
    if r["metrics"]:
        lines += ["", "metrics endpoints:"]
        for m in r["metrics"]:
            values = ", ".join(f"{k} {v:g}" for k, v in m.items() if k not in ("url", "error", "step_fallbacks"))
            lines.append(f"  {m['url']}: {m.get('error') or values or 'no series status reads'}")
            lines += [f"    learner step SLOWER: {path} off: {reason} (the learner's log names the fix)"
                      for path, reason in m.get("step_fallbacks", {}).items()]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream status", description="Where a running pipeline stands: topics, "
                                "consumer lag, the learner's checkpoints, the workers' versions and health.")
    p.add_argument("--bootstrap-servers", help="host:port[,host:port] (env BOLTSTREAM_BOOTSTRAP_SERVERS)")
    p.add_argument("--namespace", help="topic name prefix (env BOLTSTREAM_NAMESPACE)")
    p.add_argument("--state-file", help="embedded stack state file (env BOLTSTREAM_STATE_FILE)")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="an inference worker's base URL (repeatable), e.g. http://127.0.0.1:8000")
    p.add_argument("--run", type=Path, help="a `boltstream train` output folder: its workers are added")
    p.add_argument("--metrics", action="append", default=[], metavar="URL",
                   help="a component's Prometheus /metrics URL (repeatable): live learner step, spool depths")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the broker")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    settings = config.load(Settings, explicit={"bootstrap_servers": args.bootstrap_servers,
                                               "namespace": args.namespace, "state_file": args.state_file})
    workers = [_check_url(u, "--worker") for u in args.worker]
    if args.run is not None:
        workers += [u for u in run_workers(args.run) if u not in workers]
    metrics = [_check_url(u, "--metrics") for u in args.metrics]
    report = collect(settings, workers, metrics, args.timeout)
    sys.stdout.write((json.dumps(report, indent=2) if args.json else format_report(report)) + "\n")
    return 0
