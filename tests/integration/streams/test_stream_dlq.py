"""Poison records on the spans topic land in the DLQ with reasons and origin while good records flow."""

from __future__ import annotations

from boltstream.config import Settings
from boltstream.schemas import Codec
from tests.integration.streams.stream_helpers import TopicReader, produce, samples_of
from tests.integration.streams.stream_workload import encoded_spans, make_workload, reference_samples

GROUP = 2


async def test_poison_records_go_to_the_dlq_and_good_ones_flow(settings: Settings, start_worker, app_id) -> None:
    codec = Codec()
    spans_topic = settings.topic("spans")
    rollouts = make_workload(6, GROUP, seed=5, run=settings.namespace)
    expected = reference_samples(rollouts)
    good = encoded_spans(codec, spans_topic, rollouts)
    # No rollout id, no session, not even a trace id (a span without ids is otherwise the rollout of its trace).
    orphan = dict(rollouts[0].spans[0], span_id="00000000deadbeef", rollout_id=None, attempt_id=None, task_id=None,
                  trace_id="")
    poison = {
        b"garbage": (b"garbage", b"not avro at all"),
        b"wrong-schema": (b"wrong-schema", codec.encode("Task", {"task_id": "t", "payload_json": "{}"})),
        b"no-ids": (b"no-ids", codec.encode("Span", orphan, topic=spans_topic)),
        b"empty": (b"empty", b""),
    }
    # Poison first, in the middle and at the end of the good records' partitions.
    records = [poison[b"garbage"], *good[:20], poison[b"wrong-schema"], *good[20:], poison[b"no-ids"], poison[b"empty"]]
    metadata = await produce(settings, spans_topic, records)
    origin = {key: (md.partition, md.offset) for (key, _), md in zip(records, metadata, strict=True) if key in poison}

    worker = start_worker(app_id, "--group-size", str(GROUP))
    async with TopicReader(settings, settings.topic("dlq"), "DeadLetter") as dlq:
        await dlq.until(lambda: len(dlq.records) >= len(poison), 60, "4 dead letters")
    async with TopicReader(settings, settings.topic("batches"), "TrainingBatch") as batches:
        def seen() -> set[str]:
            return {s["sample_id"] for s in samples_of(batches.records)}

        await batches.until(lambda: seen() >= set(expected), 60, "the good rollouts' samples")
    assert seen() == set(expected)

    letters = {letter["key"]: letter for letter in dlq.records}
    assert set(letters) == set(poison), [letter["reason"] for letter in dlq.records]
    for key, (_, value) in poison.items():
        letter = letters[key]
        assert letter["component"] == "stream"
        assert letter["topic"] == spans_topic
        assert (letter["partition"], letter["offset"]) == origin[key]
        assert letter["value"] == value  # kept whole, replayable
    assert "wrong magic byte" in letters[b"garbage"]["reason"]
    assert "expected a Span record, got Task" in letters[b"wrong-schema"]["reason"]
    assert "no rollout id, session id or trace id" in letters[b"no-ids"]["reason"]
    assert "empty record" in letters[b"empty"]["reason"]
    assert worker.alive()
    assert worker.stop() == 0, worker.log_tail()
