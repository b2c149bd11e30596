"""``LearnerConfig``: every knob of ``boltstream learn`` in one frozen dataclass.

Resolved like every other boltstream process (:func:`boltstream.config.load`):
explicit value (a CLI flag) > ``BOLTSTREAM_LEARN_*`` environment variable > default,
with the nested :class:`~boltstream.config.Settings` (broker, S3) resolved from
``BOLTSTREAM_*`` variables or the embedded stack's state file. Validation happens
here, at start, so a typo fails before a model is loaded and a broker is joined.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from boltstream.config import Settings, load
from boltstream.errors import ConfigError

from .losses import LOSS_AGG_MODES
from .step import StepConfig

logger = logging.getLogger(__name__)

ENV_PREFIX = "BOLTSTREAM_LEARN_"
ZERO_STAGES = (0, 1, 2)
PUBLISH_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """What the learner trains, on what, how, and where results go (``boltstream learn --help``)."""

    env_prefix: ClassVar[str] = ENV_PREFIX

    settings: Settings = dataclasses.field(default_factory=Settings)
    # --- model
    model: str = "smollm2"  # smollm2 | tiny | HF directory | .gguf (boltstream.weights.models.load_model)
    model_name: str | None = None  # key of CheckpointEvents; default derived from `model` (as `serve` does)
    seed: int = 0  # tiny model weights and the torch RNG
    device: str = "cpu"
    dtype: str | None = None  # e.g. bfloat16; None keeps the checkpoint's
    # --- LoRA (peft); off = full fine-tuning
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # --- optimizer (AdamW on trainable parameters)
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_warmup_steps: int = 0  # linear ramp to lr over the first N steps (learner.step.warmup_lr)
    # --- what one step is made of
    groups_per_step: int = 4  # K complete GRPO groups (TrainingBatch records) per optimizer step
    max_staleness: int | None = 4  # drop samples more than this many policy versions old; None = keep all
    drop_incomplete_groups: bool = False  # groups the stream app closed short (complete=false)
    # --- the step (learner.step.StepConfig)
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    decoupled: bool = False
    is_cap: float | None = 2.0
    kl_coef: float = 0.0
    # Activation memory grows with it (every layer's activations are kept for backward): SmolLM2 + LoRA,
    # 16 samples of ~190 tokens, peaked at 6.7 GB RSS with 4,096 and 2.7 GB with 1,024; with adapters on
    # every linear layer, 32 samples of 150-230 tokens: 8.0 GB at 2,048 (43 s a step), 4.2 GB at 1,024
    # (39 s), 2.7 GB at 512 (40 s). Smaller micro-batches cost no speed on CPU.
    max_tokens_per_micro_batch: int = 1024
    max_grad_norm: float | None = 1.0
    logprob_chunk_size: int = 1024
    # --- checkpoints
    run: str | None = None  # S3 prefix of this run's versions; default "<namespace>/<model_name>"
    checkpoint_every: int = 10
    keep_last: int = 3
    # Full checkpoints: the dtype workers download (e.g. bfloat16: half the bytes of fp32, the reload
    # time's main cost). The exact weights then travel with the training state, so resume stays exact.
    publish_dtype: str | None = None
    checkpoint_on_exit: bool = True  # on max_steps / SIGTERM, publish the steps since the last one
    resume: bool = True  # start from the run's newest complete checkpoint when there is one
    workdir: str | None = None  # local scratch for checkpoint files (default: a temporary directory)
    # --- when to stop
    max_steps: int | None = None  # total learner steps (counting those before a resume)
    idle_exit_s: float | None = None  # stop when no record arrived for this long (tests, batch jobs)
    # --- bookkeeping
    max_pending_batches: int = 1000  # incomplete split batches held before the oldest is dropped
    dedupe_window: int = 100_000  # batch/sample ids remembered (and checkpointed) to drop duplicates
    poll_ms: int = 500
    # --- metrics
    metrics_path: str | None = None  # JSONL, one line per step / checkpoint / resume
    metrics_port: int | None = None  # Prometheus /metrics on 127.0.0.1:<port> (0 = any free port)
    metrics_host: str = "127.0.0.1"
    # --- DeepSpeed ZeRO (extra [deepspeed]); ranks from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    deepspeed: bool = False
    zero_stage: int = 1
    ds_shm_comm: bool = False  # DeepSpeed's CPU shared-memory allreduce: a ~2 min JIT build on first use
    dist_timeout_s: float = 7 * 24 * 3600.0  # followers wait this long for rank 0 (it may idle on Kafka)
    log_level: str = "info"

    def __post_init__(self) -> None:
        positive = ("groups_per_step", "checkpoint_every", "keep_last", "max_tokens_per_micro_batch",
                    "logprob_chunk_size", "lora_r", "max_pending_batches", "dedupe_window", "poll_ms")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.lr_warmup_steps < 0:
            raise ConfigError("lr_warmup_steps", self.lr_warmup_steps, "must be >= 0")
        if self.lr <= 0:
            raise ConfigError("lr", self.lr, "must be > 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError("max_staleness", self.max_staleness, "must be >= 0 (or none for no limit)")
        if self.max_steps is not None and self.max_steps < 0:
            raise ConfigError("max_steps", self.max_steps, "must be >= 0")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ConfigError("loss_agg", self.loss_agg, f"one of {', '.join(LOSS_AGG_MODES)}")
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError("zero_stage", self.zero_stage,
                              "0, 1 or 2 (stage 3 shards the weights, which checkpoints do not gather)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", self.metrics_port, "must be 0-65535")
        if self.lora and not self.lora_targets:
            raise ConfigError("lora_targets", self.lora_targets, "LoRA needs at least one target module")
        if self.publish_dtype is not None:
            if self.publish_dtype not in PUBLISH_DTYPES:
                raise ConfigError("publish_dtype", self.publish_dtype, f"one of {', '.join(PUBLISH_DTYPES)}")
            if self.lora:
                raise ConfigError("publish_dtype", self.publish_dtype,
                                  "applies to full checkpoints; LoRA adapters are published as trained")
        if self.run is not None and not self.run.strip("/"):
            raise ConfigError("run", self.run, "must not be empty")

    @property
    def name(self) -> str:
        """The model name checkpoint events carry (what ``boltstream serve`` follows by default)."""
        if self.model_name:
            return self.model_name
        p = Path(self.model)
        return self.model if len(p.parts) == 1 and not p.suffix else p.stem

    @property
    def run_name(self) -> str:
        """S3 prefix of this run: ``<bucket>/<run>/v<version>/`` holds each version."""
        if self.run:
            return self.run.strip("/")
        return f"{self.settings.namespace.rstrip('.') or 'boltstream'}/{self.name}"

    @property
    def kind(self) -> str:
        """Checkpoint kind: LoRA adapter files or a full HF model directory."""
        return "lora" if self.lora else "full"

    def step_config(self, pad_token_id: int = 0) -> StepConfig:
        """The :class:`StepConfig` these knobs describe."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(StepConfig) if hasattr(self, f.name)}
        return StepConfig(**{**shared, "pad_token_id": pad_token_id})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view without credentials (logged at start, stored in checkpoints)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "settings"}
        out["lora_targets"] = list(self.lora_targets)
        out["run"] = self.run_name
        out["model_name"] = self.name
        return out


def load_config(explicit: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> LearnerConfig:
    """Resolve a :class:`LearnerConfig` (explicit > ``BOLTSTREAM_LEARN_*`` > stack state > default)."""
    return load(LearnerConfig, explicit, env)
