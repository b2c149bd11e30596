"""The DeepSpeed ZeRO backend on CPU (gloo, loopback): one rank with a resume, and two ranks.

Groups go to one partition, so every run sees the same steps in the same order, and the
weights DeepSpeed publishes must match the plain torch learner's on the same data: the
per-rank loss scaling makes the averaged gradient that of one big batch, and a resumed
ZeRO optimizer state continues exactly where it stopped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from boltstream.learner.config import LearnerConfig
from boltstream.learner.loop import train
from boltstream.learner.metrics import read_records, read_steps
from boltstream.processes import free_port
from boltstream.weights.checkpoints import fetch_checkpoint, latest_manifest
from boltstream.weights.models import load_model
from tests.integration.learner.helpers import Learner, group, produce

pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")

COMMON = ["--model", "tiny", "--groups-per-step", "2", "--lr", "1e-3", "--max-staleness", "none",
          "--poll-ms", "100", "--deepspeed"]


async def _reference(settings, tmp_path: Path, steps: int) -> torch.nn.Module:
    """The plain torch learner on the same data (its own run prefix)."""
    cfg = LearnerConfig(settings=settings, model="tiny", groups_per_step=2, lr=1e-3, max_staleness=None,
                        max_steps=steps, checkpoint_every=100, run=f"{settings.namespace}reference", poll_ms=100,
                        workdir=str(tmp_path / "ref"))
    return (await asyncio.wait_for(train(cfg), 60)).trainer.model


def _published(settings, s3_client, run: str, version: int, dest: Path) -> torch.nn.Module:
    manifest = latest_manifest(s3_client, settings.s3_bucket, run)
    assert manifest["version"] == version and manifest["extra"]["backend"] == "deepspeed"
    model, _ = load_model(str(fetch_checkpoint(s3_client, f"s3://{settings.s3_bucket}/{run}/v{version}/manifest.json",
                                               dest)))
    return model


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5, msg=name)


def _rank_env(env: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}


async def test_one_rank_zero1_checkpoints_and_resumes_its_optimizer_exactly(
        settings, settings_env, s3_client, tmp_path: Path) -> None:
    await produce(settings, [r for i in range(4) for r in group(f"d{i}", seed=i)], partition=0)
    run = f"{settings.namespace}ds1"
    args = [*COMMON, "--zero-stage", "1", "--run", run, "--checkpoint-every", "1",
            "--metrics-path", str(tmp_path / "m.jsonl"), "--workdir", str(tmp_path / "w")]
    env = {**settings_env, "MASTER_PORT": str(free_port())}  # alone: the learner fills in the rest
    for steps in ("1", "2"):  # stop after step 1, then resume from its ZeRO state
        learner = Learner([*args, "--max-steps", steps], env, tmp_path / f"ds1-{steps}.log")
        try:
            learner.wait_for(rf"done: step {steps} ", timeout=120)
            assert learner.wait(30) == 0
        finally:
            learner.stop()
    assert [r["step"] for r in read_records(tmp_path / "m.jsonl") if r["event"] == "resume"] == [0, 1]
    reference = await _reference(settings, tmp_path, 2)
    _assert_same_weights(_published(settings, s3_client, run, 2, tmp_path / "ds1"), reference)


async def test_two_ranks_zero2_over_gloo_match_one_big_batch(settings, settings_env, s3_client,
                                                            tmp_path: Path) -> None:
    await produce(settings, [r for i in range(4) for r in group(f"e{i}", seed=10 + i, size=3)], partition=0)
    run = f"{settings.namespace}ds2"
    args = [*COMMON, "--zero-stage", "2", "--run", run, "--checkpoint-every", "2", "--max-steps", "2",
            "--metrics-path", str(tmp_path / "m.jsonl"), "--workdir", str(tmp_path / "w")]
    port = free_port()
    ranks = [Learner(args, _rank_env(settings_env, r, 2, port), tmp_path / f"rank{r}.log") for r in range(2)]
    try:
        ranks[0].wait_for(r"done: step 2 version 2", timeout=150)
        assert [r.wait(30) for r in ranks] == [0, 0]
    finally:
        for r in ranks:
            r.stop()
    steps = read_steps(read_records(tmp_path / "m.jsonl"))
    assert [s["samples"] for s in steps] == [6, 6], "rank 0 reports the whole step"
    reference = await _reference(settings, tmp_path, 2)
    _assert_same_weights(_published(settings, s3_client, run, 2, tmp_path / "ds2"), reference)
