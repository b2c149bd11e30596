"""boltstream.streams: the stream app's pure core (assembly, AIR, credit, grouping).

Why a pure core: everything that decides *what* is trained - which spans form a
rollout, which calls are kept, which rewards they get, how the group is
normalised - is plain functions over record dicts, unit-testable and replayable.
The Faust app (imported separately, never from here) only moves records between
topics and tables.
"""

from .air import (
    BUILTIN_MATCHERS,
    DEFAULT_AIR_RULES,
    AirResult,
    AirRule,
    CallRef,
    air_rules_from_dicts,
    air_rules_from_yaml,
    evaluate_air,
)
from .assembly import AssemblyStats, assemble_trajectory, assemble_trajectory_with_stats
from .core_config import AssemblyConfig, CreditConfig
from .credit import (
    GroupCredit,
    RolloutReturns,
    discounted_returns,
    group_baseline,
    group_credit,
    grpo_advantage,
    merge_turns,
    rollout_returns,
    step_rewards,
    trajectory_samples,
)
from .grouping import (
    DEFAULT_MAX_BATCH_BYTES,
    batch_id_for,
    build_training_batches,
    estimate_batch_overhead,
    estimate_sample_bytes,
    group_key,
    split_samples,
)
from .span_tree import VIRTUAL_ROOT_ID, AssemblyError, SpanTree, build_span_tree, dedupe_spans
from .spans import (
    attr,
    has_token_ids,
    inherited_agent_names,
    is_llm_span,
    is_reward_span,
    is_rollout_root,
    is_tool_span,
    own_agent_name,
    reward_of,
    span_ids,
)

__all__ = [
    "BUILTIN_MATCHERS",
    "DEFAULT_AIR_RULES",
    "DEFAULT_MAX_BATCH_BYTES",
    "VIRTUAL_ROOT_ID",
    "AirResult",
    "AirRule",
    "AssemblyConfig",
    "AssemblyError",
    "AssemblyStats",
    "CallRef",
    "CreditConfig",
    "GroupCredit",
    "RolloutReturns",
    "SpanTree",
    "air_rules_from_dicts",
    "air_rules_from_yaml",
    "assemble_trajectory",
    "assemble_trajectory_with_stats",
    "attr",
    "batch_id_for",
    "build_span_tree",
    "build_training_batches",
    "dedupe_spans",
    "discounted_returns",
    "group_key",
    "estimate_batch_overhead",
    "estimate_sample_bytes",
    "evaluate_air",
    "group_baseline",
    "group_credit",
    "grpo_advantage",
    "has_token_ids",
    "inherited_agent_names",
    "is_llm_span",
    "is_reward_span",
    "is_rollout_root",
    "is_tool_span",
    "merge_turns",
    "own_agent_name",
    "reward_of",
    "rollout_returns",
    "span_ids",
    "split_samples",
    "step_rewards",
    "trajectory_samples",
]
