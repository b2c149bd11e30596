"""The step timeline's split, against hand-computed values, and the worker counters it reads."""

from __future__ import annotations

import pytest

from boltstream.learner import timeline

EXPOSITION = """\
# HELP boltstream_inference_busy_seconds_total seconds the generation thread spent running batches
# TYPE boltstream_inference_busy_seconds_total counter
boltstream_inference_busy_seconds_total 30.5
boltstream_inference_decode_steps_total 200.0
boltstream_inference_decode_rows_total 2400.0
boltstream_inference_prefill_tokens_computed_total 5000.0
boltstream_inference_completion_tokens_total{model="policy"} 2000.0
boltstream_inference_reload_seconds_sum{kind="lora"} 1.5
boltstream_inference_reload_seconds_sum{kind="full"} 0.5
boltstream_inference_reload_seconds_count{kind="lora"} 3.0
boltstream_inference_spans_total 99.0
"""


def test_counters_are_read_from_the_exposition_with_label_sets_summed() -> None:
    c = timeline.parse_counters(EXPOSITION)
    assert c == {"busy_s": 30.5, "decode_steps": 200.0, "decode_rows": 2400.0, "prefill_tokens": 5000.0,
                 "decode_tokens": 2000.0, "reload_s": 2.0, "reloads": 3.0}


def test_a_step_window_is_split_into_generation_learning_publishing_reload_and_idle() -> None:
    before = {"busy_s": 10.0, "decode_steps": 100, "decode_rows": 1000, "prefill_tokens": 3000, "decode_tokens": 900,
              "reload_s": 1.0, "reloads": 1}
    after = {"busy_s": 30.0, "decode_steps": 150, "decode_rows": 1600, "prefill_tokens": 3500, "decode_tokens": 1500,
             "reload_s": 1.5, "reloads": 2}
    t = timeline.step_timeline(40.0, 8.0, 1.0, before, after)
    # 40 s: 20 generating, 8 learning, 1 publishing, 0.5 reloading -> 10.5 s nobody worked
    assert t == {"window_s": 40.0, "learner_compute_s": 8.0, "checkpoint_publish_s": 1.0, "learner_wait_s": 31.0,
                 "generation_busy_s": 20.0, "worker_busy_share": 0.5, "decode_steps": 50,
                 "mean_decode_batch": 12.0, "prefill_tokens": 500, "decode_tokens": 600, "reload_s": 0.5,
                 "idle_s": pytest.approx(10.5)}
    assert "generate 20.0s (50% busy, decode batch 12.0, 500 prefill + 600 decode tokens)" in \
        timeline.format_timeline(t)


def test_without_the_workers_counters_only_the_learners_part_is_reported() -> None:
    t = timeline.step_timeline(10.0, 12.0, 0.5, None, {"busy_s": 1.0})
    assert t == {"window_s": 10.0, "learner_compute_s": 12.0, "checkpoint_publish_s": 0.5, "learner_wait_s": 0.0}
    assert timeline.format_timeline(t) == "10.0s | learn 12.0s | publish 0.5s | wait 0.0s"


def test_a_runs_totals_add_seconds_and_recompute_shares() -> None:
    zero = dict.fromkeys(timeline.WORKER_SERIES, 0.0)
    a = timeline.step_timeline(10.0, 2.0, 0.0, zero, dict(zero, busy_s=5.0, decode_steps=10, decode_rows=160))
    b = timeline.step_timeline(30.0, 4.0, 1.0, zero, dict(zero, busy_s=5.0, decode_steps=30, decode_rows=120))
    total = timeline.totals([a, b])
    assert total["window_s"] == 40.0 and total["generation_busy_s"] == 10.0 and total["worker_busy_share"] == 0.25
    assert total["mean_decode_batch"] == pytest.approx(280 / 40)  # (16 x 10 + 4 x 30) rows over 40 steps
    assert timeline.totals([]) == {}


def test_a_worker_that_does_not_answer_gives_no_partial_sum() -> None:
    assert timeline.scrape(["http://127.0.0.1:9"], timeout=0.5) is None
