"""Collation to label positions, validation reasons, token-budget micro-batching."""

from __future__ import annotations

import math
from array import array

import pytest
import torch

from boltstream.learner.collate import (
    collate,
    micro_batches,
    sample_problem,
    scoring_temperature,
    split_by_token_budget,
    step_normaliser,
)
from boltstream.learner.losses import aggregate_loss, loss_normaliser
from boltstream.learner.tiny import random_samples
from boltstream.schemas import Codec


def _sample(ids, plen, mask, blp, adv=1.0, **kw):
    return {"sample_id": kw.pop("sample_id", "s"), "token_ids": ids, "prompt_length": plen, "loss_mask": mask,
            "behaviour_logprobs": blp, "advantage": adv, **kw}  # fmt: skip


def test_collate_shifts_to_label_positions_and_pads() -> None:
    a = _sample([5, 6, 7, 8], 2, [False, False, True, True], [0, 0, -0.5, -0.25], 2.0, loss_weight=0.5,
                policy_version=3, sample_id="a")  # fmt: skip
    b = _sample([9, 10, 11], 2, [False, False, True], [0, 0, -1.0], -1.0, sample_id="b")
    batch = collate([a, b], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    # label position t describes token t+1
    assert batch.labels.tolist() == [[6, 7, 8], [10, 11, 0]]
    assert batch.loss_mask.tolist() == [[False, True, True], [False, True, False]]
    assert batch.behaviour_logprobs.tolist() == [[0.0, -0.5, -0.25], [0.0, -1.0, 0.0]]
    assert batch.advantages.tolist() == [[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]]
    assert batch.weights.tolist() == [0.5, 1.0]
    assert batch.policy_versions.tolist() == [3, -1]
    assert batch.sample_ids == ["a", "b"]
    assert (batch.num_loss_tokens, batch.num_input_tokens) == (3, 7)
    assert batch.temperatures.tolist() == [1.0, 1.0]  # nothing recorded: scored at 1


def test_each_sample_is_scored_at_its_recorded_temperature() -> None:
    """Recorded T as is; not recorded (absent / None, a v1 record) and greedy (0) are scored at 1."""
    temps = [0.5, 1.25, None, 0.0, "absent"]
    samples = [_sample([1, 2, 3], 1, [False, True, True], [0, -1, -1], sample_id=str(i),
                       **({} if t == "absent" else {"temperature": t})) for i, t in enumerate(temps)]  # fmt: skip
    assert [scoring_temperature(s) for s in samples] == [0.5, 1.25, 1.0, 1.0, 1.0]
    assert collate(samples).temperatures.tolist() == [0.5, 1.25, 1.0, 1.0, 1.0]
    # micro-batching sorts by length: each row keeps its own sample's temperature
    short = _sample([1, 2], 1, [False, True], [0, -1], sample_id="short", temperature=0.5)
    long = _sample([1, 2, 3, 4], 1, [False, True, True, True], [0, -1, -1, -1], sample_id="long", temperature=0.75)
    (batch,) = micro_batches([short, long], max_tokens=100)
    assert dict(zip(batch.sample_ids, batch.temperatures.tolist(), strict=True)) == {"long": 0.75, "short": 0.5}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"loss_mask": [False, True]}, "length_mismatch"),
        ({"advantage": math.nan}, "nonfinite_advantage"),
        ({"loss_mask": [False, False, False, False]}, "no_loss_tokens"),
        ({"loss_mask": [False, True, True, True], "behaviour_logprobs": [0, -1, -1, -1]}, "loss_in_prompt"),
        ({"prompt_length": 9}, "bad_prompt_length"),
        ({"behaviour_logprobs": [0, 0, math.nan, -1]}, "bad_behaviour_logprob"),
        ({"behaviour_logprobs": [0, 0, 0.5, -1]}, "bad_behaviour_logprob"),
        ({"loss_weight": -1.0}, "bad_loss_weight"),
        ({"temperature": -0.5}, "bad_temperature"),
        ({"temperature": math.nan}, "bad_temperature"),
        ({"temperature": math.inf}, "bad_temperature"),
        ({"temperature": "hot"}, "bad_temperature"),
        ({"token_ids": [1, 2, 3, 99]}, "token_out_of_vocab"),
        ({"token_ids": None}, "missing_field"),
    ],
)
def test_sample_problem_reasons(change: dict, reason: str) -> None:
    good = _sample([1, 2, 3, 4], 2, [False, False, True, True], [0, 0, -1.0, -1.0])
    assert sample_problem(good, vocab_size=10) is None
    for temperature in (None, 0.0, 0.7, 2):
        assert sample_problem({**good, "temperature": temperature}, vocab_size=10) is None
    assert sample_problem({**good, **change}, vocab_size=10) == reason
    # The same sample as the codec decodes it (array.array payloads) gets the same verdict.
    assert sample_problem(_decoded({**good, **change}), vocab_size=10) == reason


def _decoded(sample: dict) -> dict:
    kinds = {"token_ids": "i", "loss_mask": "B", "behaviour_logprobs": "f"}
    return {k: array(kinds[k], v) if k in kinds and isinstance(v, list) else v for k, v in sample.items()}


def test_collate_builds_the_same_tensors_from_decoded_samples() -> None:
    """A TrainingBatch through the codec (packed bytes -> array.array) collates exactly like lists."""
    samples = random_samples(4, vocab_size=50, seed=3)
    codec = Codec()
    batch = {"batch_id": "b", "task_id": "t", "samples": samples, "group_size": 4, "num_rollouts": 4,
             "reward_mean": 0.0, "reward_std": 1.0}
    decoded = codec.decode(codec.encode("TrainingBatch", batch))["samples"]
    assert isinstance(decoded[0]["token_ids"], array)
    want, got = collate(samples), collate(decoded)
    for name in ("input_ids", "attention_mask", "labels", "loss_mask", "behaviour_logprobs", "advantages"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    assert [sample_problem(s, vocab_size=50) for s in decoded] == [None] * 4


def test_split_respects_budget_and_keeps_every_sample_once() -> None:
    samples = random_samples(23, min_len=3, max_len=30, seed=4)
    groups = split_by_token_budget(samples, 64)
    ids = [s["sample_id"] for g in groups for s in g]
    assert sorted(ids) == sorted(s["sample_id"] for s in samples)
    for g in groups:
        assert len(g) * max(len(s["token_ids"]) for s in g) <= 64
    # a sample above the budget travels alone
    big = random_samples(1, min_len=50, max_len=50, seed=1)
    groups = split_by_token_budget(big + samples[:3], 40)
    assert [len(g) for g in groups][0] == 1 and groups[0][0] is big[0]
    with pytest.raises(ValueError):
        split_by_token_budget(samples, 0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batched_loss_sums_to_single_batch_loss(mode: str) -> None:
    """Same per-token loss (a deterministic function of the labels), aggregated over one
    batch vs. summed over token-budget micro-batches with the step normaliser."""
    samples = random_samples(11, seed=9)
    for i, s in enumerate(samples):
        s["loss_weight"] = 0.25 + 0.1 * i

    def batch_loss(batch, norm=None):
        per_token = torch.sin(batch.labels.float()) * batch.advantages
        return aggregate_loss(per_token, batch.loss_mask, mode, batch.weights, norm)

    whole = collate(samples)
    parts = micro_batches(samples, max_tokens=40)
    assert len(parts) > 3
    norm = step_normaliser(samples, mode)
    assert norm == float(loss_normaliser(whole.loss_mask, mode))
    total = sum(batch_loss(b, norm) for b in parts)
    assert float(total) == pytest.approx(float(batch_loss(whole)), abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_step_normaliser_of_raw_samples_is_the_collated_one(mode: str) -> None:
    """The step (and each DeepSpeed rank) sizes its loss from raw samples: the same denominator as
    the collated batch's mask, including a sample with nothing to train (hand count: token-mean
    3 + 0 + 1 = 4, sequence modes 2)."""
    samples = [_sample([1, 2, 3, 4], 1, [True, True, True, True], [0.0] * 4),
               _sample([1, 2, 3], 1, [True, False, False], [0.0] * 3),
               _sample([5, 6], 1, [False, True], [0.0, -0.1])]
    assert step_normaliser(samples, mode) == float(loss_normaliser(collate(samples).loss_mask, mode))
    assert step_normaliser(samples, mode) == (4.0 if mode == "token-mean" else 2.0)
