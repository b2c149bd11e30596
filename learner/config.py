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

from boltstream.broker.log_range import LogRangeError, parse_position
from boltstream.config import Settings, load, opt
from boltstream.errors import ConfigError
from boltstream.monitoring.tracking import REPORT_TO_HELP, check_installed, parse_report_to

from .memory import GLIBC_MAX_MMAP_THRESHOLD_KB
from .offline_source import TOPIC_PREFIX, parquet_files
from .roles import Role, parse_role

logger = logging.getLogger(__name__)

ENV_PREFIX = "BOLTSTREAM_LEARN_"
ZERO_STAGES = (0, 1, 2)
PUBLISH_DTYPES = ("bfloat16", "float16", "float32")


LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Knobs of one optimizer step. Defaults: DAPO-style asymmetric clip, token-mean."""

    clip_low: float = opt(0.2, "PPO clip below: ratio >= 1 - clip_low")
    clip_high: float = opt(0.28, "PPO clip above: ratio <= 1 + clip_high (DAPO's clip-higher)")
    dual_clip: float | None = opt(None, "dual-clip bound c > 1 on negative advantages (none: off)")
    loss_agg: str = opt("token-mean", "how token losses are averaged", choices=LOSS_AGG_MODES)
    # decoupled: clip against the current policy (detached) and weight each token by
    # min(pi_current / pi_behaviour, is_cap) -- truncated IS for stale/off-policy samples.
    decoupled: bool = opt(False, "decoupled PPO: clip against the current policy, truncated IS weight "
                                 "to the behaviour policy")
    is_cap: float | None = opt(2.0, "cap of the decoupled IS weight")
    kl_coef: float = opt(0.0, "KL penalty to the reference (with LoRA: the base model, no second copy)")
    # Activation memory grows with it (every layer's activations are kept for backward): SmolLM2 + LoRA,
    # 16 samples of ~190 tokens, peaked at 6.7 GB RSS with 4,096 and 2.7 GB with 1,024; with adapters on
    # every linear layer, 32 samples of 150-230 tokens: 8.0 GB at 2,048 (43 s a step), 4.2 GB at 1,024
    # (39 s), 2.7 GB at 512 (40 s). Smaller micro-batches cost no speed on CPU. (All measured with glibc's
    # rising mmap threshold, before malloc_mmap_threshold_kb: see docs/learner.md, Memory.)
    # With prefix_tree the same budget counts the trie's nodes (what the decoder computes), so activation
    # memory per micro-batch stays what it was; the mask (N x N bools, made once per forward) has its own bound.
    max_tokens_per_micro_batch: int = opt(1024, "micro-batch budget: rows x padded length, or with "
                                                "--prefix-tree the unique tokens (trie nodes)")
    prefix_tree: bool = opt(True, "run each micro-batch's samples as one token trie with a tree attention mask: "
                                  "a prefix shared by samples is computed once (falls back to flat, logged, "
                                  "where the model's attention takes no 4-D mask)")
    max_tree_mask_elements: int = opt(16_777_216, "with --prefix-tree: bound on a micro-batch's mask, "
                                                  "unique tokens squared")
    shared_prefix_min_tokens: int = opt(64, "with --prefix-tree: a prefix that every sample of the step starts "
                                            "with, before any loss token, of at least this many tokens, runs once "
                                            "per step and every micro-batch attends to its cached keys/values "
                                            "(0: off)")
    shared_prefix_keep_tokens: int = opt(1024, "with a shared prefix: one of at most this many tokens keeps its "
                                               "activations for the backward (one forward over it instead of two; "
                                               "memory of that many more tokens); a longer one is recomputed chunk "
                                               "by chunk (0: always)")
    max_grad_norm: float | None = opt(1.0, "clip the gradient norm (none: off)")
    logprob_chunk_size: int = opt(1024, "positions per chunk through the LM head (bounds logits memory)")
    pad_token_id: int = opt(0, cli=False)
    compute_entropy: bool = opt(True, "compute the policy entropy metric")
    fused_head: bool = opt(True, "compute log-probs only at trained positions through the LM head")
    skip_zero_advantage: bool = opt(True, "no forward/backward for samples whose gradient is exactly 0 "
                                          "(advantage 0 and no KL term); the update is unchanged")

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ConfigError("loss_agg", self.loss_agg, f"one of {', '.join(LOSS_AGG_MODES)}")
        for name in ("max_tokens_per_micro_batch", "logprob_chunk_size", "max_tree_mask_elements"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        for name in ("shared_prefix_min_tokens", "shared_prefix_keep_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "must be >= 0")


# Every linear layer of the decoder (attention and MLP): with it at lr 1e-3 a bare loop lifted the
# calculator's held-out accuracy 0.25 -> 0.66 in 8 steps (docs/learner.md).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Learning rates when none is given: adapters need a larger step than full weights to move at all. 1e-3
# for adapters: on the agent suite at 8 steps 2e-4 (with a 3-step warm-up) moved one agent of six by more
# than 3 paired SE on both seeds; 1e-3 without warm-up, 8 groups a step moved most of them (docs/learner.md).
DEFAULT_LR = {"lora": 1e-3, "full": 1e-5}


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """What the learner trains, on what, how, and where results go (``boltstream learn --help``)."""

    env_prefix: ClassVar[str] = ENV_PREFIX

    settings: Settings = dataclasses.field(default_factory=Settings)
    step: StepConfig = dataclasses.field(default_factory=StepConfig)
    # --- model
    model: str = opt("smollm2", "smollm2 | tiny | an HF model directory | a .gguf file")
    model_name: str | None = opt(None, "model name in checkpoint events (default: the --role name, else derived "
                                       "from --model, as `serve` does)")
    # One learner process per trained role (learner/roles.py, docs/multi-agent.md).
    role: str | None = opt(None, "NAME[=REGEX]: train only samples whose agent_name matches REGEX (re.search; "
                                 "default ^NAME$), publishing as model NAME (a worker's --adapters NAME follows "
                                 "it); the other samples are skipped as other_role")
    seed: int = opt(0, "seed of the tiny model's weights, the LoRA init and the torch RNG")
    device: str = opt("cpu", "torch device")
    dtype: str | None = opt(None, "torch dtype of the weights, e.g. bfloat16 (default: the checkpoint's)")
    # --- LoRA (peft); off = full fine-tuning
    lora: bool = opt(False, "train LoRA adapters (peft) instead of all weights")
    lora_r: int = opt(16, "LoRA rank")
    lora_alpha: int = opt(32, "LoRA alpha")
    lora_dropout: float = opt(0.0, "LoRA dropout")
    lora_targets: tuple[str, ...] = opt(LORA_TARGETS, "comma-separated module names that get adapters")
    # --- optimizer (AdamW on trainable parameters)
    lr: float | None = opt(None, f"learning rate (default {DEFAULT_LR['lora']} with --lora, "
                                 f"{DEFAULT_LR['full']} for full weights)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW eps")
    # No warm-up by default: of 8 steps a ramp over the first 3 spent the steps in which nearly every group
    # still has a spread at a third to two thirds of the lr, and learned less (docs/learner.md). Adam's first
    # update moves every weight by ~lr whatever the gradient: with few samples a step a ramp protects it.
    lr_warmup_steps: int = opt(0, "ramp the lr linearly from lr/N to lr over the first N steps (0: none)")
    # --- what one step is made of
    # 8: twice the samples of 4 for ~10 % more time a step (generation fills its batch), and steadier
    # steps: a binary-reward agent collapsed onto one answer at 4 and learned at 8 (docs/learner.md).
    groups_per_step: int = opt(8, "K: complete GRPO groups (TrainingBatch records) per optimizer step")
    max_staleness: int | None = opt(4, "drop samples more than this many policy versions old (none: keep all)")
    drop_incomplete_groups: bool = opt(False, "drop groups the stream app closed short (complete=false)")
    # --- checkpoints
    run: str | None = opt(None, "S3 prefix of this run's checkpoints (default <namespace>/<model name>)")
    checkpoint_every: int = opt(10, "publish a checkpoint every N steps")
    keep_last: int = opt(3, "checkpoint versions kept in S3")
    checkpoint_retry_s: float = opt(600.0, "keep retrying a checkpoint upload this long while S3 cannot be "
                                           "reached (the step waits; workers keep serving the last version)")
    # The exact weights then travel with the training state, so resume stays exact.
    publish_dtype: str | None = opt(None, "full checkpoints: the dtype workers download, e.g. bfloat16 (half "
                                          "the bytes); the exact weights go with the training state",
                                    choices=PUBLISH_DTYPES)
    checkpoint_on_exit: bool = opt(True, "on max_steps or SIGTERM, publish the steps since the last checkpoint")
    resume: bool = opt(True, "start from the run's newest complete checkpoint when there is one")
    workdir: str | None = opt(None, "local scratch for checkpoint files (default: a temporary directory)")
    # --- offline: a fixed dataset (learner/offline.py), trained for N epochs before or instead of the live topic
    offline: str | None = opt(None, "train from a fixed dataset: exported batches Parquet (a file, a folder or a "
                                    "glob) or topic:<full topic name>, e.g. a replay's topic:<ns>batches")
    offline_from: str = opt("earliest", "with --offline topic:...: where the range starts (earliest | ISO time | "
                                        "partition:offset,...)")
    offline_to: str = opt("now", "with --offline topic:...: where it ends (now: the log end at the run's first "
                                 "start; ISO time | partition:offset,...)")
    epochs: int = opt(1, "with --offline: passes over the dataset")
    then_online: bool = opt(False, "after the offline epochs, train from the live batches topic, from where it "
                                   "ended when the run first started (docs/replay.md)")
    # --- when to stop
    max_steps: int | None = opt(None, "stop after this many learner steps in total, resumed ones included")
    idle_exit_s: float | None = opt(None, "stop when no record arrived for this many seconds")
    hold_file: str | None = opt(None, "while this file exists, take no step (records are still read in); "
                                      "`boltstream train` holds its learners so while it scores the base policy")
    # --- bookkeeping
    max_pending_batches: int = opt(1000, "incomplete split batches held before the oldest is dropped")
    dedupe_window: int = opt(100_000, "batch/sample ids remembered (and checkpointed) to drop duplicates")
    poll_ms: int = opt(500, "broker poll timeout")
    # --- memory (learner/memory.py): glibc otherwise raises this threshold as big blocks are freed, and
    # every later activation comes from a heap it keeps: SmolLM2 + LoRA peaked at 4.2 GB instead of 2.3 GB.
    # Only for glibc's malloc: a learner on tcmalloc (boltstream/allocator.py) ignores it.
    malloc_mmap_threshold_kb: int | None = opt(128, "allocations of at least this many KiB get their own "
                                                    "mmap, returned to the OS when freed (none: glibc's "
                                                    "rising threshold)")
    # --- metrics
    metrics_path: str | None = opt(None, "append one JSON line per step / checkpoint / resume here")
    worker_metrics: tuple[str, ...] = opt((), "comma-separated base URLs of inference workers (http://host:port) "
                                          "whose /metrics each step's timeline reads: generation time, decode "
                                          "batch size, prefill/decode tokens, reloads")
    metrics_port: int | None = opt(None, "serve Prometheus /metrics on this port (0: any free port)")
    metrics_host: str = opt("127.0.0.1", "address of the /metrics server")
    report_to: tuple[str, ...] = opt((), REPORT_TO_HELP)
    tracking_dir: str | None = opt(None, "where --report-to trackers write (default: tracking/ next to "
                                         "--metrics-path, else runs/<model name>)")
    # --- DeepSpeed ZeRO (extra [deepspeed]); ranks from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    deepspeed: bool = opt(False, "DeepSpeed ZeRO backend (extra [deepspeed]); ranks from "
                                 "RANK/WORLD_SIZE/MASTER_*")
    zero_stage: int = opt(1, "ZeRO stage 0, 1 or 2")
    ds_shm_comm: bool = opt(False, "DeepSpeed's CPU shared-memory allreduce (a ~2 min JIT build on first use)")
    dist_timeout_s: float = opt(7 * 24 * 3600.0, "followers wait this long for rank 0 (it may idle on Kafka)")
    log_level: str = opt("info", "debug | info | warning")

    def __post_init__(self) -> None:
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.kind])
        positive = ("groups_per_step", "checkpoint_every", "keep_last", "lora_r", "max_pending_batches",
                    "dedupe_window", "poll_ms")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.malloc_mmap_threshold_kb is not None and not (
                0 < self.malloc_mmap_threshold_kb <= GLIBC_MAX_MMAP_THRESHOLD_KB):
            raise ConfigError("malloc_mmap_threshold_kb", self.malloc_mmap_threshold_kb,
                              f"must be 1..{GLIBC_MAX_MMAP_THRESHOLD_KB} (or none for glibc's own)")
        object.__setattr__(self, "report_to", parse_report_to(self.report_to))
        check_installed(self.report_to)  # before the model loads: the error names the extra to install
        if self.lr_warmup_steps < 0:
            raise ConfigError("lr_warmup_steps", self.lr_warmup_steps, "must be >= 0")
        if not self.checkpoint_retry_s >= 0:  # NaN too
            raise ConfigError("checkpoint_retry_s", self.checkpoint_retry_s, "must be >= 0 seconds")
        if self.lr <= 0:  # type: ignore[operator]  # set above
            raise ConfigError("lr", self.lr, "must be > 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError("max_staleness", self.max_staleness, "must be >= 0 (or none for no limit)")
        if self.max_steps is not None and self.max_steps < 0:
            raise ConfigError("max_steps", self.max_steps, "must be >= 0")
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
        if self.role is not None:
            parse_role(self.role)
        if self.run is not None and not self.run.strip("/"):
            raise ConfigError("run", self.run, "must not be empty")
        if self.epochs < 1:
            raise ConfigError("epochs", self.epochs, "must be >= 1")
        if self.offline is not None:
            if not self.offline.strip() or self.offline.strip() == TOPIC_PREFIX:
                raise ConfigError("offline", self.offline, "name Parquet files or topic:<full topic name>")
            for name, option in (("offline_from", "--from"), ("offline_to", "--to")):
                try:
                    parse_position(getattr(self, name), option)
                except LogRangeError as exc:
                    raise ConfigError(name, getattr(self, name), str(exc).split(": ", 1)[-1]) from None
            if not self.offline.strip().startswith(TOPIC_PREFIX):
                # before the model loads, not after: a mistyped path should cost nothing
                parquet_files(self.offline)
        elif self.then_online:
            raise ConfigError("then_online", self.then_online, "continues an --offline run; without --offline the "
                                                                "learner trains online anyway")

    @property
    def name(self) -> str:
        """The model name checkpoint events carry (what ``boltstream serve`` follows by default)."""
        if self.model_name:
            return self.model_name
        if self.role is not None:
            return parse_role(self.role).name
        p = Path(self.model)
        return self.model if len(p.parts) == 1 and not p.suffix else p.stem

    @property
    def run_name(self) -> str:
        """S3 prefix of this run: ``<bucket>/<run>/v<version>/`` holds each version.

        Per model name, so role learners on one bucket (model names NAME by default, distinct as a
        worker's adapters require) never share manifests or resume state."""
        if self.run:
            return self.run.strip("/")
        return f"{self.settings.namespace.rstrip('.') or 'boltstream'}/{self.name}"

    @property
    def tracking_path(self) -> Path:
        """Where the ``report_to`` trackers write."""
        if self.tracking_dir:
            return Path(self.tracking_dir)
        if self.metrics_path:
            return Path(self.metrics_path).parent / "tracking"
        return Path("runs") / self.name

    @property
    def role_spec(self) -> Role | None:
        """The parsed ``role`` (None: train every sample)."""
        return None if self.role is None else parse_role(self.role)

    @property
    def kind(self) -> str:
        """Checkpoint kind: LoRA adapter files or a full HF model directory."""
        return "lora" if self.lora else "full"

    def step_config(self, pad_token_id: int = 0) -> StepConfig:
        """The step settings with the tokenizer's pad id (known only once the model is loaded)."""
        return dataclasses.replace(self.step, pad_token_id=pad_token_id)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view without credentials (logged at start, stored in checkpoints)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("settings", "step")}
        out.update(dataclasses.asdict(self.step))
        out["lora_targets"] = list(self.lora_targets)
        out["report_to"] = list(self.report_to)
        out["run"] = self.run_name
        out["model_name"] = self.name
        return out


def load_config(explicit: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> LearnerConfig:
    """Resolve a :class:`LearnerConfig` (explicit > ``BOLTSTREAM_LEARN_*`` > stack state > default)."""
    return load(LearnerConfig, explicit, env)
