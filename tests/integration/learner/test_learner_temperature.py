"""``boltstream learn`` with no temperature flag scores each sample at the temperature it was sampled at.

A GRPO group really sampled at T = 0.7 by the inference worker (tiny model, seed 0) and turned into a
TrainingBatch by the stream app's code goes onto the real broker; a learner process on the same
tiny model takes its first step, on-policy: the ratio in its metrics JSONL is 1. Before samples
carried their temperature, this learner scored at 1.0 and the ratio went far from 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from boltstream.learner.metrics import read_records, read_steps
from tests.integration.learner.helpers import Learner, produce
from tests.unit.learner.sampled_calls import sampled_batch


async def test_learner_scores_at_the_recorded_temperature(settings, settings_env, s3_client, tmp_path: Path) -> None:
    batch = sampled_batch("t-hot", 4, 0.7)
    assert {s["temperature"] for s in batch["samples"]} == {0.7}
    await produce(settings, [batch])
    metrics = tmp_path / "metrics.jsonl"
    args = ["--model", "tiny", "--groups-per-step", "1", "--max-steps", "1", "--poll-ms", "100",
            "--metrics-path", str(metrics), "--workdir", str(tmp_path / "work")]  # fmt: skip
    learner = Learner(args, settings_env, tmp_path / "learner.log")
    try:
        learner.wait_for(r"done: step 1 ", timeout=120)
        assert learner.wait(30) == 0
    finally:
        learner.stop()
    (step,) = read_steps(read_records(metrics))
    assert sorted(step["sample_ids"]) == sorted(s["sample_id"] for s in batch["samples"])
    assert step["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert step["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert step["clip_fraction"] == 0.0
