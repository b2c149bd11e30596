"""Acceptance: calls sampled at T = 0.7 are scored at 0.7 by a learner that was told no temperature.

The whole path is production code (:mod:`tests.unit.learner.sampled_calls`): the inference worker
samples at T = 0.7 and captures the spans, the stream app's functions make the TrainingBatch, which
goes through the Avro codec; the learner takes one step with the default ``StepConfig``. On-policy
(same weights), the importance ratio must be 1. The same samples scored at T = 1 (what a
learner-wide default did) are clearly off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from boltstream.learner.step import StepConfig, evaluate_loss, train_step
from boltstream.schemas import Codec
from boltstream.weights.models import tiny_model_and_tokenizer
from tests.unit.learner.sampled_calls import sampled_batch

TEMPERATURE = 0.7
ATTEMPTS = 4


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    codec = Codec()
    data = codec.encode("TrainingBatch", sampled_batch("t-temp", ATTEMPTS, TEMPERATURE), topic="batches")
    return codec.decode(data, expect="TrainingBatch")["samples"]


def test_the_sampling_temperature_travels_from_the_span_to_the_sample(samples: list[dict[str, Any]]) -> None:
    assert len(samples) == ATTEMPTS
    assert {s["temperature"] for s in samples} == {TEMPERATURE}
    assert {s["advantage"] > 0 for s in samples} == {True, False}  # a real GRPO group, not all zeros


def test_first_on_policy_step_has_ratio_one_at_the_recorded_temperature(samples: list[dict[str, Any]]) -> None:
    model, _ = tiny_model_and_tokenizer(0)  # the weights the worker sampled with
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = train_step(model, optimizer, samples, StepConfig())  # defaults: nobody names a temperature
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-3)
    assert metrics.ratio_max == pytest.approx(1.0, abs=1e-3)
    assert metrics.clip_fraction == 0.0 and not metrics.skipped


def test_the_same_tokens_scored_at_one_are_off_policy(samples: list[dict[str, Any]]) -> None:
    """The control: what the learner measured before it read the temperature from the samples."""
    model, _ = tiny_model_and_tokenizer(0)
    at_one = evaluate_loss(model, [{**s, "temperature": None} for s in samples], StepConfig())
    assert at_one.ratio_max > 1.5
    assert at_one.clip_fraction > 0.1
