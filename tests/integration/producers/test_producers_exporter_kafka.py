"""KafkaSpanExporter against the real broker: keys, partitions, odd attributes, oversized spans."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import boltstream
from boltstream.config import Settings
from boltstream.producers.exporter import KafkaSpanExporter
from boltstream.producers.rollout_processor import install_rollout_processor
from boltstream.producers.truncate import DEFAULT_MAX_ATTRIBUTE_BYTES


class Weird:
    def __repr__(self) -> str:
        return "Weird()"


def test_rollout_spans_reach_the_topic_keyed_by_rollout(settings: Settings, helpers: Any) -> None:
    exporter = KafkaSpanExporter(settings=settings, install_rollout_processor=False)
    tp = TracerProvider()
    install_rollout_processor(tp)
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
    tracer = tp.get_tracer("agent")
    ids = []
    for i in range(3):
        with boltstream.rollout(f"task-{i}", 0, tracer_provider=tp) as ctx:
            ids.append(ctx.rollout_id)
            with tracer.start_as_current_span("tool") as sp:
                # types the SDK itself drops or mangles are set behind its back, as some instrumentations do
                sp._attributes._dict["weird"] = Weird()  # type: ignore[attr-defined]
                sp._attributes._dict["nested"] = {"a": [1, 2]}  # type: ignore[attr-defined]
                sp._attributes._dict["mixed"] = [1, "a", None]  # type: ignore[attr-defined]
            with tracer.start_as_current_span("huge", attributes={"input.value": "x" * 3_000_000,
                                                                   "response_token_ids": list(range(5000))}):
                pass
            ctx.set_result(float(i))
    tp.shutdown()
    m = exporter.metrics
    assert (m.acked, m.dropped, m.truncated) == (12, 0, 3), m  # 3 x (root, tool, huge, reward)
    recs = helpers.read_topic(settings, "spans", "Span", count=12)
    assert len(recs) == 12
    partitions: dict[bytes, set[int]] = {}
    for partition, key, rec in recs:
        assert key == rec["rollout_id"].encode()
        partitions.setdefault(key, set()).add(partition)
    assert set(partitions) == {i.encode() for i in ids} and all(len(p) == 1 for p in partitions.values())
    tools = [r for _, _, r in recs if r["name"] == "tool"]
    assert tools[0]["attributes"]["weird"] == "Weird()"
    assert tools[0]["attributes"]["nested"] == '{"a": [1, 2]}'
    assert tools[0]["attributes"]["mixed"] == {"strings": ["1", "a", "null"]}
    huge = [r for _, _, r in recs if r["name"] == "huge"]
    assert all(h["attributes"]["boltstream.truncated"] is True for h in huge)
    # The per-attribute cap keeps the value's first bytes (docs/producers.md), the rest of the span fits whole.
    assert all(h["attributes"]["boltstream.truncated.fields"]["strings"] == ["cut:attribute:input.value"] for h in huge)
    assert all(h["attributes"]["input.value"] == "x" * DEFAULT_MAX_ATTRIBUTE_BYTES for h in huge)
    assert huge[0]["llm"]["response_token_ids"] == list(range(5000)), "token ids survive when they fit"
    finals = sorted(r["attributes"]["boltstream.reward.value"] for _, _, r in recs if r["name"] == "boltstream.reward")
    assert finals == [0.0, 1.0, 2.0]
