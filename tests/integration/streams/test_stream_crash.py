"""Two workers, one SIGKILLed mid-stream and restarted: every rollout's samples arrive, none lost.

faust is at-least-once, so the restarted partitions replay from the last
committed offset over the restored changelog (docs/architecture.md, "Why it is correct after a crash").
What must hold at the consumer: after dedupe by sample id (attempt id + call
index) exactly the expected samples, each copy with the expected advantage.
Duplicates before dedupe are counted and printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from boltstream.config import Settings
from boltstream.schemas import Codec
from tests.integration.streams.stream_helpers import TopicReader, produce, samples_of
from tests.integration.streams.stream_workload import interleaved_spans, make_workload, reference_samples

TASKS, GROUP = 50, 4


# Failed about 1 run in 5 on Tansu while faust's recovery consistency check was on (the restarted worker raised
# ConsistencyError over Tansu's short high watermark; the stream app turns the check off, docs/streams.md), and
# now and then the survivors stalled after the rebalance: not seen in 20 runs since, but not explained either,
# so one rerun stays.
@pytest.mark.flaky(reruns=1)
async def test_sigkill_one_of_two_workers_mid_stream(settings: Settings, start_worker, app_id, record_property) -> None:
    rollouts = make_workload(TASKS, GROUP, seed=23, run=settings.namespace)
    expected = reference_samples(rollouts)
    spans_topic = settings.topic("spans")
    records = interleaved_spans(Codec(), spans_topic, rollouts, width=24)

    first = start_worker(app_id, "--group-size", str(GROUP))
    other = start_worker(app_id, "--group-size", str(GROUP))
    # ~15 s of steady span traffic, so the kill lands while rollouts are open and spans still arrive.
    producing = asyncio.create_task(produce(settings, spans_topic, records, pace=0.3, chunk=30))

    async with TopicReader(settings, settings.topic("batches"), "TrainingBatch") as reader:
        def unique() -> set[str]:
            return {s["sample_id"] for s in samples_of(reader.records)}

        await reader.until(lambda: len(unique()) >= len(expected) // 10, 90, "a tenth of the samples")
        seen_at_kill = len(unique())
        first.kill()
        assert not producing.done(), "the kill must land while spans are still being produced"
        restarted = start_worker(app_id, "--group-size", str(GROUP))
        await producing
        try:
            await reader.until(lambda: unique() >= set(expected), 120, f"all {len(expected)} samples")
        except AssertionError:
            logs = "\n\n".join(w.log_tail() for w in (first, other, restarted))
            raise AssertionError(f"missing {len(set(expected) - unique())} samples; logs:\n{logs}") from None
        await reader.quiet(idle=3.0, timeout=20)

    samples = samples_of(reader.records)
    counts = collections.Counter(s["sample_id"] for s in samples)
    duplicates = len(samples) - len(counts)
    batch_copies = collections.Counter(b["batch_id"] for b in reader.records if b["part"] == 0)
    print(
        f"\ncrash test: {len(expected)} expected samples, {len(samples)} received before dedupe, "
        f"{duplicates} duplicate(s) in {sum(c - 1 for c in batch_copies.values())} re-emitted group(s); "
        f"{seen_at_kill} unique samples were out when the worker was killed"
    )
    record_property("duplicate_samples", duplicates)
    assert set(counts) == set(expected), f"lost {set(expected) - set(counts)}, unexpected {set(counts) - set(expected)}"
    assert seen_at_kill < len(expected)
    for sample in samples:  # every copy, duplicates included, carries the right numbers
        ref = expected[sample["sample_id"]]
        assert abs(sample["advantage"] - ref["advantage"]) <= 1e-6, sample["sample_id"]
        assert sample["token_ids"] == ref["token_ids"]
    assert all(b["complete"] and b["num_rollouts"] == GROUP for b in reader.records)
    assert other.stop() == 0, other.log_tail()
    assert restarted.stop() == 0, restarted.log_tail()
