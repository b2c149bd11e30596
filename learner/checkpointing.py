"""Publishing checkpoints and resuming from them exactly.

A version is two uploads through :func:`boltstream.weights.checkpoints.publish_checkpoint`:

* ``<run>/learner/v<N>/``: the training state (optimizer moments, RNG, and
  ``learner.json``: step, version, the offset bookkeeping and the dedupe window),
  uploaded FIRST;
* ``<run>/v<N>/``: the weights in HF layout (what inference workers download), whose
  manifest is written LAST and names the training state in ``extra.learner_state``.

The weights' manifest is therefore the single commit marker of a version: a crash
anywhere before it leaves the previous version as the newest complete one, and a
training state without weights is never used. Resume reads the newest weights
manifest, its training state, and seeks the consumer to the manifest's ``offsets``.
(A crash between the two manifests leaves an orphan training state at a version
that is simply published again, overwritten, when training gets there.)

With ``publish_dtype`` (say bfloat16 for an fp32 model) the weights workers download are
a cast copy, and the exact weights travel in the training state as ``master/``: a resume
continues from them bit for bit, never from the rounded serving copy.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from boltstream.errors import CheckpointError
from boltstream.s3 import retrying
from boltstream.weights.checkpoints import (
    checkpoint_event,
    fetch_checkpoint,
    latest_manifest,
    list_versions,
    prune_checkpoints,
    publish_checkpoint,
)

from .config import LearnerConfig
from .model_setup import state_compatible
from .trainer import Trainer

logger = logging.getLogger(__name__)

STATE_FILE = "learner.json"
MASTER_DIR = "master"  # the exact weights inside a training state, when the served copy is cast


@dataclass
class LearnerState:
    """Everything besides tensors that must survive a restart, consistent with the weights."""

    step: int = 0
    version: int = 0
    offsets: dict[int, int] = field(default_factory=dict)  # partition -> first record not used yet
    used_above: dict[int, list[int]] = field(default_factory=dict)  # used records past the watermark
    seen: list[str] = field(default_factory=list)  # dedupe window ("b:<batch_id>", "s:<sample_id>")
    dropped: dict[str, int] = field(default_factory=dict)  # cumulative, by reason
    samples_trained: int = 0
    # --offline: the dataset, the epoch and the position in it (learner/offline.py); None for online runs
    offline: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LearnerState:
        raw = json.loads(text)
        return cls(
            step=int(raw["step"]),
            version=int(raw["version"]),
            offsets={int(p): int(o) for p, o in raw.get("offsets", {}).items()},
            used_above={int(p): [int(o) for o in offs] for p, offs in raw.get("used_above", {}).items()},
            seen=[str(i) for i in raw.get("seen", [])],
            dropped={str(k): int(v) for k, v in raw.get("dropped", {}).items()},
            samples_trained=int(raw.get("samples_trained", 0)),
            offline=raw.get("offline"),
        )


@dataclass
class Resumed:
    """Where training starts: a fresh state, or a downloaded checkpoint (files under ``directory``)."""

    state: LearnerState
    manifest: dict[str, Any] | None = None
    event: dict[str, Any] | None = None
    weights_dir: Path | None = None
    state_dir: Path | None = None  # None: no usable optimizer state (start AdamW fresh)
    directory: Path | None = None  # delete once the trainer has loaded the files

    def cleanup(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def state_run(cfg: LearnerConfig) -> str:
    """S3 prefix of the training states (``<run>/learner``; not a ``v<N>`` name, so never a version)."""
    return f"{cfg.run_name}/learner"


def topic_offsets(manifest: dict[str, Any], topic: str) -> dict[int, int]:
    """The manifest's offsets for ``topic`` (entries of other topics are ignored, with a warning)."""
    out: dict[int, int] = {}
    for entry in manifest.get("offsets", []):
        if entry["topic"] != topic:
            logger.warning("manifest offset for topic %s ignored (reading %s)", entry["topic"], topic)
            continue
        out[int(entry["partition"])] = int(entry["offset"])
    return out


def publish(s3: Any, cfg: LearnerConfig, trainer: Trainer, state: LearnerState, topic: str,
            workdir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save and upload version ``state.version``; returns its CheckpointEvent (not yet announced).

    Runs every rank's part of the save (DeepSpeed writes its optimizer shards collectively);
    only this process uploads.
    """
    offsets = [{"topic": topic, "partition": p, "offset": o} for p, o in sorted(state.offsets.items())]
    bucket, version = cfg.settings.s3_bucket, state.version
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"publish-v{version}-", dir=workdir))
    try:
        weights_dir, state_dir = tmp / "weights", tmp / "state"
        cast = serving_dtype(cfg, trainer)
        trainer.save_weights(weights_dir, cast)
        trainer.save_state(state_dir)
        if cast is not None:
            trainer.save_weights(state_dir / MASTER_DIR)
        (state_dir / STATE_FILE).write_text(state.to_json())
        # Only the uploads are retried (each re-sends its whole version): the saves above are collective
        # under DeepSpeed, and the files they wrote do not change while S3 is down.
        state_event = retrying(lambda: publish_checkpoint(
            s3, bucket, state_run(cfg), version, state_dir, kind=cfg.kind, base_model=cfg.model,
            learner_step=state.step, offsets=offsets, model_name=cfg.name, extra={"role": "learner-state"}),
            f"training state v{version}", cfg.checkpoint_retry_s)
        return retrying(lambda: publish_checkpoint(
            s3, bucket, cfg.run_name, version, weights_dir, kind=cfg.kind, base_model=cfg.model,
            learner_step=state.step, offsets=offsets, model_name=cfg.name,
            extra={"learner_state": state_event["manifest_uri"], "backend": trainer.backend,
                   "world_size": trainer.world_size, **({"cast_to": cast} if cast else {}), **(extra or {})}),
            f"checkpoint v{version}", cfg.checkpoint_retry_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def serving_dtype(cfg: LearnerConfig, trainer: Trainer) -> str | None:
    """The dtype to cast published weights to: ``cfg.publish_dtype`` when the model is in another one."""
    if cfg.publish_dtype is None:  # (LearnerConfig refuses it with LoRA)
        return None
    trained = next(trainer.model.parameters()).dtype
    return None if trained == getattr(torch, cfg.publish_dtype) else cfg.publish_dtype


def prune(s3: Any, cfg: LearnerConfig) -> list[int]:
    """Keep the newest ``keep_last`` versions (the announced one is always the newest); returns deleted."""
    bucket = cfg.settings.s3_bucket

    def once() -> list[int]:
        deleted = prune_checkpoints(s3, bucket, cfg.run_name, keep_last=cfg.keep_last)
        kept = [v for v in list_versions(s3, bucket, cfg.run_name) if v not in deleted]
        prune_checkpoints(s3, bucket, state_run(cfg), keep_last=cfg.keep_last, protected_versions=kept)
        return deleted

    return retrying(once, "pruning checkpoints", cfg.checkpoint_retry_s)


def fetch_resume(s3: Any, cfg: LearnerConfig, workdir: Path, *, backend: str, world_size: int) -> Resumed:
    """Download the run's newest complete version (weights + training state) into ``workdir``.

    Returns a fresh state when there is no checkpoint or ``cfg.resume`` is off. The files
    are loaded by the trainer's constructor (weights must be in place before DeepSpeed
    builds its fp32 partitions); call :meth:`Resumed.cleanup` afterwards. A training
    state written by another backend or world size is not loaded (fresh optimizer, logged).
    """
    if not cfg.resume:
        return Resumed(LearnerState())
    bucket = cfg.settings.s3_bucket
    manifest = latest_manifest(s3, bucket, cfg.run_name)
    if manifest is None:
        logger.info("no checkpoint under s3://%s/%s/: starting from %s", bucket, cfg.run_name, cfg.model)
        return Resumed(LearnerState())
    version = int(manifest["version"])
    if manifest["kind"] != cfg.kind:
        raise CheckpointError(f"run {cfg.run_name} v{version} is a {manifest['kind']} checkpoint but the learner "
                              f"is configured for {cfg.kind}; use another --run or match --lora")
    event = checkpoint_event(manifest, bucket, cfg.run_name)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"resume-v{version}-", dir=workdir))
    resumed = Resumed(LearnerState(step=int(manifest.get("learner_step", version)), version=version),
                      manifest, event, directory=tmp)
    try:
        state_uri = (manifest.get("extra") or {}).get("learner_state")
        if state_uri:
            state_dir = fetch_checkpoint(s3, state_uri, tmp / "state")
            if (state_dir / MASTER_DIR).is_dir():  # the published weights are a cast copy: not these
                resumed.weights_dir = state_dir / MASTER_DIR
            resumed.state = LearnerState.from_json((state_dir / STATE_FILE).read_text())
            if state_compatible(state_dir, backend, world_size):
                resumed.state_dir = state_dir
            else:
                logger.warning("v%d's optimizer state was written by another backend or world size than %s "
                               "with %d rank(s): continuing with a fresh optimizer", version, backend, world_size)
        else:
            logger.warning("v%d has no learner state: fresh optimizer, and duplicates of records read before it "
                           "cannot be recognised", version)
        if resumed.weights_dir is None:
            resumed.weights_dir = fetch_checkpoint(s3, event["manifest_uri"], tmp / "weights")
        if resumed.state.version != version:
            raise CheckpointError(f"v{version}: its learner state says version {resumed.state.version}")
        resumed.state.offsets = topic_offsets(manifest, cfg.settings.topic("batches"))
    except BaseException:
        resumed.cleanup()
        raise
    logger.info("resuming %s v%d (step %d) from %s; batches offsets %s", cfg.run_name, version,
                resumed.state.step, event["manifest_uri"], resumed.state.offsets)
    return resumed
