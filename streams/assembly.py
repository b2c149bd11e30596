"""Spans of one rollout attempt -> a Trajectory (``schemas/trajectory/v3.avsc``).

Why this is its own pure step: spans arrive out of order, repeated (Kafka is
at-least-once), from several processes (agent, inference worker) whose parent
links can be missing. Turning them into an ordered list of trainable LLM calls
must give the same answer however they arrived, so the stream app can replay.

Steps:

1. Dedupe spans by ``span_id`` (the first copy is kept).
2. Build the span tree with its time-containment repairs (streams/span_tree.py);
   the wrapper rule and agent-name inheritance below then follow from the tree.
3. LLM calls = LLM spans, minus client-side wrappers (an LLM span without token
   ids whose subtree holds an LLM span with token ids: the same call seen from the
   agent), ordered by start time; of two calls with identical prompt and response
   token ids and the same start, one is kept.
4. Agent names are inherited from the nearest ancestor naming one; calls whose
   agent does not match ``agent_match`` are not trained (not reported either).
5. A wanted call without token ids / logprobs is never guessed: it goes to
   ``dropped_calls`` with the reason.
6. AIR rules attach intermediate rewards to calls; final rewards, status, error
   and timings come from the ``boltstream.rollout`` span and final reward spans.
7. A rollout carrying a value training must not see (a non-finite reward, a
   NaN/inf/positive logprob, a negative or inverted span time; see
   streams/validate.py) raises :class:`InvalidRollout`: the stream app
   dead-letters it whole instead of emitting it.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from boltstream.schemas import records
from boltstream.schemas.packed import F32, I32, as_array, pack

from .air import CallRef, evaluate_air
from .core_config import AssemblyConfig
from .evaluations import evaluation_rewards
from .span_tree import AssemblyError, SpanTree, build_span_tree
from .spans import (
    RewardInfo,
    Span,
    SpanFlags,
    attr,
    has_token_ids,
    inherited_agent_names,
    is_feedback,
    is_rollout_root,
    reward_of,
    span_flags,
    span_ids,
    status_code,
    status_message,
)
from .validate import span_problems, summarise, trajectory_problems

logger = logging.getLogger(__name__)

Trajectory = dict[str, Any]
TRAJECTORY_STATUSES = ("ok", "failed", "timeout", "abandoned")
# The task id of a rollout that names none (production traffic, a session): not an error; the group
# stage then groups it by prompt fingerprint or gives it a per-agent baseline (streams/baselines.py).
NO_TASK = ""


class InvalidRollout(AssemblyError):
    """The spans form a trajectory that must not be trained on (streams/validate.py): send them to the DLQ."""


@dataclass
class AssemblyStats:
    """Counters of one assembly, for logs and metrics."""

    spans: int = 0
    duplicate_spans: int = 0
    reparented_llm_spans: int = 0
    llm_calls: int = 0
    wrapper_spans: int = 0
    duplicate_responses: int = 0
    filtered_by_agent: int = 0
    dropped_calls: int = 0
    trained_calls: int = 0
    air_rewards: int = 0
    air_rewards_unattached: int = 0
    evaluation_rewards: int = 0
    other_run_spans: int = 0


def split_other_runs(spans: list[Span]) -> tuple[list[Span], list[Span]]:
    """(this run's spans, spans of another run of the same attempt) around the rollout's root span.

    Why: an attempt re-run after its runner died (docs/producers.md, "The runner") keeps its ids, so
    the dead run's spans (LLM calls the inference worker answered, its root if it got out) share the
    rollout's key with the re-run's. Each ``boltstream.rollout`` opens a new trace, so with the
    earliest root as this run: a span of ANOTHER trace that started before that root started, or
    after it ended, cannot belong to it. Spans in the root's trace are always kept (a timed-out
    run's late spans), and so is everything when there is no root (a runnerless rollout), and every
    delayed feedback (``boltstream feedback`` opens a trace of its own after the run ended). A span
    of another trace inside the root's time window is kept too: the worker's LLM span of a call
    that carried the ids but no ``traceparent``. This relies on the clocks of the hosts that stamp
    the root and those spans agreeing within the gap between a crash and the re-run (seconds).
    """
    roots = [s for s in spans if is_rollout_root(s) and s.get("trace_id")]
    if not roots:
        return spans, []
    root = min(roots, key=lambda s: (s.get("start_time_ns", 0), s["span_id"]))
    trace, start, end = root["trace_id"], root.get("start_time_ns", 0), root.get("end_time_ns", 0)
    mine, others = [], []
    for s in spans:
        outside = s.get("start_time_ns", 0) < start or s.get("start_time_ns", 0) > end
        other = s.get("trace_id") and s["trace_id"] != trace and outside and not is_feedback(s)
        (others if other else mine).append(s)
    return mine, others


def _resolve_ids(
    tree: SpanTree, root: Span | None, rollout_id: str | None, attempt_id: str | None, task_id: str | None
) -> tuple[str, str, str]:
    ids = [rollout_id, attempt_id, task_id]
    if root is not None:
        for index, value in enumerate(span_ids(root)):
            ids[index] = ids[index] or value
    for index in range(3):
        if ids[index] is None:
            counts = Counter(v for v in (span_ids(s)[index] for s in tree.spans.values()) if v)
            if counts:
                ids[index] = counts.most_common(1)[0][0]
    rid, aid, tid = ids
    if not rid:
        raise AssemblyError("cannot determine rollout_id")
    return rid, aid or rid, tid or NO_TASK


def _drop_reason(span: Span, require_logprobs: bool) -> str | None:
    llm = span.get("llm")
    if llm is None:
        return "no llm block: token ids not recorded"
    prompt, response = llm.get("prompt_token_ids") or [], llm.get("response_token_ids") or []
    if not prompt:
        return "empty prompt_token_ids"
    if not response:
        return "empty response_token_ids"
    logprobs = llm.get("response_logprobs") or []
    if not logprobs:
        return "no response_logprobs" if require_logprobs else None
    if len(logprobs) != len(response):
        return f"response_logprobs length {len(logprobs)} != response tokens {len(response)}"
    return None


def _final_rewards(spans: Iterable[Span], extra: Iterable[RewardInfo] = ()) -> tuple[float | None, list[dict[str, Any]]]:
    infos = sorted(
        [*(info for info in map(reward_of, spans) if info is not None and info.final), *extra],
        key=lambda info: (info.time_ns, info.span_id),
    )
    rewards = [{"name": i.name, "value": i.value, "source": i.span_id} for i in infos]
    if not infos:
        return None, rewards
    primaries = [info for info in infos if info.primary]
    if primaries:
        return primaries[-1].value, rewards
    if len({info.name for info in infos}) > 1:
        logger.warning("several final rewards %s and none primary; using the first", [i.name for i in infos])
    return infos[0].value, rewards


def _status(root: Span | None, status: str | None, error: str | None) -> tuple[str, str | None]:
    if status is None:
        if root is None:
            status = "abandoned"
        else:
            status = attr(root, records.STATUS) or ("failed" if status_code(root) == "ERROR" else "ok")
    if status not in TRAJECTORY_STATUSES:
        logger.warning("unknown rollout status %r; kept as is", status)
    if error is None and root is not None:
        error = attr(root, records.ERROR) or (status_message(root) if status_code(root) == "ERROR" else None)
    return status, error


def _llm_calls(tree: SpanTree, kinds: Mapping[str, SpanFlags], stats: AssemblyStats) -> list[Span]:
    """The rollout's LLM calls in time order: without wrappers (an LLM span without token ids
    around one with them: the same call seen twice) and without repeated responses (the same
    prompt, response and start time from two instrumentations)."""
    llm_ids = [sid for sid, kind in kinds.items() if kind.llm]
    with_ids = {sid for sid in llm_ids if has_token_ids(tree.spans[sid])}
    without_ids = set(llm_ids) - with_ids  # the only spans that can be wrappers
    wrappers: set[str] = set()
    if without_ids:
        for sid in with_ids:
            wrappers.update(a for a in tree.ancestors(sid) if a in without_ids)
    stats.wrapper_spans = len(wrappers)
    calls: list[Span] = []
    seen_responses: set[tuple[bytes, bytes, int]] = set()
    for span in sorted(
        (tree.spans[sid] for sid in llm_ids if sid not in wrappers),
        key=lambda s: (s.get("start_time_ns", 0), s.get("end_time_ns", 0), s["span_id"]),
    ):
        if has_token_ids(span):
            llm = span["llm"]
            # The ids' bytes, not tuples of ints: one memcpy per span instead of a Python int per token.
            key = (pack(llm["prompt_token_ids"], I32), pack(llm["response_token_ids"], I32), span.get("start_time_ns", 0))
            if key in seen_responses:
                stats.duplicate_responses += 1
                continue
            seen_responses.add(key)
        calls.append(span)
    return calls


def _trained_calls(calls: list[Span], agent_names: Mapping[str, str | None], config: AssemblyConfig,
                   stats: AssemblyStats) -> tuple[list[Span], list[dict[str, str]]]:
    """(calls to train, calls dropped with their reason): ``agent_match`` filters first (not
    dropped: not ours to train), then a call without usable ids or logprobs is dropped."""
    pattern = re.compile(config.agent_match) if config.agent_match is not None else None
    kept: list[Span] = []
    dropped: list[dict[str, str]] = []
    for span in calls:
        name = agent_names.get(span["span_id"])
        if pattern is not None and (name is None or pattern.search(name) is None):
            stats.filtered_by_agent += 1
            continue
        reason = _drop_reason(span, config.require_logprobs)
        if reason is not None:
            dropped.append({"span_id": span["span_id"], "reason": reason})
            continue
        kept.append(span)
    stats.dropped_calls, stats.trained_calls = len(dropped), len(kept)
    return kept, dropped


def _turn(index: int, span: Span, air_rewards: Sequence[Mapping[str, Any]], evaluations: Sequence[Mapping[str, Any]],
          agent_names: Mapping[str, str | None], stats: AssemblyStats) -> dict[str, Any]:
    """One Trajectory turn of a kept LLM call, with its intermediate rewards (AIR, then evaluations)."""
    llm = span["llm"]
    stats.air_rewards += len(air_rewards)
    stats.evaluation_rewards += len(evaluations)
    rewards = [*air_rewards, *evaluations]
    return {
        "call_index": index,
        "span_id": span["span_id"],
        # Decoded spans hold arrays already (kept as they are, no copy); lists are converted.
        "prompt_token_ids": as_array(llm["prompt_token_ids"], I32),
        "response_token_ids": as_array(llm["response_token_ids"], I32),
        "response_logprobs": as_array(llm.get("response_logprobs") or (), F32),
        "policy_version": int(llm.get("policy_version", -1)),
        "agent_name": agent_names.get(span["span_id"]),
        "model": llm.get("model"),
        "start_time_ns": int(span.get("start_time_ns", 0)),
        "rewards": [dict(r) for r in rewards],
        # What the response logprobs were computed at: the learner scores the call at it.
        "temperature": llm.get("temperature"),
    }


def assemble_trajectory_with_stats(
    spans: Iterable[Span],
    config: AssemblyConfig | None = None,
    *,
    rollout_id: str | None = None,
    attempt_id: str | None = None,
    task_id: str | None = None,
    status: str | None = None,
    error: str | None = None,
) -> tuple[Trajectory, AssemblyStats]:
    """Like :func:`assemble_trajectory` (same arguments), also returning the counters."""
    config = config or AssemblyConfig()
    spans = list(spans)
    if attempt_id is not None:
        spans = [s for s in spans if s.get("attempt_id") in (None, attempt_id)]
    spans, other_runs = split_other_runs(spans)
    tree = build_span_tree(spans, reparent_floating_llm=config.reparent_floating_llm)
    stats = AssemblyStats(
        spans=len(tree.spans), duplicate_spans=tree.duplicate_spans, reparented_llm_spans=len(tree.reparented),
        other_run_spans=len(other_runs),
    )
    if other_runs:
        logger.info("rollout %s: %d span(s) of another run of the attempt left out: %s", spans[0].get("rollout_id"),
                    len(other_runs), sorted({s.get("trace_id") for s in other_runs}))
    roots = [s for s in tree.spans.values() if is_rollout_root(s)]
    root = min(roots, key=lambda s: (s.get("start_time_ns", 0), s["span_id"])) if roots else None
    rid, aid, tid = _resolve_ids(tree, root, rollout_id, attempt_id, task_id)
    problems = span_problems(tree.spans.values())
    if problems:
        raise InvalidRollout(f"rollout {rid}: {summarise(problems)}")

    kinds = {sid: span_flags(s) for sid, s in tree.spans.items()}
    calls = _llm_calls(tree, kinds, stats)
    stats.llm_calls = len(calls)

    agent_names = inherited_agent_names(tree.spans, tree.parent_of)
    kept, dropped = _trained_calls(calls, agent_names, config, stats)
    if dropped:
        logger.info("rollout %s attempt %s: %d call(s) dropped: %s", rid, aid, len(dropped), dropped)

    air = evaluate_air(
        tree.spans.values(),
        [CallRef(s["span_id"], int(s.get("end_time_ns", 0))) for s in calls],
        config.air_rules,
        tree.parent_of,
        kinds,
    )
    stats.air_rewards_unattached = len(air.unattached)
    evaluated, evaluation_finals = evaluation_rewards(tree.spans.values(), calls)  # streams/evaluations.py
    turns = [_turn(index, span, air.rewards_by_call.get(span["span_id"], []),
                   evaluated.get(span["span_id"], []), agent_names, stats) for index, span in enumerate(kept)]

    final_reward, final_rewards = _final_rewards((s for sid, s in tree.spans.items() if kinds[sid].reward),
                                                 evaluation_finals)
    stats.evaluation_rewards += len(evaluation_finals)
    final_status, final_error = _status(root, status, error)
    if root is not None:
        start_ns, end_ns = int(root.get("start_time_ns", 0)), int(root.get("end_time_ns", 0))
    else:
        start_ns = min(int(s.get("start_time_ns", 0)) for s in tree.spans.values())
        end_ns = max(int(s.get("end_time_ns", 0)) for s in tree.spans.values())
    trajectory = dict(
        rollout_id=rid, attempt_id=aid, task_id=tid, turns=turns, final_reward=final_reward, rewards=final_rewards,
        status=final_status, error=final_error, start_time_ns=start_ns, end_time_ns=end_ns,
        span_count=len(tree.spans), dropped_calls=dropped,
    )
    problems = trajectory_problems(trajectory)
    if problems:
        raise InvalidRollout(f"rollout {rid}: {summarise(problems)}")
    logger.debug("assembled rollout %s attempt %s: %s", rid, aid, stats)
    return trajectory, stats


def assemble_trajectory(spans: Iterable[Span], config: AssemblyConfig | None = None, **overrides: str | None) -> Trajectory:
    """Spans of one rollout attempt -> a Trajectory dict.

    ``overrides`` (keyword-only, all optional): ``rollout_id``, ``attempt_id``,
    ``task_id``, ``status``, ``error``. Ids default to the ``boltstream.rollout``
    span's, then to the most common promoted ids; ``attempt_id`` given explicitly
    also drops spans stamped with a different attempt. ``status``/``error``
    override the root's (the stream app passes ``status="abandoned"`` when it
    closes a rollout whose root never came; without a root span and without
    ``status`` the status is "abandoned"). A rollout naming no task gets the task
    id ``NO_TASK`` (""). Raises :class:`AssemblyError` when no rollout id can be found.
    """
    return assemble_trajectory_with_stats(spans, config, **overrides)[0]
