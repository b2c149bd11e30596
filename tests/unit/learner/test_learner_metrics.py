"""Step records, the JSONL history across a resume, Prometheus exposure (loopback), the plot."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from pathlib import Path

from boltstream.learner.cli import main
from boltstream.learner.groups import Group, StepInput
from boltstream.learner.metrics import MetricsSink, format_step, read_records, read_steps, step_record
from boltstream.learner.plot import plot_metrics
from boltstream.learner.step import StepMetrics


def _metrics(loss: float = 0.5) -> StepMetrics:
    return StepMetrics(loss=loss, clip_fraction=0.1, approx_kl=0.01, ref_kl=0.0, entropy=2.0, ratio_mean=1.0,
                       ratio_max=1.3, is_weight_mean=1.0, is_truncated_fraction=0.0, grad_norm=float("nan"),
                       advantage_mean=0.0, advantage_std=1.0, loss_tokens=30, input_tokens=100, samples=2,
                       micro_batches=1, seconds=0.5, tokens_per_s=200.0)


def _input(ids: list[str]) -> StepInput:
    samples = [{"sample_id": i, "advantage": a, "reward": r} for i, a, r in zip(ids, (1.0, -1.0), (1.0, 0.0),
                                                                                strict=False)]
    return StepInput(groups=[Group("b1", "t1", samples, [(0, 0)], reward_mean=0.5)], samples=samples,
                     staleness=Counter({"0": 1, "2": 1}), dropped=Counter({"stale": 1}))


def test_step_record_is_plain_json_with_ids_staleness_and_drops() -> None:
    r = step_record(3, 3, _metrics(), _input(["s1", "s2"]), wall_seconds=2.0,
                    dropped_total={"stale": 4, "record_undecodable": 1})
    assert r["sample_ids"] == ["s1", "s2"] and r["batch_ids"] == ["b1"]
    assert r["grad_norm"] is None, "NaN is not JSON"
    assert (r["reward_mean"], r["advantage_min"], r["advantage_max"]) == (0.5, -1.0, 1.0)
    assert r["staleness"] == {"0": 1, "2": 1} and r["dropped"] == {"stale": 1}
    assert r["wall_tokens_per_s"] == 50.0
    assert 10 < r["peak_rss_mb"] < 1e6  # this test process: tens of MiB at least, never KiB read as MiB
    json.dumps(r, allow_nan=False)
    assert "step 3 v3" in format_step(r) and "gnorm nan" in format_step(r)


def test_history_after_a_resume_replaces_the_steps_of_the_crashed_run() -> None:
    lines = [{"event": "resume", "step": 0}] + [{"event": "step", "step": s, "run": 1} for s in (1, 2, 3)]
    lines += [{"event": "checkpoint", "step": 2}, {"event": "resume", "step": 2},
              {"event": "step", "step": 3, "run": 2}]
    assert [(r["step"], r["run"]) for r in read_steps(lines)] == [(1, 1), (2, 1), (3, 2)]


def test_sink_appends_jsonl_and_serves_prometheus_on_loopback(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = MetricsSink(path, port=0, model_name="tiny")
    try:
        sink.sync_dropped({"stale": 2})  # baseline restored from a checkpoint
        sink.step(step_record(1, 1, _metrics(0.25), _input(["a", "b"]), wall_seconds=1.0,
                              dropped_total={"stale": 3, "record_undecodable": 1}))
        sink.event("checkpoint", step=1, version=1)
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()
    assert 'boltstream_learner_loss{model="tiny"} 0.25' in body
    assert 'boltstream_learner_samples_dropped_total{model="tiny",reason="stale"} 1.0' in body
    assert 'boltstream_learner_samples_dropped_total{model="tiny",reason="record_undecodable"} 1.0' in body
    assert 'boltstream_learner_sample_staleness_count{model="tiny"} 2.0' in body
    assert 'boltstream_learner_checkpoints_total{model="tiny"} 1.0' in body
    path.write_text(path.read_text() + '{"event": "st')  # a line torn by a SIGKILL
    assert [r["event"] for r in read_records(path)] == ["step", "checkpoint"]


def test_plot_renders_a_png_from_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = MetricsSink(path)
    for s in range(1, 6):
        sink.step(step_record(s, s, _metrics(1.0 / s), _input(["a", "b"]), wall_seconds=1.0, dropped_total={}))
    sink.event("checkpoint", step=4, version=4)
    sink.close()
    assert main(["--plot", str(path), str(tmp_path / "out.png")]) == 0
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(path, tmp_path / "sub" / "again.png").stat().st_size > 10_000
