"""A spool replay after a partial ack duplicates spans on the log; the stream app counts each once.

What a crash between the broker's ack and the spool's settle leaves: every record of the
segment is on the log AND still in the spool, so the next start sends them all again
(producers/spool.py: a segment goes only once all of it is settled). Here the first process
sends a spool's records and "dies" before settling (the spool is closed, as a crash leaves it);
a second one opens the same directory, replays them, and settles. One real stream worker then
reads the duplicated log, and the samples must be exactly the reference ones, each once.
"""

from __future__ import annotations

import collections
from pathlib import Path

from boltstream.config import Settings
from boltstream.producers.sender import Counters
from boltstream.producers.spool import Spool
from boltstream.schemas import Codec
from tests.integration.streams.stream_helpers import TopicReader, produce, samples_of
from tests.integration.streams.stream_workload import encoded_spans, make_workload, reference_samples

TASKS, GROUP = 6, 4


def open_spool(path: Path, counters: Counters) -> Spool:
    return Spool(path, counters, max_bytes=1 << 26, segment_bytes=1 << 20)


async def test_spans_replayed_after_a_partial_ack_train_once(settings: Settings, start_worker, app_id,
                                                             tmp_path: Path) -> None:
    rollouts = make_workload(TASKS, GROUP, seed=5, run=settings.namespace)
    expected = reference_samples(rollouts)
    topic = settings.topic("spans")
    records = encoded_spans(Codec(), topic, rollouts)

    first = open_spool(tmp_path / "spool", Counters())
    first.append(records)
    sent = first.take(len(records))
    await produce(settings, topic, [(k, v) for k, v, *_ in sent])  # acked by the broker...
    first.close()  # ...and the process dies before the spool hears of it

    counters = Counters()
    second = open_spool(tmp_path / "spool", counters)
    replayed = second.take(len(records))
    assert [(k, v) for k, v, *_ in replayed] == records and counters.replayed == len(records)
    await produce(settings, topic, [(k, v) for k, v, *_ in replayed])
    second.settle(replayed)
    assert second.pending == 0 and not list((tmp_path / "spool").glob("*.seg"))
    second.close()

    worker = start_worker(app_id, "--group-size", str(GROUP))
    async with TopicReader(settings, settings.topic("batches"), "TrainingBatch") as reader:
        await reader.until(lambda: {s["sample_id"] for s in samples_of(reader.records)} >= set(expected), 90,
                           f"{len(expected)} samples")
        await reader.quiet(idle=1.0, timeout=10)
    counts = collections.Counter(s["sample_id"] for s in samples_of(reader.records))
    assert set(counts) == set(expected) and max(counts.values()) == 1, counts.most_common(3)
    for sample in samples_of(reader.records):
        ref = expected[sample["sample_id"]]
        assert sample["token_ids"] == ref["token_ids"] and abs(sample["advantage"] - ref["advantage"]) <= 1e-6
    assert worker.stop() == 0, worker.log_tail()
    counters_line = [line for line in worker.log_tail(400).splitlines() if "stream counters" in line][-1]
    assert f"'rollout.duplicate': {len(records)}," in counters_line, counters_line  # every span came twice
