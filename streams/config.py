"""StreamConfig: every knob of the stream app, resolved once at start-up (``BOLTSTREAM_STREAM_*``).

Why one frozen dataclass: the worker builds the Faust app, the pure core's
:class:`AssemblyConfig` / :class:`CreditConfig` and its timers from the same
validated values, so a bad value (a negative timeout, a broken AIR rules file,
an invalid ``agent_match`` regex) fails before the worker joins the consumer
group rather than mid-stream. Resolution is :func:`boltstream.config.load`:
explicit (CLI flag) > ``BOLTSTREAM_STREAM_<FIELD>`` env var > default; the
nested :class:`Settings` keeps its own ``BOLTSTREAM_*`` variables.

Time knobs (seconds):

* ``grace_s`` - after a rollout's root span arrives, wait this long for spans
  delivered late before closing it. While the broker is up, 0 would do: the
  inference worker acks its LLM span before answering and the root span ends
  last, so with the same key every span is already earlier in the partition.
  After a broker outage a worker's spooled LLM spans race the agent's root span
  to the log (docs/streams.md, "When a rollout closes"): hence 3 s.
* ``rollout_timeout_s`` - a rollout with no root span and no new span for this
  long is closed as ``abandoned`` (a crashed agent must not pin memory forever).
* ``session_idle_s`` - the same for a rollout no runner manages (keyed by a
  session or trace id, or env ids without an attempt id): its normal end, status ok.
* ``reward_timeout_s`` - a runnerless rollout that closes without a final reward
  is held this long for one (delayed feedback), then emitted as it is.
* ``prompt_window_s`` / ``baseline_window`` - baselines of task-less traffic
  (streams/baselines.py).
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

from boltstream.config import DEFAULT_GROUP_SIZE, Settings, load, opt
from boltstream.errors import ConfigError

from .air import DEFAULT_AIR_RULES, AirRule, air_rules_from_yaml
from .core_config import AssemblyConfig, CreditConfig

log = logging.getLogger(__name__)

# Room left in a record for framing, key and Kafka record overhead when sizing batch parts.
BATCH_HEADROOM_BYTES = 16_384


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """``BOLTSTREAM_STREAM_*`` knobs, the credit settings and :class:`Settings` (see the module docstring)."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_STREAM_"
    settings: Settings = dataclasses.field(default_factory=Settings)
    credit: CreditConfig = dataclasses.field(default_factory=CreditConfig)
    app_id: str | None = opt(None, "faust app id = consumer group; workers with the same id split the "
                                   "partitions (default '<namespace>stream')")
    store: str = opt("memory://", "faust table store URL (memory:// or rocksdb://)")
    grace_s: float = opt(3.0, "after a rollout's root span, wait this long for spans delivered late "
                              "(a worker's spool after a broker outage; other processes)")
    rollout_timeout_s: float = opt(300.0, "close a rollout with no root span after this long without spans")
    group_timeout_s: float = opt(600.0, "emit a group still short of group_size attempts after this long")
    session_idle_s: float = opt(60.0, "close a rollout no runner manages (a session, a trace, env ids without an "
                                      "attempt id) after this long without a new span")
    reward_timeout_s: float = opt(60.0, "hold a runnerless rollout that closed without a final reward this long "
                                        "for one (delayed feedback); 0: never hold")
    prompt_window_s: float = opt(60.0, "window in which task-less trajectories with the same first prompt form "
                                       "one group")
    baseline_window: int = opt(128, "recent returns per agent behind the baseline of a task-less trajectory "
                                   "with no prompt group")
    group_size: int = opt(DEFAULT_GROUP_SIZE, "attempts per task = GRPO group size")
    forget_after_s: float = opt(3600.0, "how long 'already emitted' markers drop late duplicates")
    tick_s: float = opt(0.5, "timer period for timeouts")
    commit_interval_s: float = opt(1.0, "offset commit period")
    # Assembly (AssemblyConfig)
    agent_match: str | None = opt(None, "regex over agent names: train only the calls of matching agents")
    air_rules_file: str | None = opt(None, "YAML file of AIR rules (default: the built-in rules)")
    require_logprobs: bool = opt(True, "drop calls recorded without behaviour log-probs")
    max_batch_bytes: int | None = opt(None, "size limit of one TrainingBatch part (default: the broker's max "
                                            "message size minus headroom)")
    fast_consumer: bool = opt(True, "skip faust's four-task-per-record wait when nothing can block "
                                    "(streams.fastpath); --no-fast-consumer uses faust's stock delivery")
    log_every_s: float = opt(30.0, "period of the worker's progress log line")
    metrics_port: int | None = opt(None, "serve Prometheus /metrics on this port (0: any free port)")
    metrics_host: str = opt("127.0.0.1", "address of the /metrics server")
    profile: str | None = opt(None, "write a profile of the worker (yappi if installed, else cProfile) "
                                    "here on exit")

    def __post_init__(self) -> None:
        positive = ("rollout_timeout_s", "group_timeout_s", "forget_after_s", "tick_s", "commit_interval_s",
                    "session_idle_s", "prompt_window_s", "baseline_window")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        for name in ("grace_s", "reward_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "must be >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", self.metrics_port, "must be 0-65535")
        if self.group_size < 1:
            raise ConfigError("group_size", self.group_size, "must be >= 1")
        if not self.store.startswith(("memory://", "rocksdb://", "aerospike://")):
            raise ConfigError("store", self.store, "a faust store URL such as memory://")
        if self.max_batch_bytes is not None and self.max_batch_bytes < 1024:
            raise ConfigError("max_batch_bytes", self.max_batch_bytes, "must be >= 1024")
        if self.air_rules_file is not None and not Path(self.air_rules_file).is_file():
            raise ConfigError("air_rules_file", self.air_rules_file, "no such file")
        # Build the assembly config now so its own validation (the agent_match regex) fails at start-up.
        try:
            self.assembly_config()
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


def load_stream_config(
    explicit: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> StreamConfig:
    """Resolve a :class:`StreamConfig` (explicit > env > stack state file > default)."""
    return load(StreamConfig, explicit, env)
