"""A learner SIGKILLed after a checkpoint and restarted ends where an uninterrupted run ends.

Exact resume is more than "every sample trained once" (test_learner_crash.py): the restarted
learner must take the SAME steps (same sample ids, in the same order) and reach the SAME
weights, bit for bit, at the same step. Both runs read one batches topic (the learner reads it
without a consumer group, so two runs do not interfere) under their own ``--run`` prefix in
S3; the records are all on one partition so the arrival order, hence the steps, is fixed, and
CPU training with the same seed is deterministic. The crashed run sees the first 6 groups,
checkpoints at step 2, steps once more and is killed while it waits for data; the rest is
produced and it resumes from v2. The uninterrupted run reads all 8 groups in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from boltstream.learner.metrics import read_records, read_steps
from boltstream.weights.checkpoints import fetch_checkpoint, latest_manifest, s3_uri, version_prefix
from tests.integration.learner.helpers import Learner, group, produce

STEPS = 4
ARGS = ["--model", "tiny", "--groups-per-step", "2", "--checkpoint-every", "2", "--keep-last", "10",
        "--max-staleness", "none", "--lr", "1e-3", "--max-steps", str(STEPS), "--poll-ms", "100"]
# What a step's numbers must match exactly (wall-clock fields and the RSS obviously differ).
EXACT = ("step", "version", "loss", "grad_norm", "approx_kl", "entropy", "ratio_mean", "clip_fraction",
         "advantage_mean", "loss_tokens", "input_tokens", "samples", "lr", "batch_ids", "sample_ids")


def _args(tmp_path: Path, run: str) -> list[str]:
    return [*ARGS, "--run", run, "--metrics-path", str(tmp_path / f"{run.rsplit('/', 1)[-1]}.jsonl"),
            "--workdir", str(tmp_path / run.rsplit("/", 1)[-1])]


def _weights(s3_client: Any, bucket: str, run: str, version: int, dest: Path) -> dict[str, torch.Tensor]:
    manifest = s3_uri(bucket, version_prefix(run, version) + "manifest.json")
    directory = fetch_checkpoint(s3_client, manifest, dest)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    assert tensors, f"no tensors in {run} v{version}"
    return tensors


async def test_resumed_learner_matches_an_uninterrupted_run(settings, settings_env, s3_client,
                                                            tmp_path: Path) -> None:
    ns = settings.namespace.rstrip(".")
    straight, crashed = f"{ns}/straight", f"{ns}/crashed"
    groups = [group(f"g{i}", seed=i) for i in range(2 * STEPS)]
    await produce(settings, [r for g in groups[:6] for r in g], partition=0)

    learner = Learner(_args(tmp_path, crashed), settings_env, tmp_path / "crashed-1.log")
    try:
        learner.wait_for(r"checkpoint v2 ")
        learner.wait_for(r"step 3 version 3")  # no data for step 4 yet: it waits, and dies here
    finally:
        learner.kill()

    await produce(settings, [r for g in groups[6:] for r in g], partition=0)
    for run, log in ((crashed, "crashed-2.log"), (straight, "straight.log")):
        learner = Learner(_args(tmp_path, run), settings_env, tmp_path / log)
        try:
            learner.wait_for(r"ready: step 2 version 2" if run == crashed else r"ready: step 0 ", timeout=120)
            learner.wait_for(rf"done: step {STEPS} version {STEPS}", timeout=180)
            assert learner.wait(30) == 0
        finally:
            learner.stop()

    crashed_records = read_records(tmp_path / "crashed.jsonl")
    assert [r["step"] for r in crashed_records if r["event"] == "resume"] == [0, 2], "started fresh, resumed at 2"
    runs = {name: read_steps(read_records(tmp_path / f"{name}.jsonl")) for name in ("straight", "crashed")}
    assert [s["step"] for s in runs["straight"]] == [s["step"] for s in runs["crashed"]] == list(range(1, STEPS + 1))
    for a, b in zip(runs["straight"], runs["crashed"], strict=True):
        assert {k: a.get(k) for k in EXACT} == {k: b.get(k) for k in EXACT}, f"step {a['step']} differs"
    # the step the crash threw away was taken again identically by the resumed learner
    lost_step3 = [r for r in crashed_records if r["event"] == "step" and r["step"] == 3][0]
    assert {k: lost_step3.get(k) for k in EXACT} == {k: runs["straight"][2].get(k) for k in EXACT}

    for version in (2, STEPS):
        a = _weights(s3_client, settings.s3_bucket, straight, version, tmp_path / f"straight-v{version}")
        b = _weights(s3_client, settings.s3_bucket, crashed, version, tmp_path / f"crashed-v{version}")
        assert a.keys() == b.keys()
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"v{version}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    assert latest_manifest(s3_client, settings.s3_bucket, crashed)["version"] == STEPS
    # the weights moved: an equality of two untrained models would prove nothing
    first = _weights(s3_client, settings.s3_bucket, straight, 2, tmp_path / "straight-v2b")
    assert any(not torch.equal(first[k], a[k]) for k in a)
