"""``boltstream learn --offline`` as typed, tiny model, real broker and S3.

A replay namespace's batches topic holds the dataset (a split group, a duplicate, junk,
samples from an old policy version). Each test reads the surviving step history from the
metrics file and checks that every epoch trains every sample of the dataset exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from boltstream.broker.topics import ensure_topics
from boltstream.config import Settings
from boltstream.examples.calc.tasks import train_test
from boltstream.learner.config import LearnerConfig
from boltstream.learner.loop import train
from boltstream.learner.metrics import read_records, read_steps
from boltstream.runs.evaluate import main as evaluate_main
from boltstream.stack import run_sync
from boltstream.weights.checkpoints import latest_manifest
from tests.integration.learner.helpers import Learner, group, produce, sample_ids

TIMEOUT = 120.0
ARGS = ["--model", "tiny", "--groups-per-step", "2", "--keep-last", "2", "--max-staleness", "1", "--lr", "1e-3",
        "--poll-ms", "100"]


def replay_namespace(settings: Settings) -> Settings:
    """A second namespace with topics of its own, as ``boltstream replay`` writes to."""
    replay = dataclasses.replace(settings, namespace=f"{settings.namespace}replay.")
    run_sync(ensure_topics(replay))
    return replay


def dataset(prefix: str, n: int) -> tuple[list[dict], set[str]]:
    """``n`` groups sampled at policy version 0 (stale for --max-staleness 1 from step 2 on), one split
    in two parts, the first one sent twice, plus a junk record; and the sample ids to train per epoch."""
    groups = [group(f"{prefix}{i}", seed=i, parts=2 if i == 1 else 1) for i in range(n)]
    records = [r for g in groups for r in g] + groups[0] + [b"junk"]
    return records, set(sample_ids(r for g in groups for r in g))


def per_epoch(steps: list[dict]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for s in steps:
        out.setdefault(s.get("epoch", 0), []).extend(s["sample_ids"])
    return out


async def test_offline_from_an_export_then_online(settings, run_cli, s3_client, tmp_path: Path) -> None:
    """In this process (the CLI as typed is the next test's): export -> 2 epochs -> the live topic."""
    replay = replay_namespace(settings)
    records, expected = dataset("g", 5)
    await produce(replay, records)
    data = tmp_path / "data"
    data.mkdir()
    proc = run_cli("export", "batches", "--namespace", replay.namespace, "--out", str(data / "part-0.parquet"))
    assert proc.returncode == 0 and "1 undecodable skipped" in proc.stdout, proc.stderr
    old = [r for i in range(2) for r in group(f"old{i}", seed=50 + i)]  # live, before the run: never trained
    await produce(settings, old)

    metrics = tmp_path / "metrics.jsonl"
    cfg = LearnerConfig(settings=settings, model="tiny", groups_per_step=2, keep_last=2, max_staleness=1, lr=1e-3,
                        poll_ms=100, offline=str(data), epochs=2, then_online=True, checkpoint_every=2,
                        max_steps=8, metrics_path=str(metrics), workdir=str(tmp_path / "work"))
    online = asyncio.Event()
    run = asyncio.create_task(train(cfg, progress=lambda line: line.startswith("online: ") and online.set()))
    waiting = asyncio.create_task(online.wait())
    await asyncio.wait({run, waiting}, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
    if not online.is_set():
        waiting.cancel()
        if run.done():
            run.result()  # raises what stopped the learner
        run.cancel()
        raise AssertionError(f"the learner did not go online within {TIMEOUT}s")
    new = [r for i in range(4) for r in group(f"new{i}", seed=70 + i, policy_version=6)]
    await produce(settings, new)
    result = await asyncio.wait_for(run, TIMEOUT)
    assert (result.step, result.version) == (8, 8)

    steps = read_steps(read_records(metrics))
    # 5 groups at K=2: steps of 2, 2 and the 1 left over, per epoch; then two live steps
    assert [(s["step"], s.get("epoch"), s["groups"]) for s in steps] == [
        (1, 1, 2), (2, 1, 2), (3, 1, 1), (4, 2, 2), (5, 2, 2), (6, 2, 1), (7, None, 2), (8, None, 2)]
    epochs = per_epoch(steps)
    for epoch in (1, 2):
        assert sorted(epochs[epoch]) == sorted(expected), f"epoch {epoch} trains each sample once"
    assert sorted(epochs[0]) == sorted(sample_ids(new)), "online: only what arrived after the run began"
    assert all(s["dropped"].get("stale", 0) == 0 for s in steps[:6]), "no staleness limit offline"
    assert steps[5]["dropped_total"] == {"record_duplicate_batch": 2}  # once per epoch
    manifest = latest_manifest(s3_client, settings.s3_bucket, f"{settings.namespace.rstrip('.')}/tiny")
    assert manifest["version"] == 8 and manifest["learner_step"] == 8


def test_offline_topic_range_resumes_after_sigkill_and_evaluates(settings, settings_env, s3_client, monkeypatch,
                                                                  tmp_path: Path) -> None:
    replay = replay_namespace(settings)
    records, expected = dataset("r", 6)
    run_sync(produce(replay, records, first_timestamp_ms=1_790_000_000_000))
    metrics = tmp_path / "metrics.jsonl"
    args = [*ARGS, "--offline", f"topic:{replay.topic('batches')}", "--epochs", "2", "--checkpoint-every", "2",
            "--metrics-path", str(metrics), "--workdir", str(tmp_path / "work")]
    learner = Learner(args, settings_env, tmp_path / "learner-1.log")
    try:
        learner.wait_for(r"ready: step 0 ", timeout=90)
        learner.wait_for(r"checkpoint v4 ")
        learner.wait_for(r"step 5 version 5 epoch 2")
    finally:
        learner.kill()
    # records after the range's end ("now" at the first start) are not part of the dataset
    run_sync(produce(replay, [r for i in range(2) for r in group(f"late{i}", seed=90 + i)]))

    learner = Learner(args, settings_env, tmp_path / "learner-2.log")
    try:
        learner.wait_for(r"ready: step 4 version 4", timeout=90)
        learner.wait_for(r"done: step 6 version 6")
        assert learner.wait(30) == 0
    finally:
        learner.stop()
    records = read_records(metrics)
    steps = read_steps(records)
    assert [(s["step"], s["epoch"]) for s in steps] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
    crashed_5, resumed_5 = [r for r in records if r.get("event") == "step" and r["step"] == 5]
    assert crashed_5["sample_ids"] == resumed_5["sample_ids"], "the same position in the epoch"
    assert abs(crashed_5["loss"] - resumed_5["loss"]) < 1e-6, "from the same weights and optimizer state"
    for epoch, trained in per_epoch(steps).items():
        assert len(trained) == len(set(trained)) and set(trained) == expected, f"epoch {epoch}"
        # the groups in the order they were produced (log time), whatever partitions their keys hash to
        assert list(dict.fromkeys(s.split("-")[0] for s in trained)) == [f"r{i}" for i in range(6)], f"epoch {epoch}"
    manifest = latest_manifest(s3_client, settings.s3_bucket, f"{settings.namespace.rstrip('.')}/tiny")
    assert manifest["version"] == 6

    # the demo's held-out evaluation of the policy trained offline: base model, then its newest checkpoint
    _, test = train_test(n_train=1, n_test=2, seed=3)
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(t) + "\n" for t in test))
    for name, value in settings_env.items():  # in this process: the command reads BOLTSTREAM_* like a shell's
        monkeypatch.setenv(name, value)
    assert evaluate_main(["--checkpoint-model", "tiny", "--model", "tiny", "--no-lora", "--test",
                          str(tmp_path / "test.jsonl"), "--eval-samples", "1", "--out", str(tmp_path / "eval")]) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert (summary["before"]["policy_version"], summary["after"]["policy_version"]) == (0, 6)
    assert summary["before"]["tasks"] == summary["after"]["tasks"] == 2
    assert abs(summary["improvement"] - (summary["after"]["score"] - summary["before"]["score"])) < 1e-9
