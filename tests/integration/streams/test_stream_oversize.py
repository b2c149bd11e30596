"""A span the stream app cannot keep goes to the DLQ before its batch is acknowledged; its neighbours survive a restart.

The worker runs with ``max_message_bytes`` = 64 KiB, so on the real broker:

* one span of ~100 KB (a runaway attribute, written past the exporter) cannot
  be kept in the changelog: it must land in ``dlq`` with the reason and its
  origin, and nothing else of its fetch may be lost (the old save stopped at
  the first oversize chunk and the batch was acknowledged anyway);
* one rollout's spans together (~4 x 25 KB) exceed one changelog record: they
  must be split over several chunks, all kept.

Every span but the roots is written to ONE partition before the worker starts
(one fetch, the oversize span first); the worker is stopped gracefully once the
dead letter is out (it commits those offsets), restarted, and only then are the
roots produced: every rollout must close with all its spans, i.e. exactly the
reference samples, which come only from the restored changelog.
"""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from boltstream.broker.kafka import producer_kwargs
from boltstream.config import Settings
from boltstream.schemas import Codec
from tests.integration.streams.stream_helpers import TopicReader, samples_of
from tests.integration.streams.stream_workload import _span, make_workload, reference_samples

GROUP = 2
WORKER_MAX_BYTES = 65_536


async def _produce_to_partition_0(settings: Settings, records: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(**{**producer_kwargs(settings), "max_request_size": 1_048_576})
    await producer.start()
    try:
        futures = [await producer.send(settings.topic("spans"), value, key=key, partition=0) for key, value in records]
        for future in futures:
            await future
    finally:
        await producer.stop()


async def test_oversize_span_is_dead_lettered_and_no_span_of_its_batch_is_lost_across_a_restart(
        settings: Settings, start_worker, app_id) -> None:
    codec, topic = Codec(), settings.topic("spans")
    rollouts = make_workload(3, GROUP, seed=3, run=settings.namespace)
    expected = reference_samples(rollouts)
    victim, padded = rollouts[0], rollouts[1]
    ids = (victim.rollout_id, victim.attempt_id, victim.task_id)
    runaway = _span(victim.root["trace_id"], "00000000000fffff", "agent.step", victim.root["span_id"], 1, 2, ids,
                    attrs={"blob": "x" * 100_000})
    for span in padded.spans[:-1]:  # its spans alone fit; together they exceed one changelog record
        span["attributes"] = {**span["attributes"], "padding": "p" * 25_000}
    runaway_bytes = codec.encode("Span", runaway, topic=topic)
    bodies = [(victim.rollout_id.encode(), runaway_bytes)] + [
        (r.rollout_id.encode(), codec.encode("Span", s, topic=topic)) for r in rollouts for s in r.spans[:-1]]
    roots = [(r.rollout_id.encode(), codec.encode("Span", r.spans[-1], topic=topic)) for r in rollouts]
    await _produce_to_partition_0(settings, bodies)

    env = {"BOLTSTREAM_MAX_MESSAGE_BYTES": str(WORKER_MAX_BYTES)}
    first = start_worker(app_id, "--group-size", str(GROUP), **env)
    async with TopicReader(settings, settings.topic("dlq"), "DeadLetter") as dlq:
        await dlq.until(lambda: len(dlq.records) >= 1, 60, "the oversize span's dead letter")
        assert first.stop() == 0, first.log_tail()  # graceful: the batch's offsets are committed
        [letter] = dlq.records
    assert (letter["topic"], letter["partition"], letter["offset"]) == (topic, 0, 0)
    assert letter["key"] == victim.rollout_id.encode() and letter["component"] == "stream"
    assert f"record of {len(runaway_bytes)} bytes is over the" in letter["reason"]
    # Bigger than the broker's message size, so the copy is cut (and says so); the original stays at its offset.
    assert runaway_bytes.startswith(letter["value"]) and "value truncated from" in letter["reason"]

    restarted = start_worker(app_id, "--group-size", str(GROUP), **env)
    await _produce_to_partition_0(settings, roots)
    async with TopicReader(settings, settings.topic("batches"), "TrainingBatch") as batches:
        await batches.until_samples(expected, 60, restarted.log_tail)
    for sample in samples_of(batches.records):
        assert sample["token_ids"] == expected[sample["sample_id"]]["token_ids"]
        assert abs(sample["reward"] - expected[sample["sample_id"]]["reward"]) <= 1e-9, "every reward span is there"
    assert all(b["complete"] for b in batches.records), "no rollout lost a span or its trajectory"
    assert "acked anyway" not in first.log_path.read_text() + restarted.log_path.read_text()
    assert restarted.stop() == 0, restarted.log_tail()
