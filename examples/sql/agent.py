"""A LangGraph agent that answers questions over the shop database, with two LLM roles.

    START -> sql_writer (LLM) -> run_sql (tool) -> answerer (LLM) -> END

``sql_writer`` turns the question into one SQLite query; ``run_sql`` executes it
through a LangChain tool (``execute_sql``; a query SQLite rejects makes the tool
raise, so its span has status ERROR); ``answerer`` reads the result and writes
``ANSWER: <value>``. Both roles call the same model through LangChain's
``ChatOpenAI``, so any OpenAI-compatible endpoint works.

There is no tracing code here: run it under ``opentelemetry-instrument`` with
``openinference-instrumentation-langchain`` installed and every node, LLM call
and tool run becomes a span, each LLM call carrying its LangGraph node
(``langgraph_node`` in the span's ``metadata``) — which is what boltstream's
``agent_match`` selects a role by. The only boltstream-shaped code is
:func:`solve`, the runner's entry point.
"""

from __future__ import annotations

import os
import re
from typing import Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from . import db

SQL_SYSTEM = (
    "You write one SQLite query that answers the question. The tables are:\n"
    f"{db.SCHEMA_PROMPT}\n"
    "Reply with the query only, on one line."
)
SQL_EXAMPLE: list[BaseMessage] = [
    HumanMessage("How many products cost more than 50?"),
    AIMessage("SELECT COUNT(*) FROM products WHERE price > 50"),
]
ANSWER_SYSTEM = (
    "You answer a question about a shop from the result of an SQL query. "
    "Reply with one line 'ANSWER: <value>'."
)
ANSWER_EXAMPLE: list[BaseMessage] = [
    HumanMessage("Question: How many products cost more than 50?\nResult: 4"),
    AIMessage("ANSWER: 4"),
]
ANSWER_RE = re.compile(r"ANSWER:\s*(.+)", re.IGNORECASE)
_FENCE = re.compile(r"```(?:sql)?", re.IGNORECASE)


class State(TypedDict, total=False):
    question: str
    db_seed: int
    sql: str
    result: str
    answer: str | None


def extract_sql(text: str) -> str:
    """The query in a model's reply: code fences removed, up to the first ``;``."""
    return _FENCE.sub("", text).strip().split(";")[0].strip()


def format_rows(rows: list[tuple]) -> str:
    """A single value as itself (what most questions need); several rows as a short list."""
    if len(rows) == 1 and len(rows[0]) == 1:
        return str(rows[0][0])
    return "; ".join(", ".join(str(v) for v in row) for row in rows) or "(no rows)"


@tool
def execute_sql(query: str, db_seed: int = 0) -> str:
    """Run one read-only SQLite query on the shop database and return its rows."""
    return format_rows(db.query(query, db_seed))  # sqlite3.Error propagates: the tool run fails


def parse_answer(text: str) -> str | None:
    match = ANSWER_RE.search(text)
    return match.group(1).strip() if match else None


def build_graph(sql_llm: BaseChatModel, answer_llm: BaseChatModel) -> Any:
    """The compiled graph; the two roles may use different models (or the same one)."""

    def sql_writer(state: State) -> State:
        reply = sql_llm.invoke([SystemMessage(SQL_SYSTEM), *SQL_EXAMPLE, HumanMessage(state["question"])])
        return {"sql": extract_sql(str(reply.content))}

    def run_sql(state: State) -> State:
        try:
            result = execute_sql.invoke({"query": state["sql"], "db_seed": state.get("db_seed", 0)})
        except Exception as exc:  # the model's SQL failed: the answerer sees the error
            result = f"ERROR: {exc}"
        return {"result": result}

    def answerer(state: State) -> State:
        prompt = f"Question: {state['question']}\nResult: {state['result']}"
        reply = answer_llm.invoke([SystemMessage(ANSWER_SYSTEM), *ANSWER_EXAMPLE, HumanMessage(prompt)])
        return {"answer": parse_answer(str(reply.content))}

    graph = StateGraph(State)
    graph.add_node("sql_writer", sql_writer)
    graph.add_node("run_sql", run_sql)
    graph.add_node("answerer", answerer)
    graph.add_edge(START, "sql_writer")
    graph.add_edge("sql_writer", "run_sql")
    graph.add_edge("run_sql", "answerer")
    graph.add_edge("answerer", END)
    return graph.compile()


def make_llms(base_url: str, *, model: str = "policy", temperature: float = 0.7,
              headers: dict[str, str] | None = None, api_key: str = "unused",
              writer_model: str | None = None, answerer_model: str | None = None) -> tuple[ChatOpenAI, ChatOpenAI]:
    """The two roles' chat models against one OpenAI-compatible endpoint.

    ``writer_model`` / ``answerer_model`` (default ``model``) give each role a model name of its own: a worker
    serving ``--adapters writer,answerer`` answers each role with its adapter, chosen by the ``model`` field.
    """
    common = {"base_url": base_url, "api_key": api_key, "temperature": temperature,
              "default_headers": headers, "max_retries": 0, "stop": ["\n"]}
    return (ChatOpenAI(model=writer_model or model, max_tokens=48, **common),
            ChatOpenAI(model=answerer_model or model, max_tokens=16, **common))


def run_agent(graph: Any, question: str, db_seed: int = 0) -> str | None:
    """Ask one question; returns the answer string or None when the model gave none."""
    return graph.invoke({"question": question, "db_seed": db_seed}).get("answer")


def _normal(value: str) -> str:
    return value.strip().strip(".'\"`").strip().casefold()


def reward(answer: str | None, expected: str) -> float:
    """Exact match after trimming quotes and case; numbers compare by value (``3.0`` == ``3``)."""
    if answer is None:
        return 0.0
    got, want = _normal(answer), _normal(str(expected))
    try:
        return 1.0 if abs(float(got) - float(want)) < 1e-6 else 0.0
    except ValueError:
        return 1.0 if got == want else 0.0


def solve(task: dict, ctx: Any) -> float:
    """Entry point for ``boltstream runner --agent boltstream.examples.sql.agent:solve``.

    ``ctx.openai_base_url`` is the inference worker's URL with the rollout's ids
    in the path. Why not ``default_headers=ctx.headers`` as the calculator does:
    those headers carry a W3C ``traceparent`` fixed when the client is built (the
    rollout's root span), and OpenInference's LangChain tracer never makes its
    spans the current OTel context, so the worker's LLM span would hang off the
    root and lose its LangGraph node. Without a ``traceparent`` the stream app
    places the worker's span under the tightest span that contains it in time
    (the ``ChatOpenAI`` span of that call), whose ``metadata`` names the node.

    ``SQL_MODEL`` names the model both roles ask for; ``SQL_MODEL_WRITER`` /
    ``SQL_MODEL_ANSWERER`` override it per role (one adapter per role).
    """
    sql_llm, answer_llm = make_llms(
        ctx.openai_base_url, model=os.environ.get("SQL_MODEL", "policy"),
        temperature=float(os.environ.get("SQL_TEMPERATURE", "0.7")),
        writer_model=os.environ.get("SQL_MODEL_WRITER"), answerer_model=os.environ.get("SQL_MODEL_ANSWERER"),
    )
    answer = run_agent(build_graph(sql_llm, answer_llm), task["question"], int(task.get("db_seed", 0)))
    return reward(answer, task["answer"])
