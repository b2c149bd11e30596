"""The DeepSpeed backend runs prefix trees: one ZeRO-1 rank (gloo, loopback) on samples that share
prefixes, split into several micro-batches, takes the same step as the plain torch learner running
flat (loss, gradient norm, weights)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from boltstream.learner.config import LearnerConfig, StepConfig
from boltstream.learner.tiny import shared_prefix_samples
from boltstream.learner.trainer import TorchTrainer

pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")


def test_one_rank_tree_step_equals_the_flat_torch_step(tmp_path) -> None:
    from boltstream.learner.deepspeed_backend import DeepSpeedTrainer

    # lr 1e-5: Adam's first update is ~lr * sign(g), so weights can differ by 2 lr where a gradient
    # element sits at rounding level; the loss and gradient norm are compared tightly instead
    cfg = LearnerConfig(model="tiny", lr=1e-5, lr_warmup_steps=0, workdir=str(tmp_path),
                        step=StepConfig(max_tokens_per_micro_batch=40))
    samples = shared_prefix_samples(64, seed=5)
    flat = TorchTrainer(dataclasses.replace(cfg, step=dataclasses.replace(cfg.step, prefix_tree=False)))
    flat_m = flat.step(samples)
    ds = DeepSpeedTrainer(dataclasses.replace(cfg, deepspeed=True))
    try:
        assert ds.plan.tree
        tree_m = ds.step(samples)
    finally:
        ds.close()
    assert tree_m.micro_batches > 1 and tree_m.unique_tokens < tree_m.input_tokens == flat_m.input_tokens
    assert flat_m.unique_tokens == flat_m.input_tokens
    assert tree_m.loss == pytest.approx(flat_m.loss, abs=1e-6)
    assert tree_m.grad_norm == pytest.approx(flat_m.grad_norm, rel=1e-4)
    moved = 0
    for (name, p), q in zip(ds.model.named_parameters(), flat.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=3e-5, msg=name)
        moved += int(p.requires_grad)
    assert moved
