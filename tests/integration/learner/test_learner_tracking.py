"""``boltstream learn --report-to tensorboard,wandb,mlflow``: a real learner (tiny model, real broker)
takes two steps, and each tracker holds the loss and reward of each step that metrics.jsonl holds,
and the resolved config, as its own reader reads them back (W&B offline, no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from boltstream.learner.metrics import read_records, read_steps
from tests.integration.learner.helpers import Learner, group, produce
from tests.tracking_readers import mlflow_history, mlflow_runs, tensorboard_scalars, wandb_run


async def test_learner_reports_every_step_to_each_tracker(settings, settings_env, s3_client, tmp_path: Path) -> None:
    await produce(settings, [r for i in range(4) for r in group(f"t{i}", seed=i)], partition=0)
    metrics = tmp_path / "out" / "metrics.jsonl"
    args = ["--model", "tiny", "--groups-per-step", "2", "--max-steps", "2", "--poll-ms", "100", "--lr", "1e-3",
            "--metrics-path", str(metrics), "--workdir", str(tmp_path / "work"), "--model-name", "tracked"]
    env = {**settings_env, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "BOLTSTREAM_LEARN_REPORT_TO": "tensorboard,wandb,mlflow"}  # the variable, as a deployment sets it
    env.pop("MLFLOW_TRACKING_URI", None)
    learner = Learner(args, env, tmp_path / "learner.log")
    try:
        learner.wait_for(r"done: step 2 ", timeout=180)
        assert learner.wait(60) == 0
    finally:
        learner.stop()
    steps = read_steps(read_records(metrics))
    expected = {key: [(s["step"], s[key]) for s in steps] for key in ("loss", "reward_mean", "entropy")}
    assert [s for s, _ in expected["loss"]] == [1, 2]
    tracking = tmp_path / "out" / "tracking"  # the default: next to the metrics file

    tb = tensorboard_scalars(tracking / "tensorboard" / "tracked")
    for key, rows in expected.items():
        assert [(s, pytest.approx(v, rel=1e-6)) for s, v in rows] == tb[key], key
    assert {"clip_fraction", "approx_kl", "tokens_per_s", "advantage_std", "staleness/0"} <= set(tb)

    run = mlflow_runs(tracking / "mlruns")["tracked"]
    for key, rows in expected.items():
        assert mlflow_history(tracking / "mlruns", run.info.run_id, key) == [(s, pytest.approx(v)) for s, v in rows]
    assert run.data.params["groups_per_step"] == "2" and run.data.params["report_to"] == \
        '["tensorboard", "wandb", "mlflow"]'

    wb = wandb_run(tracking)
    assert wb["name"] == "tracked" and wb["config"]["max_steps"] == 2
    for key, rows in expected.items():
        assert [(s, wb["history"][s][key]) for s, _ in rows] == [(s, pytest.approx(v)) for s, v in rows], key
