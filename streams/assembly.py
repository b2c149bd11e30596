"""Spans of one rollout attempt -> a Trajectory (``schemas/trajectory/v2.avsc``).

Why this is its own pure step: spans arrive out of order, repeated (Kafka is
at-least-once), from several processes (agent, inference worker) whose parent
links can be missing. Turning them into an ordered list of trainable LLM calls
must give the same answer however they arrived, so the stream app can replay.

Steps:

1. Dedupe spans by ``span_id`` (the first copy is kept).
2. Build the span tree. A span whose parent is absent is a root; several roots
   hang under a virtual root (``VIRTUAL_ROOT_ID``). An LLM span whose parent is
   absent ("floating": e.g. the inference worker got no ``traceparent``) is moved
   under the tightest span that contains it in time, or under the only other root;
   so is a root whose subtree holds a worker call (an HTTP client span that
   began a trace of its own) when another span strictly contains it.
   Two more time-containment repairs (same trace only): a child of the root is
   moved under the tightest other span that strictly contains it (Agent
   Lightning's ``repair_hierarchy``: an AgentOps LLM span parented to the session
   but run inside an agent span), and a token-carrying LLM span with no LLM
   ancestor goes under the tightest token-less LLM span containing it (the
   agent's view of the same call, e.g. LangChain's span when the worker's span
   hangs off a sibling HTTP client span). Both then follow from the tree: the
   wrapper rule below and agent-name inheritance.
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
from dataclasses import dataclass, field
from typing import Any

from boltstream.schemas import records

from .air import CallRef, evaluate_air
from .evaluations import evaluation_rewards
from .settings import AssemblyConfig
from .spans import (
    RewardInfo,
    Span,
    attr,
    has_token_ids,
    inherited_agent_names,
    is_llm_span,
    is_rollout_root,
    reward_of,
    span_ids,
    span_kind,
    status_code,
    status_message,
)
from .validate import span_problems, summarise, trajectory_problems

logger = logging.getLogger(__name__)

Trajectory = dict[str, Any]
VIRTUAL_ROOT_ID = "virtual-root"
TRAJECTORY_STATUSES = ("ok", "failed", "timeout", "abandoned")
# The task id of a rollout that names none (production traffic, a session): not an error; the group
# stage then groups it by prompt fingerprint or gives it a per-agent baseline (streams/baselines.py).
NO_TASK = ""


class AssemblyError(ValueError):
    """The spans cannot form a trajectory (no spans, or no rollout id): send them to the DLQ."""


class InvalidRollout(AssemblyError):
    """The spans form a trajectory that must not be trained on (streams/validate.py): send them to the DLQ."""


@dataclass
class SpanTree:
    """Unique spans of a rollout with repaired parent links.

    ``parent_of`` maps every span id to its parent id, ``VIRTUAL_ROOT_ID`` for the
    roots when there are several, or None for the single root.
    """

    spans: dict[str, Span]
    parent_of: dict[str, str | None]
    root_id: str
    duplicate_spans: int = 0
    reparented: list[str] = field(default_factory=list)

    def children(self, span_id: str) -> list[str]:
        """Child span ids of ``span_id`` ordered by start time (linear scan; for tests and tools)."""
        kids = [sid for sid, parent in self.parent_of.items() if parent == span_id]
        return sorted(kids, key=lambda sid: (self.spans[sid].get("start_time_ns", 0), sid))

    def ancestors(self, span_id: str) -> list[str]:
        """Ancestor ids of ``span_id``, nearest first (the virtual root included when present)."""
        out: list[str] = []
        current = self.parent_of.get(span_id)
        while current is not None and current not in out:
            out.append(current)
            current = self.parent_of.get(current)
        return out


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


def dedupe_spans(spans: Iterable[Span]) -> tuple[dict[str, Span], int]:
    """Unique spans by ``span_id`` (first copy wins) and how many copies were dropped."""
    unique: dict[str, Span] = {}
    duplicates = 0
    for span in spans:
        span_id = span.get("span_id")
        if not span_id:
            raise AssemblyError("span without span_id")
        if span_id in unique:
            duplicates += 1
            continue
        unique[span_id] = span
    return unique, duplicates


def _contains(outer: Span, inner: Span) -> bool:
    start, end = inner.get("start_time_ns", 0), inner.get("end_time_ns", 0)
    return outer.get("start_time_ns", 0) <= start and outer.get("end_time_ns", 0) >= end


def _is_descendant(candidate: str, ancestor: str, parent_of: Mapping[str, str | None]) -> bool:
    seen: set[str] = set()
    current: str | None = candidate
    while current is not None and current not in seen:
        if current == ancestor:
            return True
        seen.add(current)
        current = parent_of.get(current)
    return False


def _break_cycles(parent_of: dict[str, str | None]) -> None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in parent_of:
        path: list[str] = []
        current: str | None = start
        while current is not None and state.get(current) is None:
            state[current] = 1
            path.append(current)
            nxt = parent_of.get(current)
            if nxt is not None and state.get(nxt) == 1:
                logger.warning("span parent cycle at %s; cut", current)
                parent_of[current] = None
                nxt = None
            current = nxt
        for span_id in path:
            state[span_id] = 2


def _same_trace(a: Span, b: Span) -> bool:
    return a.get("trace_id") == b.get("trace_id")


def _by_duration(ids: Iterable[str], unique: Mapping[str, Span]) -> list[tuple[int, int, int, str]]:
    """(duration, start, end, id) sorted tightest first, ties to the later start (the :func:`_tightest` order)."""
    rows = []
    for cid in ids:
        start, end = unique[cid].get("start_time_ns", 0), unique[cid].get("end_time_ns", 0)
        rows.append((end - start, start, end, cid))
    rows.sort(key=lambda r: (r[0], -r[1], r[3]))
    return rows


def _tightest(sid: str, unique: Mapping[str, Span], parent_of: Mapping[str, str | None],
              candidates: Sequence[tuple[int, int, int, str]], *, strict: bool,
              any_trace: bool = False) -> str | None:
    """The first of ``candidates`` (:func:`_by_duration` order) of ``sid``'s trace containing it in time,
    outside its subtree: the shortest such span.

    ``strict``: the container must be longer than ``sid`` (Agent Lightning's rule, so two
    spans of equal times never adopt each other).
    """
    span = unique[sid]
    start, end, trace_id = span.get("start_time_ns", 0), span.get("end_time_ns", 0), span.get("trace_id")
    for duration, c_start, c_end, cid in candidates:
        if (c_start <= start and c_end >= end and cid != sid and (not strict or duration > end - start)
                and (any_trace or unique[cid].get("trace_id") == trace_id)
                and not _is_descendant(cid, sid, parent_of)):
            return cid
    return None


def _adopt_floating_calls(unique: Mapping[str, Span], parent_of: dict[str, str | None]) -> list[str]:
    """Move a root whose subtree holds a worker call under the tightest span that strictly contains it.

    Why: an HTTP client span started while no span was current (LangChain's callbacks never
    make their LLM span current) begins a trace of its own, with the worker's call under it.
    In a rollout named by an id or session, times say which agent-side call it served.
    """
    roots = {sid for sid, parent in parent_of.items() if parent is None}
    if len(roots) < 2:
        return []
    carrying = set()
    for sid, span in unique.items():
        if has_token_ids(span):
            top = sid
            while (up := parent_of.get(top)) is not None:
                top = up
            if not is_llm_span(unique[top]):  # a floating LLM span was placed already
                carrying.add(top)
    if not carrying:
        return []
    candidates = _by_duration(unique, unique)
    moved: list[str] = []
    for sid in sorted(carrying, key=lambda c: (unique[c].get("start_time_ns", 0), c)):
        best = _tightest(sid, unique, parent_of, candidates, strict=True, any_trace=True)
        if best is not None:
            parent_of[sid] = best
            moved.append(sid)
    return moved


def _repair_root_children(unique: Mapping[str, Span], parent_of: dict[str, str | None]) -> list[str]:
    """Move a root's children under the tightest other span of the trace that contains them in time.

    Why: mixed tracing systems (AgentOps' decorators next to its LLM instrumentation, an
    HTTP client span whose LangChain caller never became the current span) hang spans
    off the session root although they ran inside an agent or LLM span. Agent Lightning's
    adapter repairs the same way (``TraceTree.repair_hierarchy``): a root with a single
    child is a session wrapper, so the repair applies to the first level with several.
    """
    kids: dict[str, list[str]] = {}
    for sid, parent in parent_of.items():
        if parent is not None:
            kids.setdefault(parent, []).append(sid)
    moved: list[str] = []
    for root in [sid for sid, parent in parent_of.items() if parent is None]:
        level = root
        while len(kids.get(level, ())) == 1:
            level = kids[level][0]
        children = kids.get(level, [])
        if len(children) < 2:
            continue
        subtree: list[str] = []
        stack = list(children)
        while stack:
            current = stack.pop()
            subtree.append(current)
            stack.extend(kids.get(current, ()))
        candidates = _by_duration(subtree, unique)
        for sid in sorted(children, key=lambda c: (unique[c].get("start_time_ns", 0), c)):
            best = _tightest(sid, unique, parent_of, candidates, strict=True)
            if best is not None:
                parent_of[sid] = best
                moved.append(sid)
    return moved


def _attach_to_wrappers(unique: Mapping[str, Span], parent_of: dict[str, str | None]) -> list[str]:
    """Put each token-carrying LLM span with no LLM ancestor under the tightest token-less LLM span containing it.

    Why: the agent's client-side LLM span (OpenInference's LangChain span, the OpenAI SDK's)
    and the worker's span are the same call seen twice; with HTTP instrumentation the
    worker's span hangs off the HTTP client span, which LangChain's callbacks leave a
    SIBLING of their LLM span. Containment in time (same trace) says which call it was,
    so the client span is recognised as a wrapper and its agent name reaches the call.
    """
    tokenless = [sid for sid, s in unique.items() if is_llm_span(s) and not has_token_ids(s)]
    if not tokenless:
        return []
    llm_ids = {sid for sid, s in unique.items() if is_llm_span(s)}
    candidates = _by_duration(tokenless, unique)
    moved: list[str] = []
    for sid, span in unique.items():
        if not has_token_ids(span) or any(a in llm_ids for a in _ancestors(sid, parent_of)):
            continue
        best = _tightest(sid, unique, parent_of, candidates, strict=False)
        if best is not None:
            parent_of[sid] = best
            moved.append(sid)
    return moved


def _ancestors(sid: str, parent_of: Mapping[str, str | None]) -> list[str]:
    out: list[str] = []
    current = parent_of.get(sid)
    while current is not None and current not in out:
        out.append(current)
        current = parent_of.get(current)
    return out


def build_span_tree(spans: Iterable[Span], *, reparent_floating_llm: bool = True) -> SpanTree:
    """Dedupe ``spans`` and build their tree (virtual root, floating-LLM repair)."""
    unique, duplicates = dedupe_spans(spans)
    if not unique:
        raise AssemblyError("no spans")
    parent_of: dict[str, str | None] = {}
    for span_id, span in unique.items():
        parent = span.get("parent_span_id")
        parent_of[span_id] = parent if parent in unique and parent != span_id else None
    _break_cycles(parent_of)

    reparented: list[str] = []
    floating = [sid for sid, parent in parent_of.items() if parent is None and is_llm_span(unique[sid])]
    if reparent_floating_llm and floating and len(unique) > 1:
        floating.sort(key=lambda sid: (unique[sid].get("start_time_ns", 0), sid))
        left: list[str] = []
        for sid in floating:
            span = unique[sid]
            best: tuple[int, int, str] | None = None
            for cid, candidate in unique.items():
                if cid == sid or not _contains(candidate, span) or _is_descendant(cid, sid, parent_of):
                    continue
                duration = candidate.get("end_time_ns", 0) - candidate.get("start_time_ns", 0)
                key = (duration, -candidate.get("start_time_ns", 0), cid)
                if best is None or key < best:
                    best = key
            if best is None:
                left.append(sid)
            else:
                parent_of[sid] = best[2]
                reparented.append(sid)
        other_roots = [sid for sid, parent in parent_of.items() if parent is None and sid not in left]
        if left and len(other_roots) == 1:
            for sid in left:
                parent_of[sid] = other_roots[0]
                reparented.append(sid)

    if reparent_floating_llm:
        reparented += _adopt_floating_calls(unique, parent_of)
        reparented += _repair_root_children(unique, parent_of)
        reparented += _attach_to_wrappers(unique, parent_of)

    roots = [sid for sid, parent in parent_of.items() if parent is None]
    if len(roots) == 1:
        root_id = roots[0]
    else:
        root_id = VIRTUAL_ROOT_ID
        for sid in roots:
            parent_of[sid] = VIRTUAL_ROOT_ID
    return SpanTree(unique, parent_of, root_id, duplicates, reparented)


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
    tree = build_span_tree(spans, reparent_floating_llm=config.reparent_floating_llm)
    stats = AssemblyStats(
        spans=len(tree.spans), duplicate_spans=tree.duplicate_spans, reparented_llm_spans=len(tree.reparented)
    )
    roots = [s for s in tree.spans.values() if is_rollout_root(s)]
    root = min(roots, key=lambda s: (s.get("start_time_ns", 0), s["span_id"])) if roots else None
    rid, aid, tid = _resolve_ids(tree, root, rollout_id, attempt_id, task_id)
    problems = span_problems(tree.spans.values())
    if problems:
        raise InvalidRollout(f"rollout {rid}: {summarise(problems)}")

    kinds = {sid: span_kind(s) for sid, s in tree.spans.items()}
    llm_ids = [sid for sid, kind in kinds.items() if kind.llm]
    with_ids = {sid for sid in llm_ids if has_token_ids(tree.spans[sid])}
    without_ids = set(llm_ids) - with_ids  # the only spans that can be wrappers
    wrappers: set[str] = set()
    if without_ids:
        for sid in with_ids:
            wrappers.update(a for a in tree.ancestors(sid) if a in without_ids)
    stats.wrapper_spans = len(wrappers)
    calls: list[Span] = []
    seen_responses: set[tuple[tuple[int, ...], tuple[int, ...], int]] = set()
    for span in sorted(
        (tree.spans[sid] for sid in llm_ids if sid not in wrappers),
        key=lambda s: (s.get("start_time_ns", 0), s.get("end_time_ns", 0), s["span_id"]),
    ):
        if has_token_ids(span):
            llm = span["llm"]
            key = (tuple(llm["prompt_token_ids"]), tuple(llm["response_token_ids"]), span.get("start_time_ns", 0))
            if key in seen_responses:
                stats.duplicate_responses += 1
                continue
            seen_responses.add(key)
        calls.append(span)
    stats.llm_calls = len(calls)

    agent_names = inherited_agent_names(tree.spans, tree.parent_of)
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
    turns = []
    for index, span in enumerate(kept):
        llm = span["llm"]
        rewards = air.rewards_by_call.get(span["span_id"], [])
        stats.air_rewards += len(rewards)
        evaluations = evaluated.get(span["span_id"], [])
        stats.evaluation_rewards += len(evaluations)
        rewards = [*rewards, *evaluations]
        turns.append(
            {
                "call_index": index,
                "span_id": span["span_id"],
                "prompt_token_ids": list(llm["prompt_token_ids"]),
                "response_token_ids": list(llm["response_token_ids"]),
                "response_logprobs": list(llm.get("response_logprobs") or []),
                "policy_version": int(llm.get("policy_version", -1)),
                "agent_name": agent_names.get(span["span_id"]),
                "model": llm.get("model"),
                "start_time_ns": int(span.get("start_time_ns", 0)),
                "rewards": [dict(r) for r in rewards],
                # What the response logprobs were computed at: the learner scores the call at it.
                "temperature": llm.get("temperature"),
            }
        )

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
