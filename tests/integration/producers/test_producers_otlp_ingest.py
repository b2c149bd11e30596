"""``boltstream ingest otlp``: what a Collector's kafka exporter writes becomes Span records; junk is dead-lettered."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from boltstream.broker.kafka import admin_kwargs, producer_kwargs
from boltstream.config import Settings
from boltstream.stack import run_sync


def make_request(rollout: str, n: int) -> Any:
    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({"service.name": "java-agent"}))
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("collector-test")
    for i in range(n):
        with tracer.start_as_current_span(f"{rollout}-{i}", attributes={
                "agentlightning.rollout_id": rollout, "gen_ai.operation.name": "chat",
                "gen_ai.usage.input_tokens": 10 + i, "prompt_token_ids": [1, 2, 3]}):
            pass
    return encode_spans(mem.get_finished_spans())


def test_ingest_proto_json_and_junk(settings: Settings, run_cli: Callable[..., subprocess.CompletedProcess[str]],
                                    helpers: Any) -> None:
    topic = f"{settings.namespace}otlp_spans"
    messages = [
        make_request("ro-proto", 3).SerializeToString(),
        json.dumps(MessageToDict(make_request("ro-json", 2))).encode(),
        b"\x08\x96\x01 definitely not OTLP",
        b'{"resourceSpans": "wrong"}',
    ]

    async def publish() -> None:
        admin = AIOKafkaAdminClient(**admin_kwargs(settings))
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 2, 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(**producer_kwargs(settings))
        await producer.start()
        try:
            for i, m in enumerate(messages):
                await producer.send_and_wait(topic, m, key=f"k{i}".encode())
        finally:
            await producer.stop()

    run_sync(publish())
    proc = run_cli("ingest", "otlp", "--topic", topic, "--exit-when-idle-s", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    spans = helpers.read_topic(settings, "spans", "Span", count=5)
    assert len(spans) == 5
    by_rollout: dict[bytes, list[dict[str, Any]]] = {}
    for _, key, rec in spans:
        by_rollout.setdefault(key, []).append(rec)
    assert {k: len(v) for k, v in by_rollout.items()} == {b"ro-proto": 3, b"ro-json": 2}
    rec = by_rollout[b"ro-json"][0]
    assert rec["rollout_id"] == "ro-json" and rec["llm"]["prompt_token_ids"] == [1, 2, 3]
    assert rec["resource"]["service.name"] == "java-agent" and rec["scope"]["name"] == "collector-test"
    dead = helpers.read_topic(settings, "dlq", "DeadLetter", count=2)
    assert sorted(d["value"] for _, _, d in dead) == sorted(messages[2:])
    assert all(d["component"] == "otlp_ingest" and d["topic"] == topic and "OtlpDecodeError" in d["reason"]
               for _, _, d in dead)
    again = run_cli("ingest", "otlp", "--topic", topic, "--exit-when-idle-s", "1")
    assert again.returncode == 0
    assert len(helpers.read_topic(settings, "spans", "Span", count=6, timeout=3)) == 5, "offsets were committed"
