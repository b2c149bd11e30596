"""200 rollouts in, exactly the expected samples out, with the expected advantages (one real worker)."""

from __future__ import annotations

import collections

from boltstream.broker.kafka import log_end_offsets
from boltstream.config import Settings
from boltstream.schemas import Codec
from tests.integration.streams.stream_helpers import TopicReader, produce, samples_of
from tests.integration.streams.stream_workload import encoded_spans, make_workload, reference_samples

TASKS, GROUP = 50, 4


async def test_200_rollouts_yield_exactly_the_expected_samples(settings: Settings, start_worker, app_id) -> None:
    rollouts = make_workload(TASKS, GROUP, seed=11, run=settings.namespace)
    expected = reference_samples(rollouts)
    assert len(rollouts) == 200 and {len(r.calls) for r in rollouts} == {1, 2, 3, 4, 5}
    assert any(sum(r.step_rewards) < 0 for r in rollouts), "workload must contain failing tools"
    assert any(r.final_reward is None for r in rollouts), "workload must contain failed rollouts"

    spans_topic = settings.topic("spans")
    await produce(settings, spans_topic, encoded_spans(Codec(), spans_topic, rollouts))
    worker = start_worker(app_id, "--group-size", str(GROUP))

    async with TopicReader(settings, settings.topic("batches"), "TrainingBatch") as reader:
        await reader.until_samples(expected, 90, worker.log_tail)
        await reader.quiet(idle=1.0, timeout=10)

    samples = samples_of(reader.records)
    counts = collections.Counter(s["sample_id"] for s in samples)
    assert set(counts) == set(expected)
    assert max(counts.values()) == 1, "a worker that never crashed must not emit duplicates"
    for sample in samples:
        ref = expected[sample["sample_id"]]
        assert abs(sample["advantage"] - ref["advantage"]) <= 1e-6, sample["sample_id"]
        assert abs(sample["reward"] - ref["reward"]) <= 1e-9
        assert sample["token_ids"] == ref["token_ids"]
        assert sample["rollout_id"] == ref["rollout_id"]
        prompt = sample["prompt_length"]
        assert sample["loss_mask"] == [False] * prompt + [True] * (len(sample["token_ids"]) - prompt)
    batches = reader.records
    assert len({b["batch_id"] for b in batches}) == TASKS
    assert all(b["complete"] and b["num_rollouts"] == GROUP and b["group_size"] == GROUP for b in batches)
    assert all(b["num_parts"] == 1 for b in batches)

    # Every rollout went through the trajectories topic once, keyed by its task; nothing was dead-lettered.
    async with TopicReader(settings, settings.topic("trajectories"), "Trajectory") as trajectories:
        await trajectories.until(lambda: len(trajectories.records) >= len(rollouts), 30, "200 trajectories")
    assert {t["attempt_id"] for t in trajectories.records} == {r.attempt_id for r in rollouts}
    assert all(rec.key == t["task_id"].encode() for rec, t in zip(trajectories.raw, trajectories.records, strict=True))
    from aiokafka import TopicPartition

    dlq = await log_end_offsets(settings, [TopicPartition(settings.topic("dlq"), p) for p in range(settings.partitions)])
    assert sum(dlq.values()) == 0
    assert worker.stop() == 0, worker.log_tail()
