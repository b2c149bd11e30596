"""Batches on the real broker -> the learner (in this process) trains -> checkpoints in S3 + events.

Everything is produced to one partition so the order of groups, and hence of steps, is
fixed. A reloaded checkpoint must reproduce the learner's logits; a second run resumes
from the newest checkpoint without training anything twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from boltstream.learner.config import LearnerConfig
from boltstream.learner.loop import train
from boltstream.learner.metrics import read_records, read_steps
from boltstream.weights.checkpoints import fetch_checkpoint, latest_manifest, list_versions
from boltstream.weights.models import load_model
from tests.integration.learner.helpers import group, produce, read_topic, sample_ids

TIMEOUT = 90.0


def _config(settings, tmp_path: Path, **kw) -> LearnerConfig:
    base = dict(settings=settings, model="tiny", groups_per_step=2, checkpoint_every=2, keep_last=2,
                max_staleness=1, lr=1e-3, metrics_path=str(tmp_path / "metrics.jsonl"), poll_ms=100,
                workdir=str(tmp_path / "work"))
    base.update(kw)
    return LearnerConfig(**base)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def _data() -> tuple[list[dict], set[str], dict[str, int]]:
    """Six groups (one split in two parts, one sent twice, one bad and one stale sample) and
    what the learner should make of them."""
    # groups 2i, 2i+1 make step i+1, trained at policy version i; the last two were sampled at version 2
    g = [group(f"g{i}", seed=i, parts=2 if i == 1 else 1, policy_version=2 if i >= 4 else 0) for i in range(6)]
    g[2][0]["samples"][0]["advantage"] = math.nan  # malformed: dropped, counted
    g[3][0]["samples"][0]["token_ids"][-1] = 300  # beyond the tiny model's 259 tokens: a vocabulary mismatch
    g[5][0]["samples"][1]["policy_version"] = 0  # at step 3 (version 2) it is 2 versions old > max_staleness 1
    records = [r for parts in g[:3] for r in parts] + g[0] + [b"not avro"]  # g0 twice, and junk
    records += [r for parts in g[3:] for r in parts]
    expected = set(sample_ids(r for parts in g for r in parts))
    expected -= {g[i][0]["samples"][j]["sample_id"] for i, j in ((2, 0), (3, 0), (5, 1))}
    drops = {"nonfinite_advantage": 1, "token_out_of_vocab": 1, "stale": 1, "record_duplicate_batch": 1,
             "record_undecodable": 1}
    return records, expected, drops


@pytest.mark.parametrize("kind", ["full", "lora"])
async def test_learner_trains_publishes_and_reloads(kind: str, settings, s3_client, tmp_path: Path) -> None:
    records, expected, drops = _data()
    await produce(settings, records, partition=0)
    cfg = _config(settings, tmp_path, lora=kind == "lora", max_steps=3)
    result = await asyncio.wait_for(train(cfg), TIMEOUT)

    # three steps of two groups; checkpoints at step 2 (every 2) and 3 (clean exit)
    assert (result.step, result.version, result.resumed_from) == (3, 3, None)
    assert [e["version"] for e in result.events] == [2, 3]
    steps = read_steps(read_records(cfg.metrics_path))
    trained = [sid for s in steps for sid in s["sample_ids"]]
    assert sorted(trained) == sorted(expected), "every valid sample trained exactly once"
    assert {k: steps[-1]["dropped_total"].get(k) for k in drops} == drops
    assert [s["staleness"] for s in steps] == [{"0": 8}, {"1": 6}, {"0": 7}]
    assert all(math.isfinite(s["loss"]) and s["tokens_per_s"] > 0 for s in steps)

    # S3: complete versions with valid manifests; the consumed offsets are the end of partition 0
    bucket, run = settings.s3_bucket, cfg.run_name
    assert list_versions(s3_client, bucket, run) == [2, 3]
    manifest = latest_manifest(s3_client, bucket, run)
    assert manifest["kind"] == kind and manifest["version"] == 3 and manifest["learner_step"] == 3
    offsets = {o["partition"]: o["offset"] for o in manifest["offsets"]}
    assert offsets[0] == len(records) and all(offsets[p] == 0 for p in offsets if p != 0)
    files = {f["path"] for f in manifest["files"]}
    assert ({"adapter_config.json", "adapter_model.safetensors"} if kind == "lora"
            else {"config.json", "model.safetensors", "tokenizer.json"}) <= files
    assert not any(f.endswith("optimizer.pt") for f in files), "workers never download optimizer state"

    # the events on `checkpoints`, keyed by model name, match what was published
    events = await read_topic(settings, "checkpoints", 2, "CheckpointEvent")
    assert [(k, e["version"]) for k, e in events] == [(b"tiny", 2), (b"tiny", 3)]
    assert events[-1][1]["manifest_uri"] == result.events[-1]["manifest_uri"]
    ((_, letter),) = await read_topic(settings, "dlq", 1, "DeadLetter")
    assert (letter["component"], letter["value"], letter["offset"]) == ("learner", b"not avro", 5)

    # a reload of the checkpoint reproduces the learner's logits
    path = fetch_checkpoint(s3_client, events[-1][1], tmp_path / "fetched")
    if kind == "full":
        reloaded, _ = load_model(str(path))
    else:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(load_model("tiny")[0], path)
    ids = [60, 61, 62, 63, 64, 65, 10, 200]
    learner_logits = _logits(result.trainer.model, ids)
    base_logits = _logits(load_model("tiny")[0], ids)
    assert not torch.allclose(learner_logits, base_logits, atol=1e-4), "training changed the model"
    torch.testing.assert_close(_logits(reloaded, ids), learner_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("publish_dtype", [None, "bfloat16"])
async def test_restart_resumes_weights_optimizer_and_offsets(publish_dtype, settings, s3_client,
                                                             tmp_path: Path) -> None:
    first, expected, _ = _data()
    await produce(settings, first, partition=0)
    cfg = _config(settings, tmp_path, max_steps=3, publish_dtype=publish_dtype)
    before = await asyncio.wait_for(train(cfg), TIMEOUT)
    opt_before = before.trainer.optimizer.state_dict()["state"]
    served = fetch_checkpoint(s3_client, before.events[-1], tmp_path / "served")
    with safe_open(served / "model.safetensors", "pt") as f:  # what workers download
        assert f.get_tensor("lm_head.weight").dtype == getattr(torch, publish_dtype or "float32")

    # same budget: resumes at step 3 and has nothing to do, bit for bit (never from a cast serving copy)
    again = await asyncio.wait_for(train(cfg), TIMEOUT)
    assert (again.resumed_from, again.step, again.events) == (3, 3, [])
    for a, b in zip(before.trainer.model.parameters(), again.trainer.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt_again = again.trainer.optimizer.state_dict()["state"]
    for i, s in opt_before.items():
        torch.testing.assert_close(opt_again[i]["exp_avg_sq"], s["exp_avg_sq"], rtol=0, atol=0)

    # new groups (and a replay of an old one): only the new ones are trained
    more = group("late0", seed=40, policy_version=3) + group("late1", seed=41, policy_version=3) + group("g3", seed=3)
    await produce(settings, more, partition=0)
    later = await asyncio.wait_for(train(dataclasses.replace(cfg, max_steps=4)), TIMEOUT)
    assert (later.resumed_from, later.step) == (3, 4)
    records = read_records(cfg.metrics_path)
    assert [r["step"] for r in records if r["event"] == "resume"] == [0, 3, 3]
    steps = read_steps(records)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert steps[-1]["batch_ids"] == ["late0", "late1"]
    assert steps[-1]["dropped_total"]["record_duplicate_batch"] == 2
    trained = [sid for s in steps for sid in s["sample_ids"]]
    assert len(trained) == len(set(trained)) == len(expected) + 8
    assert json.loads(Path(cfg.metrics_path).read_text().splitlines()[-1])["event"] == "stop"


async def test_a_held_learner_takes_no_step_until_its_hold_file_is_gone(settings, s3_client, tmp_path: Path) -> None:
    """``--hold-file``: `boltstream train` holds its learners while it scores the base policy. The groups
    are in the topic all along; no step (hence no checkpoint) comes while the file exists, and the time
    held is no step's: the first step's timeline window starts when the hold ends."""
    records, _, _ = _data()
    await produce(settings, records, partition=0)
    hold = tmp_path / "hold"
    hold.touch()
    cfg = _config(settings, tmp_path, lora=True, max_steps=1, hold_file=str(hold))
    held = asyncio.Event()
    run = asyncio.create_task(train(cfg, progress=lambda line: line.startswith("held while") and held.set()))
    await asyncio.wait_for(held.wait(), TIMEOUT)
    held_at = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):  # an unheld learner steps on these groups in well under a second
        await asyncio.wait_for(asyncio.shield(run), 5.0)
    assert read_steps(read_records(cfg.metrics_path)) == []
    hold.unlink()
    released_after = asyncio.get_running_loop().time() - held_at
    result = await asyncio.wait_for(run, TIMEOUT)
    (step,) = read_steps(read_records(cfg.metrics_path))
    assert result.step == 1 and [e["version"] for e in result.events] == [1]
    assert step["timeline"]["window_s"] < released_after
