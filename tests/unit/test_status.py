"""``boltstream status``'s pure parts: lag arithmetic, newest checkpoint per model, metric parsing, input checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boltstream.errors import BoltstreamError
from boltstream.monitoring.status import (
    UNKNOWN,
    format_report,
    group_lag,
    latest_checkpoints,
    learner_lag,
    main,
    metric_values,
    run_workers,
)


def test_group_lag_covers_every_partition_of_the_topics_the_group_committed_on() -> None:
    ends = {("n.spans", 0): 10, ("n.spans", 1): 4, ("n.spans", 2): 3, ("n.tasks", 0): 7}
    committed = {("n.spans", 0): 6, ("n.spans", 1): 4, ("n.spans", 2): 0, ("n.tasks", 0): None, ("n.gone", 0): 3}
    lag = group_lag(ends, committed)
    assert lag == {"n.spans": {"lag": 7, "partitions": {"0": {"committed": 6, "end": 10, "lag": 4},
                                                        "1": {"committed": 4, "end": 4, "lag": 0},
                                                        "2": {"committed": 0, "end": 3, "lag": 3}}}}


def test_latest_checkpoint_per_model_and_the_learners_lag() -> None:
    events = [{"model": "policy", "version": 2, "learner_step": 2, "offsets": [{"topic": "n.batches", "partition": 0,
                                                                                "offset": 5}]},
              {"model": "policy", "version": 1, "learner_step": 1, "offsets": []},
              {"model": "other", "version": 1, "learner_step": 3}]
    latest = latest_checkpoints(events)
    assert latest["policy"]["version"] == 2 and latest["policy"]["learner_step"] == 2
    assert latest["other"]["learner_step"] == 3
    assert learner_lag(latest["policy"]["offsets"], {("n.batches", 0): 9}) == 4
    assert learner_lag(latest["other"]["offsets"], {("n.batches", 0): 9}) is None


def test_metric_values_sum_the_series_status_reads() -> None:
    text = ("# TYPE boltstream_learner_step gauge\nboltstream_learner_step{model=\"policy\"} 3.0\n"
            "# TYPE boltstream_exporter_spool_pending gauge\n"
            "boltstream_exporter_spool_pending{topic=\"a\"} 2.0\nboltstream_exporter_spool_pending{topic=\"b\"} 1.0\n"
            "# TYPE other gauge\nother 5.0\n")
    assert metric_values(text) == {"learner_step": 3.0, "runner_spool_pending": 3.0}


def test_run_workers_reads_the_train_runs_endpoints(tmp_path: Path) -> None:
    (tmp_path / "endpoints.json").write_text(json.dumps({"workers": ["http://127.0.0.1:8123"]}))
    assert run_workers(tmp_path) == ["http://127.0.0.1:8123"]
    (tmp_path / "endpoints.json").write_text("[]")
    with pytest.raises(BoltstreamError, match="not a run's endpoints file"):
        run_workers(tmp_path)
    with pytest.raises(BoltstreamError, match="no endpoints.json"):
        run_workers(tmp_path / "missing")


def test_bad_urls_are_refused_before_the_broker_is_asked() -> None:
    with pytest.raises(BoltstreamError, match="--worker '127.0.0.1:8000': not an http"):
        main(["--worker", "127.0.0.1:8000", "--bootstrap-servers", "127.0.0.1:1"])


def test_the_report_says_unknown_rather_than_failing() -> None:
    text = format_report({"bootstrap_servers": "b:1", "namespace": "n.", "topics": {"n.spans": {"records_end": 3}},
                          "groups": {"n.stream": {"lag": UNKNOWN, "error": "KafkaError: no"}},
                          "learner": {"error": f"{UNKNOWN}: boom"},
                          "workers": [{"url": "http://w", "healthy": False, "error": "refused"}], "metrics": []})
    assert "n.stream: lag unknown (KafkaError: no)" in text
    assert "unknown: boom" in text and "http://w: UNHEALTHY refused" in text
