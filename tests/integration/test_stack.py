"""The embedded stack end to end: real broker, real S3 endpoint, real CLI processes."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import uuid
from pathlib import Path

import minio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from boltstream import stack as stack_mod
from boltstream.broker.kafka import consumer_kwargs, log_end_offsets, producer_kwargs
from boltstream.broker.topics import describe_topics, ensure_topics, list_topics
from boltstream.config import TOPICS, Settings
from boltstream.processes import pid_alive, terminate
from boltstream.schemas import Codec


def _tasks(n: int, tag: str) -> list[dict]:
    return [
        {"task_id": f"{tag}-{i}", "payload_json": json.dumps({"i": i}), "split": "train"} for i in range(n)
    ]


async def _produce(settings: Settings, topic: str, records: list[dict]) -> None:
    codec = Codec()
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    try:
        futures = [
            await producer.send(topic, codec.encode("Task", r, topic=topic), key=r["task_id"].encode())
            for r in records
        ]
        for fut in futures:
            await fut
    finally:
        await producer.stop()


async def _read_all(settings: Settings, topic: str, expected: int, group_id: str | None = None) -> list[dict]:
    """Consume ``expected`` Task records from the beginning (in a group, or by assignment)."""
    codec = Codec()
    topics = (topic,) if group_id else ()
    consumer = AIOKafkaConsumer(*topics, **consumer_kwargs(settings, group_id))
    await consumer.start()
    try:
        if not group_id:
            tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
        out: list[dict] = []
        empty_polls = 0
        while len(out) < expected and empty_polls < 40:  # 40 x 500 ms: bounded, no sleeps
            batches = await consumer.getmany(timeout_ms=500)
            empty_polls = 0 if batches else empty_polls + 1
            for records in batches.values():
                out += [codec.decode(m.value, topic=topic, expect="Task") for m in records]
        if group_id:
            await consumer.commit()
        return out
    finally:
        await consumer.stop()


async def test_avro_records_through_the_broker(settings: Settings) -> None:
    topic = settings.topic("tasks")
    sent = _tasks(50, "avro")
    await _produce(settings, topic, sent)

    got = await _read_all(settings, topic, len(sent), group_id=f"g-{uuid.uuid4().hex[:6]}")

    assert sorted(got, key=lambda r: r["task_id"]) == sorted(
        ({**r, "group_size": None, "created_ns": 0} for r in sent), key=lambda r: r["task_id"]
    )
    ends = await log_end_offsets(settings, [TopicPartition(topic, p) for p in range(settings.partitions)])
    assert sum(ends.values()) == len(sent)


def test_object_round_trip_through_s3(settings: Settings, s3_client: minio.Minio) -> None:
    import io

    key = f"{settings.namespace}hello/object.bin"
    body = os.urandom(4096)
    s3_client.put_object(settings.s3_bucket, key, io.BytesIO(body), length=len(body))
    resp = s3_client.get_object(settings.s3_bucket, key)
    try:
        assert resp.read() == body
    finally:
        resp.close()
        resp.release_conn()
    assert [
        o.object_name
        for o in s3_client.list_objects(settings.s3_bucket, prefix=settings.namespace, recursive=True)
    ] == [key]


async def test_topics_list_describe_and_idempotent_create(settings: Settings) -> None:
    expected = sorted(settings.topic(t) for t in TOPICS)
    assert await list_topics(settings) == expected

    described = {t["topic"]: t for t in await describe_topics(settings)}
    assert sorted(described) == expected
    assert all(t["partitions"] == settings.partitions and t["error"] is None for t in described.values())
    assert described[settings.topic("checkpoints")]["configs"].get("cleanup.policy") == "compact"
    assert described[settings.topic("spans")]["configs"].get("retention.ms") == "-1"
    assert described[settings.topic("spans")]["configs"].get("retention.bytes") == "-1"

    assert await ensure_topics(settings) == {name: False for name in expected}


def test_topics_cli_uses_env(settings: Settings, run_cli) -> None:
    listed = run_cli("topics", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == sorted(settings.topic(t) for t in TOPICS)
    described = run_cli("topics", "describe", "--json", "spans")
    assert described.returncode == 0, described.stderr
    [spans] = json.loads(described.stdout)
    assert spans["topic"] == settings.topic("spans") and spans["partitions"] == settings.partitions


def _clean_env(state_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env["BOLTSTREAM_STATE_FILE"] = str(state_file)
    return env


def _runner(cmd: list[str], env: dict[str, str]):
    def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    return run


def test_cli_round_trip_leaves_no_process(tmp_path: Path, boltstream_cmd: list[str]) -> None:
    state_file = tmp_path / "cli" / "stack.json"
    run = _runner(boltstream_cmd, _clean_env(state_file))
    procs: dict[str, tuple[int, str | None]] = {}
    try:
        up = run(["stack", "up"])
        assert up.returncode == 0, up.stderr
        assert "started" in up.stdout
        state = json.loads(state_file.read_text())
        procs = {n: (pid, state["proc_starts"][n]) for n, pid in state["pids"].items()}
        assert set(procs) == {"broker", "s3"}

        again = run(["stack", "up"])
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stdout
        assert json.loads(state_file.read_text())["pids"] == state["pids"]

        table = run(["stack", "status"])
        assert table.returncode == 0, table.stderr
        assert state["bootstrap_servers"] in table.stdout

        status = json.loads(run(["stack", "status", "--json"]).stdout)
        assert status["running"] and status["alive"] == {"broker": True, "s3": True}
        for key in ("bootstrap_servers", "s3_endpoint", "s3_bucket", "namespace"):
            assert status[key] == state[key]
        assert status["credentials_env"] == {
            "access_key": "BOLTSTREAM_S3_ACCESS_KEY",
            "secret_key": "BOLTSTREAM_S3_SECRET_KEY",
        }

        exports = run(["stack", "env"])
        assert exports.returncode == 0, exports.stderr
        pairs = dict(
            shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in exports.stdout.splitlines()
        )
        assert pairs["BOLTSTREAM_BOOTSTRAP_SERVERS"] == state["bootstrap_servers"]
        assert pairs["BOLTSTREAM_S3_ENDPOINT"] == state["s3_endpoint"]

        listed = run(["topics", "list"])
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.split() == sorted(f"boltstream.{t}" for t in TOPICS)

        down = run(["stack", "down"])
        assert down.returncode == 0, down.stderr
        assert not state_file.exists()
        assert [n for n, (pid, start) in procs.items() if pid_alive(pid, start)] == []

        after = run(["stack", "status", "--json"])
        assert after.returncode == 1 and json.loads(after.stdout)["running"] is False
    finally:
        if state_file.exists():
            stack_mod.stop_stack(state_file)


def test_up_twice_reports_running_and_stale_state_is_replaced(tmp_path: Path) -> None:
    state_file = tmp_path / "stack.json"
    try:
        first = stack_mod.start_stack(state_file)
        second = stack_mod.start_stack(state_file)
        assert second["already_running"] is True
        assert second["pids"] == first["pids"]

        # Crash both processes: the state file is now stale and `up` must replace it.
        stack_mod.kill_broker(state_file)
        terminate(first["pids"]["s3"], first["proc_starts"]["s3"])
        assert stack_mod.stack_status(state_file)["running"] is False

        third = stack_mod.start_stack(state_file)
        assert not third.get("already_running")
        assert third["pids"] != first["pids"]
        assert stack_mod.stack_status(state_file)["running"] is True
    finally:
        stack_mod.stop_stack(state_file)
    assert not state_file.exists()
    assert not any(pid_alive(p) for p in stack_mod.state_pids(third))


async def test_durable_broker_survives_kill_9(tmp_path: Path) -> None:
    with stack_mod.embedded_stack(tmp_path, durable=True, partitions=2) as settings:
        state_file = tmp_path / "stack.json"
        before = json.loads(state_file.read_text())
        assert before["durable"] and before["broker_storage"].startswith("s3://")
        topic = settings.topic("spans")
        sent = _tasks(200, "durable")
        await _produce(settings, topic, sent)

        stack_mod.kill_broker(state_file)
        assert not pid_alive(before["pids"]["broker"], before["proc_starts"]["broker"])
        after = stack_mod.restart_broker(state_file)
        assert after["bootstrap_servers"] == before["bootstrap_servers"]
        assert after["pids"]["broker"] != before["pids"]["broker"]

        got = await _read_all(settings, topic, len(sent))
        assert sorted(r["task_id"] for r in got) == sorted(r["task_id"] for r in sent)
