"""``boltstream replay`` against the real broker, as typed: new settings, repeatable output, the live pipeline untouched.

* ~50 rollouts go through a real stream worker; two replays of ``spans`` with gamma and the
  AIR rules changed give batches equal to the pure core applied to the same spans with the
  new settings, and byte-identical to each other; a replay with the live settings gives the
  live samples; the live ``batches`` topic and the worker's committed offsets are the same
  before and after, and no consumer group appeared.
* A replay SIGKILLed half-way and run again with ``--overwrite`` leaves exactly what an
  uninterrupted replay writes, record for record; the killed one wrote no done marker, so
  ``learn --offline`` refuses its output; the re-run's marker counts what it wrote.
* Bad input (an empty range, offsets out of range, an unknown topic, a namespace holding data
  or a live one, an invalid configuration) exits 1 with the reason.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from boltstream import cli
from boltstream.broker.kafka import admin_kwargs, consumer_kwargs
from boltstream.broker.log_range import parse_position, read_range, resolve
from boltstream.broker.topics import held_records
from boltstream.config import Settings
from boltstream.schemas import Codec
from boltstream.schemas.packed import as_lists
from boltstream.schemas.records import rollout_key
from boltstream.stack import run_sync
from boltstream.streams import (
    AssemblyConfig,
    CreditConfig,
    air_rules_from_yaml,
    assemble_trajectory,
    build_training_batches,
)
from tests.integration.conftest import boltstream_argv
from tests.integration.streams.stream_helpers import TopicReader, produce, samples_of
from tests.integration.streams.stream_workload import encoded_spans, interleaved_spans, make_workload

GROUP = 4
AIR_YAML = """\
air:
  rules:
    - {name: tool_error, when: tool_error, value: -0.5}
    - {name: calc_used, when: span, span_name: "^execute_tool calc$", value: 0.05, once_per_rollout: true}
"""
NEW_SETTINGS = ("--gamma", "0.5", "--group-size", str(GROUP))
KILL_TIMEOUT = 60.0

RawRecords = dict[int, list[tuple[bytes | None, bytes]]]


def in_namespace(settings: Settings, namespace: str) -> Settings:
    return dataclasses.replace(settings, namespace=namespace)


async def raw_records(settings: Settings, short: str) -> RawRecords:
    """(key, value) of every record of a topic, per partition in offset order (read without a group)."""
    log_range = await resolve(settings, settings.topic(short), parse_position("earliest"),
                              parse_position("now", "--to"), allow_empty=True)
    out: RawRecords = {p.partition: [] for p in log_range.partitions}
    async for records in read_range(settings, log_range):
        for r in records:
            out[r.partition].append((r.key, r.value))
    return out


async def group_state(settings: Settings, app_id: str) -> tuple[dict[str, int | None], list[str]]:
    """The live app's committed offsets on its source topics, and the names of every consumer group.

    Read by OffsetFetch from a consumer that only names the group (it joins nothing): aiokafka's
    admin ``list_consumer_group_offsets`` cannot decode Tansu's answer.
    """
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, app_id))
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topic(t), p) for t in ("spans", "trajectories") for p in range(settings.partitions)]
        offsets = {f"{tp.topic}[{tp.partition}]": await consumer.committed(tp) for tp in tps}
    finally:
        await consumer.stop()
    admin = AIOKafkaAdminClient(**admin_kwargs(settings))
    await admin.start()
    try:
        groups = sorted(g[0] for g in await admin.list_consumer_groups())
    finally:
        await admin.close()
    return offsets, groups


def replay_json(run_cli: Any, *args: str) -> dict[str, Any]:
    result = run_cli("replay", *args, "--json", "-l", "warning")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def reference(spans: list[dict[str, Any]], rules: str) -> dict[str, dict[str, Any]]:
    """sample_id -> Sample by the pure core alone, with the replay's new settings."""
    by_rollout: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for span in spans:
        by_rollout[rollout_key(span)].append(span)
    assembly = AssemblyConfig(air_rules=air_rules_from_yaml(rules))
    by_task: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for rollout_spans in by_rollout.values():
        trajectory = assemble_trajectory(rollout_spans, assembly)
        by_task[trajectory["task_id"]].append(trajectory)
    credit = CreditConfig(gamma=0.5)
    return {s["sample_id"]: s for task, group in by_task.items()
            for b in build_training_batches(task, group, credit, group_size=GROUP) for s in b["samples"]}


async def test_replay_with_new_settings_matches_the_reference_and_leaves_the_live_pipeline_alone(
        settings: Settings, start_worker, app_id: str, run_cli, tmp_path: Path) -> None:
    rollouts = make_workload(13, GROUP, seed=5, run=settings.namespace)  # 52 rollouts
    spans_topic = settings.topic("spans")
    await produce(settings, spans_topic, encoded_spans(Codec(), spans_topic, rollouts))
    worker = start_worker(app_id, "--group-size", str(GROUP))
    calls = sum(len(r.calls) for r in rollouts)
    async with TopicReader(settings, settings.topic("batches"), "TrainingBatch") as reader:
        await reader.until(lambda: len(samples_of(reader.records)) >= calls, 90, f"{calls} live samples")
    assert worker.stop() == 0, worker.log_tail()
    live_before = await raw_records(settings, "batches")
    groups_before = await group_state(settings, app_id)
    assert sum(o or 0 for o in groups_before[0].values()) > 0, "the live worker committed its offsets"

    rules = tmp_path / "air.yaml"
    rules.write_text(AIR_YAML)
    first_ns, second_ns = f"{settings.namespace}replay1.", f"{settings.namespace}replay2."
    summary = replay_json(run_cli, "--namespace", first_ns, "--air-rules-file", str(rules), *NEW_SETTINGS)
    assert (summary["rollouts"], summary["trajectories"], summary["batches"], summary["dead_letters"]) == (
        len(rollouts), len(rollouts), 13, 0)
    assert summary["config"]["credit"]["gamma"] == 0.5 and summary["range"]["topic"] == spans_topic

    codec = Codec()
    decode = lambda raw, expect: [as_lists(codec.decode(v, expect=expect)) for p in sorted(raw) for _, v in raw[p]]  # noqa: E731
    first = await raw_records(in_namespace(settings, first_ns), "batches")
    replayed = {s["sample_id"]: s for s in samples_of(decode(first, "TrainingBatch"))}
    expected = as_lists(reference(decode(await raw_records(settings, "spans"), "Span"), AIR_YAML))
    assert set(replayed) == set(expected) and len(replayed) == calls
    for sample_id, sample in replayed.items():
        ref = expected[sample_id]
        for field in ("advantage", "reward", "loss_weight"):
            assert abs(sample[field] - ref[field]) <= 1e-6, (sample_id, field)
        assert sample["behaviour_logprobs"] == pytest.approx(ref["behaviour_logprobs"], abs=1e-6)
        for field in ("token_ids", "loss_mask", "prompt_length", "rollout_id", "policy_version"):
            assert sample[field] == ref[field], (sample_id, field)
    live = {s["sample_id"]: s for s in samples_of(decode(live_before, "TrainingBatch"))}
    changed = sum(abs(live[i]["advantage"] - s["advantage"]) > 1e-6 for i, s in replayed.items())
    assert changed > calls // 4, "the new gamma and AIR rules must change advantages"

    replay_json(run_cli, "--namespace", second_ns, "--air-rules-file", str(rules), *NEW_SETTINGS)
    assert await raw_records(in_namespace(settings, second_ns), "batches") == first, "not byte-identical"

    same_ns = f"{settings.namespace}same."  # the live settings: the live samples again
    replay_json(run_cli, "--namespace", same_ns, "--group-size", str(GROUP))
    same = samples_of(decode(await raw_records(in_namespace(settings, same_ns), "batches"), "TrainingBatch"))
    assert {s["sample_id"]: s for s in same} == live

    assert await raw_records(settings, "batches") == live_before
    groups_after = await group_state(settings, app_id)
    assert groups_after == groups_before, "a replay must not commit, join or create a consumer group"


async def test_a_replay_killed_half_way_and_run_again_writes_what_an_uninterrupted_one_does(
        settings: Settings, settings_env: dict[str, str], run_cli, tmp_path: Path) -> None:
    # ~18,000 spans, 24 rollouts at a time: long enough that a loaded machine still sees the first batch
    # record before the replay has written them all
    rollouts = make_workload(600, GROUP, seed=9, run=settings.namespace)
    spans_topic = settings.topic("spans")
    await produce(settings, spans_topic, interleaved_spans(Codec(), spans_topic, rollouts, width=24))
    args = ("--grace-s", "0", "--group-size", str(GROUP))  # close at the root: output flows from the start
    whole_ns, killed_ns = f"{settings.namespace}whole.", f"{settings.namespace}killed."
    replay_json(run_cli, "--namespace", whole_ns, *args)
    whole = {short: await raw_records(in_namespace(settings, whole_ns), short) for short in ("trajectories", "batches")}
    total = sum(map(len, whole["batches"].values()))

    killed_settings = in_namespace(settings, killed_ns)
    log = (tmp_path / "killed.log").open("wb")
    proc = subprocess.Popen(boltstream_argv("replay", "--namespace", killed_ns, *args), env=settings_env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + KILL_TIMEOUT
        written = 0
        while not written and proc.poll() is None and time.monotonic() < deadline:
            written = (await held_records(killed_settings, [killed_settings.topic("batches")])).get(
                killed_settings.topic("batches"), 0)
        assert proc.poll() is None, f"the replay ended before it could be killed: {(tmp_path / 'killed.log').read_text()}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=KILL_TIMEOUT)
        log.close()
    partial = sum(map(len, (await raw_records(killed_settings, "batches")).values()))
    print(f"\nkill-and-rerun: killed with {partial} of {total} batch records written")
    assert 0 < partial < total, f"killed with {partial} of {total} batches written"

    assert not any((await raw_records(killed_settings, "replay")).values()), "a killed replay wrote its marker"
    untrainable = run_cli("learn", "--model", "tiny", "--offline", f"topic:{killed_settings.topic('batches')}",
                          "--max-steps", "1", "--workdir", str(tmp_path / "learn"))
    assert untrainable.returncode == 1 and "a replay that has not finished" in untrainable.stderr, \
        untrainable.stderr[-2000:]
    refused = run_cli("replay", "--namespace", killed_ns, *args)
    assert refused.returncode == 1 and "already holds data" in refused.stderr and "--overwrite" in refused.stderr
    summary = replay_json(run_cli, "--namespace", killed_ns, "--overwrite", *args)
    assert summary["batches"] == total
    markers = [Codec().decode(v, expect="ReplayDone") for _, v in (await raw_records(killed_settings, "replay"))[0]]
    assert len(markers) == 1 and markers[0]["counts"]["samples"] == summary["samples"]
    batch_ends = {o["partition"]: o["end"] for o in markers[0]["outputs"] if o["topic"] == killed_settings.topic("batches")}
    assert sum(batch_ends.values()) == total and summary["done_marker"] == killed_settings.topic("replay")
    for short in ("trajectories", "batches"):
        assert await raw_records(killed_settings, short) == whole[short], f"{short} differ from the uninterrupted run"


def test_bad_input_exits_1_with_the_reason(settings: Settings, settings_env: dict[str, str],
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in [k for k in os.environ if k.startswith("BOLTSTREAM_")]:
        monkeypatch.delenv(name)
    for name, value in settings_env.items():
        if name.startswith("BOLTSTREAM_"):
            monkeypatch.setenv(name, value)
    spans_topic = settings.topic("spans")
    run_sync(produce(settings, spans_topic, encoded_spans(Codec(), spans_topic, make_workload(1, GROUP, seed=2))))
    ns = settings.namespace
    holding, live_like = in_namespace(settings, f"{ns}holding."), in_namespace(settings, f"{ns}livelike.")
    run_sync(produce(settings, holding.topic("batches"), [(b"k", b"anything")]))
    run_sync(produce(settings, live_like.topic("spans"), [(b"k", b"anything")]))
    cases = [
        (("--from", "2099-01-01T00:00:00Z"), "no records of"),
        (("--from", "0:100000"), "offset 100000 is out of range for partition 0"),
        (("--live-namespace", f"{ns}nosuch."), "does not exist"),
        (("--namespace", f"{ns}holding."), "already holds data"),
        (("--namespace", f"{ns}livelike.", "--overwrite"), "a live pipeline's namespace"),
        (("--namespace", ns), "is the live pipeline's namespace"),
        (("--gamma", "2"), "gamma"),
        (("--air-rules-file", "/nonexistent/air.yaml"), "no such file"),
    ]
    for args, needle in cases:
        argv = ["replay", "--namespace", f"{ns}fresh.", *args]  # a later --namespace wins
        assert cli.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "boltstream replay: error:" in err and needle in err, (args, err[-2000:])
    assert not run_sync(held_records(settings, [f"{ns}fresh.{t}" for t in ("trajectories", "batches", "dlq")]))
