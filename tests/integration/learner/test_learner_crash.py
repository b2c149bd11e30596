"""SIGKILL the learner between checkpoints, restart it: exact resume.

The first run trains six steps (checkpoint at step 4) and is killed while it waits for
more data; the restart loads v4 and seeks to its offsets. The surviving step history in
the metrics JSONL must cover every sample produced exactly once: the samples of steps 5-6
are trained again (their weights died with the process), nothing from steps 1-4 is.
Groups are spread over all partitions by key, so parts complete out of order.
"""

from __future__ import annotations

from pathlib import Path

from boltstream.broker.kafka import log_end_offsets
from boltstream.learner.metrics import read_records, read_steps
from boltstream.weights.checkpoints import latest_manifest
from tests.integration.learner.helpers import Learner, group, produce, sample_ids

ARGS = ["--model", "tiny", "--groups-per-step", "2", "--checkpoint-every", "4", "--keep-last", "2",
        "--max-staleness", "none", "--lr", "1e-3", "--max-steps", "10", "--poll-ms", "100"]


async def test_sigkill_between_checkpoints_then_exact_resume(settings, settings_env, s3_client,
                                                             tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    args = [*ARGS, "--metrics-path", str(metrics), "--workdir", str(tmp_path / "work")]
    first = [group(f"a{i}", seed=i, parts=2 if i % 3 == 0 else 1) for i in range(12)]
    await produce(settings, [r for g in first for r in g] + first[4])  # a4 twice: the duplicate is dropped
    learner = Learner(args, settings_env, tmp_path / "learner-1.log")
    try:
        learner.wait_for(r"ready: step 0 ")
        learner.wait_for(r"checkpoint v4 ")
        learner.wait_for(r"step 6 version 6")  # all data used; it now waits for more
    finally:
        learner.kill()
    crashed = read_steps(read_records(metrics))
    assert [s["step"] for s in crashed] == [1, 2, 3, 4, 5, 6]

    second = [group(f"b{i}", seed=100 + i, parts=2 if i == 0 else 1) for i in range(8)]
    await produce(settings, [r for g in second for r in g])
    learner = Learner(args, settings_env, tmp_path / "learner-2.log")
    try:
        learner.wait_for(r"ready: step 4 version 4")
        learner.wait_for(r"checkpoint v8 ")
        learner.wait_for(r"done: step 10 version 10")
        assert learner.wait(30) == 0
    finally:
        learner.stop()

    # the surviving history trains every produced sample exactly once
    records = read_records(metrics)
    steps = read_steps(records)
    assert [s["step"] for s in steps] == list(range(1, 11))
    trained = [sid for s in steps for sid in s["sample_ids"]]
    produced = sample_ids(r for g in first + second for r in g)
    assert len(trained) == len(set(trained)), "no sample trained twice relative to the weights"
    assert sorted(trained) == sorted(produced), "no sample skipped"

    # what the restart retrained: exactly the crashed run's steps after the checkpoint
    resumed_at = [i for i, r in enumerate(records) if r["event"] == "resume"][1]
    rerun = {sid for r in records[resumed_at:] if r["event"] == "step" for sid in r["sample_ids"]}
    before_ckpt = {sid for s in crashed[:4] for sid in s["sample_ids"]}
    after_ckpt = {sid for s in crashed[4:] for sid in s["sample_ids"]}
    assert not rerun & before_ckpt and after_ckpt <= rerun
    assert steps[-1]["dropped_total"] == {"record_duplicate_batch": 1}

    # the final checkpoint has consumed every record of every partition
    manifest = latest_manifest(s3_client, settings.s3_bucket, f"{settings.namespace.rstrip('.')}/tiny")
    assert manifest["version"] == 10
    ends = await log_end_offsets(settings, [_tp(settings, p) for p in range(settings.partitions)])
    assert {o["partition"]: o["offset"] for o in manifest["offsets"]} == {tp.partition: e for tp, e in ends.items()}


def _tp(settings, partition: int):
    from aiokafka import TopicPartition

    return TopicPartition(settings.topic("batches"), partition)
