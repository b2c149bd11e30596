"""examples/sql: the seeded database, the question generator, the reward, the graph, and its spans.

No network and no model: the graph runs on LangChain's fake chat model, and the
spans come from OpenInference's LangChain instrumentor into an in-memory exporter.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel

from boltstream.examples.sql import db, tasks
from boltstream.examples.sql.agent import build_graph, extract_sql, make_llms, parse_answer, reward, run_agent
from boltstream.producers.normalise import normalise_span
from boltstream.streams.air import CallRef, evaluate_air
from boltstream.streams.spans import inherited_agent_names, is_llm_span, is_tool_span, own_agent_name


def test_database_is_deterministic_per_seed() -> None:
    rows = lambda seed: db.query("SELECT * FROM orders ORDER BY id", seed, max_rows=1000)  # noqa: E731
    assert rows(0) == rows(0) and len(rows(0)) == 60
    assert rows(0) != rows(1)


def test_each_connection_is_a_private_read_only_copy() -> None:
    with pytest.raises(sqlite3.OperationalError):
        db.query("DROP TABLE orders")
    assert db.query("SELECT COUNT(*) FROM orders") == [(60,)]


def test_a_runaway_query_is_cut_short() -> None:
    started = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="interrupt"):
        db.query("SELECT COUNT(*) FROM orders a, orders b, orders c, orders d, orders e")
    assert time.monotonic() - started < 10


def test_splits_are_seeded_disjoint_and_answered_by_the_database() -> None:
    train, test = tasks.train_test(n_train=40, n_test=10, seed=3)
    assert (train, test) == tasks.train_test(n_train=40, n_test=10, seed=3)
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert len({t["task_id"] for t in train + test}) == 50
    by_question = {q["question"]: q for q in tasks.all_questions()}
    for task in train + test:
        assert set(task) == {"task_id", "id", "question", "answer", "kind", "db_seed"}
        assert task["answer"] == str(db.query(by_question[task["question"]]["sql"])[0][0])
    with pytest.raises(ValueError, match="distinct questions"):
        tasks.train_test(n_train=1000, n_test=10)


def test_question_sets_are_named_and_the_default_split_is_unchanged() -> None:
    assert tasks.kinds_named("mixed") == tasks.KIND_SETS["mixed"] and len(tasks.all_questions()) == 81
    counts = tasks.kinds_named("counts")
    questions = tasks.all_questions(0, counts)
    assert {q["kind"] for q in questions} == set(counts) and len(questions) == 44
    assert all(q["sql"].startswith("SELECT COUNT(*) FROM ") and " JOIN " not in q["sql"] for q in questions)
    assert "How many products cost more than 50?" not in {q["question"] for q in questions}  # the worked example
    assert tasks.kinds_named("price, counts,price") == ("price", *counts)
    assert set(tasks.kinds_named("all")) == set(tasks.TEMPLATES)
    with pytest.raises(ValueError, match="unknown question kind 'countz'"):
        tasks.kinds_named("countz")
    train, test = tasks.train_test(n_train=30, n_test=14, seed=0, kinds=counts)
    assert {t["kind"] for t in train + test} <= set(counts) and len({t["question"] for t in train + test}) == 44


def test_tasks_cli_names_a_bad_kind(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        tasks.main(["--kinds", "nope", "--train", str(tmp_path / "a"), "--test", str(tmp_path / "b")])
    assert exc.value.code == 2 and "unknown question kind 'nope'" in capsys.readouterr().err
    assert tasks.main(["--kinds", "counts", "--n-train", "30", "--n-test", "14",
                       "--train", str(tmp_path / "a"), "--test", str(tmp_path / "b")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "b").read_text().splitlines()]
    assert len(rows) == 14 and all(r["kind"] in tasks.KIND_SETS["counts"] for r in rows)


@pytest.mark.parametrize(("answer", "expected", "value"), [
    ("3", "3", 1.0), ("3.0", "3", 1.0), (" 3. ", "3", 1.0), ("4", "3", 0.0), (None, "3", 0.0),
    ("'porto'", "Porto", 1.0), ("Lyon", "Porto", 0.0), ("three", "3", 0.0),
])
def test_reward_is_an_exact_match(answer: str | None, expected: str, value: float) -> None:
    assert reward(answer, expected) == value


def test_parsing_the_models_replies() -> None:
    assert extract_sql("```sql\nSELECT 1; DROP TABLE x\n```") == "SELECT 1"
    assert parse_answer("ANSWER: Porto") == "Porto"
    assert parse_answer("I think it is 3") is None


def _graph(sql: str, answer: str) -> Any:
    return build_graph(FakeListChatModel(responses=[sql]), FakeListChatModel(responses=[answer]))


def test_the_graph_answers_through_the_database() -> None:
    question = "How many customers live in Oslo?"
    expected = str(db.query("SELECT COUNT(*) FROM customers WHERE city = 'Oslo'")[0][0])
    graph = _graph("SELECT COUNT(*) FROM customers WHERE city = 'Oslo'", f"ANSWER: {expected}")
    assert reward(run_agent(graph, question), expected) == 1.0


def test_failed_sql_reaches_the_answerer_as_an_error() -> None:
    answerer = FakeListChatModel(responses=["ANSWER: 0"])
    graph = build_graph(FakeListChatModel(responses=["SELEC nonsense"]), answerer)
    state = graph.invoke({"question": "How many?"})
    assert state["result"].startswith("ERROR:") and state["answer"] == "0"


@pytest.fixture
def langchain_spans() -> Iterator[Any]:
    """OpenInference's LangChain instrumentor writing to a private provider, removed afterwards."""
    from openinference.instrumentation.langchain import LangChainInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


def test_openinference_spans_name_each_role_and_fail_the_tool(langchain_spans: Any) -> None:
    """What the stream app reads: the node of every LLM span, and a failed query as a tool error."""
    _graph("SELECT nope FROM customers", "ANSWER: 1").invoke({"question": "q"})
    spans = {s["span_id"]: s for s in map(normalise_span, langchain_spans.get_finished_spans())}
    parent_of = {sid: s["parent_span_id"] for sid, s in spans.items()}
    llm = [s for s in spans.values() if is_llm_span(s)]
    assert sorted(own_agent_name(s) for s in llm) == ["answerer", "sql_writer"]
    names = inherited_agent_names(spans, parent_of)
    (tool,) = [s for s in spans.values() if is_tool_span(s)]
    assert tool["name"] == "execute_sql" and tool["status"]["code"] == "ERROR"
    assert names[tool["span_id"]] == "run_sql"
    assert json.loads(tool["attributes"]["input.value"])["query"] == "SELECT nope FROM customers"
    # the default tool_error rule would charge the query's writer
    writer = next(s for s in llm if own_agent_name(s) == "sql_writer")
    air = evaluate_air(spans.values(), [CallRef(s["span_id"], s["end_time_ns"]) for s in llm], parent_of=parent_of)
    assert [r["name"] for r in air.rewards_by_call.get(writer["span_id"], [])] == ["tool_error"]


def test_each_role_can_ask_for_its_own_model_name() -> None:
    """One adapter per role: the worker picks ``--adapters writer,answerer`` by the request's ``model``."""
    shared = make_llms("http://127.0.0.1:1/v1", model="policy")
    assert [llm.model_name for llm in shared] == ["policy", "policy"]
    per_role = make_llms("http://127.0.0.1:1/v1", model="policy", writer_model="writer", answerer_model="answerer")
    assert [llm.model_name for llm in per_role] == ["writer", "answerer"]
    assert [llm.max_tokens for llm in per_role] == [48, 16]


def test_rows_returned_rewards_a_query_that_found_something() -> None:
    from boltstream.examples.sql.air_rules import rows_returned

    def tool(output: object, code: str = "OK", name: str = "execute_sql") -> dict:
        return {"name": name, "status": {"code": code}, "attributes": {"output.value": output}}

    assert rows_returned(tool("3")) == 0.1
    assert rows_returned(tool('{"content": "Oslo", "type": "tool"}')) == 0.1  # a ToolMessage as JSON
    assert rows_returned(tool("(no rows)")) is None
    assert rows_returned(tool("0")) is None  # a count of nothing: what a made-up filter returns
    assert rows_returned(tool('{"content": "(no rows)"}')) is None
    assert rows_returned(tool("3", code="ERROR")) is None  # the query failed: tool_error's business
    assert rows_returned(tool("3", name="answerer")) is None
    assert rows_returned(tool(None)) is None


def test_easy_first_puts_joins_last_and_keeps_the_order_within() -> None:
    from boltstream.examples.sql.tasks import easy_first

    tasks = [{"id": 1, "kind": "customer_orders"}, {"id": 2, "kind": "price"},
             {"id": 3, "kind": "product_quantity"}, {"id": 4, "kind": "city_count"}]
    assert [t["id"] for t in easy_first(tasks)] == [2, 4, 1, 3]


def test_quotes_the_question_rewards_filtering_by_a_value_the_question_names() -> None:
    import json

    from boltstream.examples.sql.air_rules import quotes_the_question

    def call(question: str, reply: str) -> dict:
        asked = [{"role": "system", "content": "You write SQL"}, {"role": "user", "content": question}]
        said = [{"role": "assistant", "content": reply, "finish_reason": "stop"}]
        return {"name": "chat policy", "attributes": {"gen_ai.input.messages": json.dumps(asked),
                                                      "gen_ai.output.messages": json.dumps(said)}}

    q = "How many customers live in Oslo?"
    assert quotes_the_question(call(q, "SELECT COUNT(*) FROM customers WHERE city = 'Oslo'")) == 0.1
    assert quotes_the_question(call(q, "SELECT COUNT(*) FROM customers WHERE city = 'oslo'")) == 0.1
    assert quotes_the_question(call(q, "SELECT COUNT(*) FROM orders WHERE customer_id = 1000")) is None
    assert quotes_the_question(call(q, "SELECT COUNT(*) FROM customers WHERE city = 'Paris'")) is None
    assert quotes_the_question(call(q, "SELECT * FROM t WHERE x = 'O'")) is None  # one letter is no value
    assert quotes_the_question({"name": "execute_sql", "attributes": {"output.value": "3"}}) is None


def test_the_readmes_learning_run_is_what_the_cli_accepts(tmp_path, monkeypatch) -> None:
    """The documented defaults (examples/sql/README.md) must keep parsing as the code changes."""
    import re
    import shlex
    from pathlib import Path

    from boltstream.runs.train import config_from_args, parser

    readme = (Path(tasks.__file__).parent / "README.md").read_text()
    block = readme.split("## The run that learns", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(c) for c in re.sub(r"\\\n\s*", " ", block).strip().splitlines()]
    make_tasks, train = commands
    assert make_tasks[:3] == ["python", "-m", "boltstream.examples.sql.tasks"]
    (tmp_path / "examples").symlink_to(Path(tasks.__file__).parents[1])  # they run from the checkout's root
    monkeypatch.chdir(tmp_path)  # the commands as typed
    assert tasks.main(make_tasks[3:]) == 0
    args = parser().parse_args(train[train.index("train") + 1:])
    assert "SQL_MODEL_WRITER=writer" in train and train[train.index("boltstream") - 1] == "none"
    cfg = config_from_args(args, tmp_path, agent=args.agent, train=args.train, test=args.test)
    assert len(args.test.read_text().splitlines()) == 14
    assert (cfg.roles, cfg.frozen_roles, cfg.group_size) == (("writer=^sql_writer$",), ("answerer=^answerer$",), 8)
