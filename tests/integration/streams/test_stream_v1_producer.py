"""A producer still on Span v1 (token ids as Avro arrays) and today's stream app, on the embedded broker.

Half of every rollout's spans are written as an old producer writes them (the Span v1 schema, its
fingerprint in the single-object header, ``array<int>`` token ids), half by today's codec (Span v2,
packed bytes): an inference worker and an agent upgraded at different times. The one real worker
must assemble them into exactly the expected samples, and write Trajectory and TrainingBatch records
in the newest versions (packed).
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

from fastavro import schemaless_writer

from boltstream.config import Settings
from boltstream.schemas import Codec
from boltstream.schemas.loader import default_catalog
from tests.integration.streams.stream_helpers import TopicReader, produce, samples_of
from tests.integration.streams.stream_workload import make_workload, reference_samples

TASKS, GROUP = 10, 4


def v1_span_bytes(span: dict[str, Any]) -> bytes:
    """What a producer whose newest Span schema is v1 writes: no boltstream code involved but fastavro."""
    v1 = default_catalog().get("Span", 1)
    body = BytesIO()
    schemaless_writer(body, v1.parsed, span)
    return b"\xc3\x01" + v1.fingerprint + body.getvalue()


async def test_v1_spans_and_today_s_spans_yield_the_expected_samples(settings: Settings, start_worker, app_id) -> None:
    rollouts = make_workload(TASKS, GROUP, seed=23, run=settings.namespace)
    expected = reference_samples(rollouts)
    codec, topic = Codec(), settings.topic("spans")
    records, old = [], 0
    for r in rollouts:
        for i, span in enumerate(r.spans):
            if i % 2 == 0:
                value, old = v1_span_bytes(span), old + (span.get("llm") is not None)
            else:
                value = codec.encode("Span", span, topic=topic)
            records.append((r.rollout_id.encode(), value))
    assert old > 10, "the workload must put token ids in v1 spans"
    assert {v[2:10] for _, v in records} == {default_catalog().get("Span", v).fingerprint for v in (1, 2)}

    await produce(settings, topic, records)
    worker = start_worker(app_id, "--group-size", str(GROUP))
    async with TopicReader(settings, settings.topic("batches"), "TrainingBatch") as reader:
        await reader.until_samples(expected, 90, worker.log_tail)

    samples = samples_of(reader.records)
    assert sorted(s["sample_id"] for s in samples) == sorted(expected)
    for sample in samples:
        ref = expected[sample["sample_id"]]
        assert sample["token_ids"] == ref["token_ids"], sample["sample_id"]
        assert abs(sample["advantage"] - ref["advantage"]) <= 1e-6
        prompt = sample["prompt_length"]
        assert sample["loss_mask"] == [False] * prompt + [True] * (len(sample["token_ids"]) - prompt)
    newest = default_catalog().latest("TrainingBatch")
    assert newest.version == 3 and all(raw.value[2:10] == newest.fingerprint for raw in reader.raw)
    assert worker.stop() == 0, worker.log_tail()
