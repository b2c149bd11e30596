"""``--report-to``: names parsed, records flattened, every backend's output read back with its own
reader, and a tracker that fails is switched off without touching the others."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from boltstream.errors import ConfigError
from boltstream.learner.config import load_config
from boltstream.monitoring import tracking
from boltstream.monitoring.tracking import Trackers, open_trackers, parse_report_to, scalars
from tests.tracking_readers import (
    mlflow_history,
    mlflow_runs,
    tensorboard_scalars,
    tensorboard_text,
    wandb_run,
)


def test_report_to_names() -> None:
    assert parse_report_to("none") == ()
    assert parse_report_to("") == ()
    assert parse_report_to(" TensorBoard, mlflow,tensorboard ") == ("tensorboard", "mlflow")
    with pytest.raises(ConfigError, match="comet.*one of tensorboard, wandb, mlflow or none"):
        parse_report_to("tensorboard,comet")


def test_learner_config_field_from_flag_and_env() -> None:
    assert load_config({}, env={}).report_to == ()
    assert load_config({}, env={"BOLTSTREAM_LEARN_REPORT_TO": "wandb,none"}).report_to == ("wandb",)
    assert load_config({"report_to": "mlflow"}, env={}).report_to == ("mlflow",)
    with pytest.raises(ConfigError, match="report_to"):
        load_config({"report_to": "tensorbored"}, env={})
    cfg = load_config({"metrics_path": "out/x/metrics.jsonl"}, env={})
    assert cfg.tracking_path == Path("out/x/tracking")
    assert load_config({"tracking_dir": "tb"}, env={}).tracking_path == Path("tb")
    assert load_config({"model": "tiny"}, env={}).tracking_path == Path("runs/tiny")


def test_missing_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(tracking._NEEDS, "wandb", ("no_such_module_here", "wandb"))
    with pytest.raises(ConfigError, match=r'pip install "boltstream\[wandb\]"'):
        open_trackers(["wandb"], "unused", "run")


def test_scalars_keep_finite_numbers_and_nest_dicts() -> None:
    record = {"loss": 0.5, "n": 3, "ok": True, "bad": float("nan"), "ids": ["a"], "name": "x",
              "staleness": {"0": 4, "1": 2}}
    assert scalars(record) == {"loss": 0.5, "n": 3.0, "ok": 1.0, "staleness/0": 4.0, "staleness/1": 2.0}


class Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log_params(self, params) -> None:
        self.calls += 1
        raise RuntimeError("disk full")

    def log_metrics(self, metrics, step) -> None:
        self.calls += 1
        raise RuntimeError("disk full")

    def close(self) -> None:
        self.calls += 1


class Kept:
    name = "kept"

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.closed = False

    def log_params(self, params) -> None:
        pass

    def log_metrics(self, metrics, step) -> None:
        self.rows.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_is_logged_once_and_switched_off(caplog) -> None:
    broken, kept = Broken(), Kept()
    trackers = Trackers([broken, kept])
    with caplog.at_level(logging.ERROR, logger="boltstream.monitoring.tracking"):
        trackers.log_params({"lr": 1})
        trackers.log_metrics({"loss": 1.0}, 1)
        trackers.log_metrics({"loss": 0.5}, 2)
        trackers.close()
    assert broken.calls == 1, "never called again after its first error"
    assert kept.rows == [(1, {"loss": 1.0}), (2, {"loss": 0.5})] and kept.closed
    assert [r.message for r in caplog.records] == [
        "broken tracker failed in log_params: it is off for the rest of this run"]


def test_every_backend_round_trips(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers = open_trackers("tensorboard,wandb,mlflow", tmp_path, "learner", group="ns/policy")
    assert [t.name for t in trackers.trackers] == ["tensorboard", "wandb", "mlflow"]
    trackers.log_params({"lr": 0.001, "lora_targets": ["q_proj", "v_proj"], "step": {"clip_low": 0.2}})
    trackers.log_metrics({"loss": 1.5, "staleness": {"0": 8}, "sample_ids": ["a"]}, 1)
    trackers.log_metrics({"loss": 1.25, "staleness": {"1": 6}}, 2)
    trackers.close()

    tb = tensorboard_scalars(tmp_path / "tensorboard" / "learner")
    assert tb["loss"] == [(1, 1.5), (2, 1.25)] and tb["staleness/0"] == [(1, 8.0)]
    assert "lr: 0.001" in tensorboard_text(tmp_path / "tensorboard" / "learner")

    run = mlflow_runs(tmp_path / "mlruns")["learner"]
    assert run.data.params == {"lr": "0.001", "lora_targets": '["q_proj", "v_proj"]', "step/clip_low": "0.2"}
    assert mlflow_history(tmp_path / "mlruns", run.info.run_id, "loss") == [(1, 1.5), (2, 1.25)]
    assert run.data.tags["boltstream.group"] == "ns/policy" and run.info.status == "FINISHED"

    wb = wandb_run(tmp_path)
    assert (wb["name"], wb["group"]) == ("learner", "ns/policy")
    assert wb["config"]["lr"] == 0.001 and wb["config"]["step"] == {"clip_low": 0.2}
    assert {s: row["loss"] for s, row in wb["history"].items()} == {1: 1.5, 2: 1.25}
    assert wb["history"][2]["staleness/1"] == 6
