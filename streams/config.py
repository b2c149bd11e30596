"""StreamConfig: every knob of the stream app, resolved once at start-up (``BOLTSTREAM_STREAM_*``).

Why one frozen dataclass: the worker builds the Faust app, the pure core's
:class:`AssemblyConfig` / :class:`CreditConfig` and its timers from the same
validated values, so a bad value (a negative timeout, a broken AIR rules file,
an invalid ``agent_match`` regex) fails before the worker joins the consumer
group rather than mid-stream. Resolution is :func:`boltstream.config.load`:
explicit (CLI flag) > ``BOLTSTREAM_STREAM_<FIELD>`` env var > default; the
nested :class:`Settings` keeps its own ``BOLTSTREAM_*`` variables.

Time knobs (seconds):

* ``grace_s`` - after a rollout's root span arrives, wait this long for
  out-of-band spans before closing it. 0 (default) closes at once: the
  inference worker acks its LLM span before answering and the root span ends
  last, so with the same key every span is already earlier in the partition.
* ``rollout_timeout_s`` - a rollout with no root span and no new span for this
  long is closed as ``abandoned`` (a crashed agent must not pin memory forever).
* ``group_timeout_s`` - a GRPO group still short of ``group_size`` attempts
  this long after its first trajectory is emitted incomplete (``complete=False``).
* ``forget_after_s`` - how long "already emitted" markers are kept to drop
  late duplicates; after that a replay of the same rollout would be emitted again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from boltstream.config import Settings, load
from boltstream.errors import ConfigError

from .air import DEFAULT_AIR_RULES, AirRule, air_rules_from_yaml
from .settings import LOSS_WEIGHT_MODES, AssemblyConfig, CreditConfig

log = logging.getLogger(__name__)

# Room left in a record for framing, key and Kafka record overhead when sizing batch parts.
BATCH_HEADROOM_BYTES = 16_384


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """``BOLTSTREAM_STREAM_*`` knobs plus :class:`Settings` (see the module docstring)."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_STREAM_"
    settings: Settings = dataclasses.field(default_factory=Settings)
    app_id: str | None = None
    store: str = "memory://"
    grace_s: float = 0.0
    rollout_timeout_s: float = 300.0
    group_timeout_s: float = 600.0
    group_size: int = 4
    forget_after_s: float = 3600.0
    tick_s: float = 0.5
    commit_interval_s: float = 1.0
    # Assembly (AssemblyConfig)
    agent_match: str | None = None
    air_rules_file: str | None = None
    require_logprobs: bool = True
    # Credit assignment (CreditConfig)
    gamma: float = 1.0
    eps: float = 1e-6
    std_normalize: bool = True
    std_unbiased: bool = True
    loss_weight: str = "none"
    trajectory_mode: bool = False
    failure_reward: float = 0.0
    call_credit: str = "return"
    # Batch parts are sized below this many bytes (default: the broker's max message size minus headroom).
    max_batch_bytes: int | None = None
    # Skip faust's four-task-per-record wait in the consumer loop when nothing can block (streams.fastpath).
    fast_consumer: bool = True
    log_every_s: float = 30.0
    # Write a profile of the whole worker process here on exit (yappi, all threads, if installed; else cProfile).
    profile: str | None = None

    def __post_init__(self) -> None:
        positive = ("rollout_timeout_s", "group_timeout_s", "forget_after_s", "tick_s", "commit_interval_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        if self.grace_s < 0:
            raise ConfigError("grace_s", self.grace_s, "must be >= 0")
        if self.group_size < 1:
            raise ConfigError("group_size", self.group_size, "must be >= 1")
        if self.loss_weight not in LOSS_WEIGHT_MODES:
            raise ConfigError("loss_weight", self.loss_weight, f"one of {', '.join(LOSS_WEIGHT_MODES)}")
        if not self.store.startswith(("memory://", "rocksdb://", "aerospike://")):
            raise ConfigError("store", self.store, "a faust store URL such as memory://")
        if self.max_batch_bytes is not None and self.max_batch_bytes < 1024:
            raise ConfigError("max_batch_bytes", self.max_batch_bytes, "must be >= 1024")
        if self.air_rules_file is not None and not Path(self.air_rules_file).is_file():
            raise ConfigError("air_rules_file", self.air_rules_file, "no such file")
        # Build both pure-core configs now so their own validation fails at start-up.
        try:
            self.assembly_config()
            self.credit_config()
        except ValueError as exc:
            raise ConfigError("stream config", str(exc), "invalid") from exc

    @property
    def app_name(self) -> str:
        """Faust app id = consumer group id and prefix of the table changelog topics."""
        return self.app_id or f"{self.settings.namespace}stream"

    @property
    def batch_bytes(self) -> int:
        """Byte budget of one TrainingBatch part."""
        if self.max_batch_bytes is not None:
            return self.max_batch_bytes
        return max(1024, self.settings.max_message_bytes - BATCH_HEADROOM_BYTES)

    def air_rules(self) -> tuple[AirRule, ...]:
        """The AIR rules: the YAML file's when given, else the documented defaults."""
        if self.air_rules_file is None:
            return DEFAULT_AIR_RULES
        return air_rules_from_yaml(Path(self.air_rules_file).read_text())

    def assembly_config(self) -> AssemblyConfig:
        return AssemblyConfig(
            agent_match=self.agent_match, air_rules=self.air_rules(), require_logprobs=self.require_logprobs
        )

    def credit_config(self) -> CreditConfig:
        return CreditConfig(
            gamma=self.gamma,
            eps=self.eps,
            std_normalize=self.std_normalize,
            std_unbiased=self.std_unbiased,
            loss_weight=self.loss_weight,  # type: ignore[arg-type]  # checked in __post_init__
            trajectory_mode=self.trajectory_mode,
            failure_reward=self.failure_reward,
            call_credit=self.call_credit,  # type: ignore[arg-type]  # CreditConfig validates it
        )


def load_stream_config(
    explicit: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> StreamConfig:
    """Resolve a :class:`StreamConfig` (explicit > env > stack state file > default)."""
    return load(StreamConfig, explicit, env)
