"""Time-containment repairs of the span tree: HTTP-instrumented worker calls and AgentOps-shaped traces.

The expected calls of the AgentOps cases are worked out by hand with Agent
Lightning's adapter (``TraceTree.repair_hierarchy`` then ``find_llm_calls``):
the session root has several children, so every child strictly contained in
time by another span of the trace moves under the tightest one; an agent span
names its subtree by ``operation.name``; a call is selected when the nearest
agent above it matches ``agent_match``.
"""

from __future__ import annotations

from typing import Any

import pytest

from boltstream.streams import AssemblyConfig, assemble_trajectory_with_stats, build_span_tree
from boltstream.streams.spans import inherited_agent_names, is_tool_span
from tests.unit.streams.factory import llm_span, span

NO_AIR = AssemblyConfig(air_rules=())
SESSION = {"rollout_id": "s1", "attempt_id": None, "task_id": None}


def _sql_trace(http_under_chain: bool = False) -> list[dict[str, Any]]:
    """The SQL example with httpx instrumentation (times in ns, one trace).

    rollout [0,1000]
      chain sql_writer [100,400]  -> ChatOpenAI LLM span [110,390] (metadata names the node)
      chain answerer   [500,800]  -> ChatOpenAI LLM span [510,790]
      POST (httpx) [120,380] -> worker call w1 [130,370]   <- the httpx span hangs off the root,
      POST (httpx) [520,780] -> worker call w2 [530,770]      a sibling of LangChain's LLM span
    ``http_under_chain``: the HTTP spans hang off the LangGraph chain span instead (a tracer that makes
    chains but not LLM calls current): still siblings of the LLM span, no longer children of the root.
    """
    def chain(sid: str, node: str, start: int, end: int) -> dict[str, Any]:
        return span(sid, name="LangGraph", start=start, end=end,
                    attrs={"openinference.span.kind": "CHAIN", "metadata": f'{{"langgraph_node": "{node}"}}'})

    def chat(sid: str, parent: str, node: str, start: int, end: int) -> dict[str, Any]:
        return span(sid, name="ChatOpenAI", parent=parent, start=start, end=end,
                    attrs={"openinference.span.kind": "LLM", "metadata": f'{{"langgraph_node": "{node}"}}'})

    return [
        span("root", name="boltstream.rollout", parent=None, start=0, end=1000,
             attrs={"boltstream.rollout_id": "r1", "boltstream.task_id": "t1", "boltstream.status": "ok"}),
        chain("c1", "sql_writer", 100, 400), chat("lc1", "c1", "sql_writer", 110, 390),
        chain("c2", "answerer", 500, 800), chat("lc2", "c2", "answerer", 510, 790),
        span("h1", name="POST", start=120, end=380, parent="c1" if http_under_chain else "root"),
        llm_span("w1", [1, 2], [3], start=130, end=370, parent="h1"),
        span("h2", name="POST", start=520, end=780, parent="c2" if http_under_chain else "root"),
        llm_span("w2", [4, 5], [6], start=530, end=770, parent="h2"),
    ]


@pytest.mark.parametrize("http_under_chain", [False, True])
def test_worker_call_under_a_sibling_http_span_is_wrapped_by_the_langchain_span(http_under_chain: bool) -> None:
    traj, stats = assemble_trajectory_with_stats(_sql_trace(http_under_chain),
                                                 AssemblyConfig(air_rules=(), agent_match="^sql_writer$"))
    assert [t["span_id"] for t in traj["turns"]] == ["w1"]
    assert traj["turns"][0]["agent_name"] == "sql_writer"
    assert traj["dropped_calls"] == []  # the LangChain spans are wrappers, not token-less calls
    assert stats.wrapper_spans == 2 and stats.filtered_by_agent == 1


@pytest.mark.parametrize("http_under_chain", [False, True])
def test_every_worker_call_inherits_its_langgraph_node(http_under_chain: bool) -> None:
    tree = build_span_tree(_sql_trace(http_under_chain))
    names = inherited_agent_names(tree.spans, tree.parent_of)
    assert (names["w1"], names["w2"]) == ("sql_writer", "answerer")


def test_an_http_span_that_began_its_own_trace_is_adopted_by_the_call_containing_it() -> None:
    """Run standalone, nothing is current when LangChain calls the model: each HTTP client span begins a trace
    of its own (the rollout is named by env ids or a session). Strict containment still places it."""
    other = "f" * 32
    spans = [{**s, "trace_id": other, "parent_span_id": None if s["span_id"] == "h2" else s["parent_span_id"]}
             if s["span_id"] in ("h2", "w2") else s for s in _sql_trace()]
    traj = assemble_trajectory_with_stats(spans, AssemblyConfig(air_rules=(), agent_match="^answerer$"))[0]
    assert [t["span_id"] for t in traj["turns"]] == ["w2"] and traj["dropped_calls"] == []
    tree = build_span_tree(spans)
    assert tree.parent_of["h2"] == "lc2"


def test_the_outermost_root_is_never_moved() -> None:
    spans = [span("root", parent=None, start=0, end=10), llm_span("w", [1], [2], start=2, end=3, parent="root"),
             span("other", parent=None, start=0, end=10)]  # equal times: not strictly containing
    assert build_span_tree(spans).parent_of["root"] != "other"


def _agentops(**ids: Any) -> list[dict[str, Any]]:
    """An AgentOps session (times in ns): LLM and tool spans parented to the session span.

    session [0,100]
      writer  agent [10,40]   (agentops.span.kind=agent, operation.name=writer)
      checker agent [50,90]   (operation.name=checker)
      l1 LLM [15,20], t1 tool [21,30] (ERROR), l2 LLM [55,60], l3 LLM [92,95]: all parented to the session
    """
    ids = {**SESSION, **ids}

    def agent(sid: str, name: str, start: int, end: int) -> dict[str, Any]:
        return span(sid, name=f"{name}.agent", start=start, end=end, **ids,
                    attrs={"agentops.span.kind": "agent", "operation.name": name})

    return [
        span("root", name="run_one.session", parent=None, start=0, end=100, attrs={"agentops.span.kind": "session"},
             **ids),
        agent("a_w", "writer", 10, 40), agent("a_c", "checker", 50, 90),
        llm_span("l1", [1], [2], start=15, end=20, **ids),
        span("t1", name="execute_sql.tool", start=21, end=30, status="ERROR", **ids,
             attrs={"agentops.span.kind": "tool", "operation.name": "execute_sql"}),
        llm_span("l2", [3], [4], start=55, end=60, **ids),
        llm_span("l3", [5], [6], start=92, end=95, **ids),
    ]


@pytest.mark.parametrize(("agent_match", "expected"), [
    ("writer", ["l1"]),  # Agent Lightning: l1 re-parented under writer, the only call in its subtree
    ("checker", ["l2"]),
    (None, ["l1", "l2", "l3"]),  # no filter: every call, l3 (outside both agents) included
])
def test_agent_match_selects_the_calls_agent_lightning_selects(agent_match: str | None,
                                                               expected: list[str]) -> None:
    traj = assemble_trajectory_with_stats(_agentops(), AssemblyConfig(air_rules=(), agent_match=agent_match))[0]
    assert [t["span_id"] for t in traj["turns"]] == expected


def test_agentops_agent_span_names_its_calls() -> None:
    tree = build_span_tree(_agentops())
    assert tree.parent_of["l1"] == "a_w" and tree.parent_of["l2"] == "a_c" and tree.parent_of["l3"] == "root"
    names = inherited_agent_names(tree.spans, tree.parent_of)
    assert (names["l1"], names["l2"], names["l3"]) == ("writer", "checker", None)


def test_agentops_tool_span_counts_for_air() -> None:
    spans = _agentops()
    assert is_tool_span(next(s for s in spans if s["span_id"] == "t1"))
    traj = assemble_trajectory_with_stats(spans, AssemblyConfig(agent_match="writer"))[0]
    assert [r["name"] for r in traj["turns"][0]["rewards"]] == ["tool_error"]


def test_session_wrapper_with_a_single_child_is_looked_through() -> None:
    """Agent Lightning: a root with one child (AgentOps' synthetic session) repairs that child's children."""
    spans = _agentops()
    outer = span("outer", name="session", parent=None, start=0, end=100, **SESSION)
    spans = [outer, *({**s, "parent_span_id": "outer"} if s["span_id"] == "root" else s for s in spans)]
    tree = build_span_tree(spans)
    assert tree.parent_of["l1"] == "a_w"


def test_equal_times_never_adopt_each_other() -> None:
    spans = [span("root", parent=None, start=0, end=10), span("a", start=2, end=5), span("b", start=2, end=5)]
    tree = build_span_tree(spans)
    assert tree.parent_of["a"] == tree.parent_of["b"] == "root"
