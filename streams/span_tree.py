"""The span tree of one rollout: spans deduplicated, parent links repaired (steps 1-2 of assembly).

Why repairs: spans come from several processes (agent, inference worker), and their parent
links can be missing or point where instrumentation put them rather than where the call ran.
Assembly (streams/assembly.py) reads calls, wrappers and agent names off this tree, so every
repair is a pure rule on span times within one trace:

* a span whose parent is absent is a root; several roots hang under a virtual root
  (``VIRTUAL_ROOT_ID``). An LLM span whose parent is absent ("floating": the inference worker
  got no ``traceparent``) is moved under the tightest span that contains it in time, or under
  the only other root; so is a root whose subtree holds a worker call (an HTTP client span that
  began a trace of its own) when another span strictly contains it;
* a child of the root is moved under the tightest other span that strictly contains it (Agent
  Lightning's ``repair_hierarchy``: an AgentOps LLM span parented to the session but run inside
  an agent span);
* a token-carrying LLM span with no LLM ancestor goes under the tightest token-less LLM span
  containing it (the agent's view of the same call, e.g. LangChain's span when the worker's span
  hangs off a sibling HTTP client span).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .spans import Span, has_token_ids, is_llm_span

logger = logging.getLogger(__name__)

VIRTUAL_ROOT_ID = "virtual-root"


class AssemblyError(ValueError):
    """The spans cannot form a trajectory (no spans, or no rollout id): send them to the DLQ."""


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
