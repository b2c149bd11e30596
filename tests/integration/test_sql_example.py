"""The LangGraph SQL agent (examples/sql) trains through the real pipeline, and ``agent_match`` picks one role.

The agent has no tracing code: the runner process is auto-instrumented the way
``opentelemetry-instrument`` does it (its ``sitecustomize`` on ``PYTHONPATH`` +
``OTEL_*`` variables), which activates OpenInference's LangChain instrumentor.
Every rollout calls the model twice, once per LangGraph node (``sql_writer``,
``answerer``); the inference worker records both calls with token ids, and the
stream app, run with ``--agent-match ^sql_writer$``, must train only the first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import opentelemetry.instrumentation.auto_instrumentation as auto_instrumentation
import pytest

from boltstream.config import Settings
from boltstream.examples.sql import tasks as sql_tasks
from boltstream.runs.pipeline import PipelineConfig, read_jsonl
from boltstream.runs.train import run
from boltstream.stack import settings_env as to_env
from boltstream.streams.span_tree import build_span_tree
from boltstream.streams.spans import attr, has_token_ids, inherited_agent_names
from tests.integration.conftest import read_topic

SQL_AIR_RULES = Path(sql_tasks.__file__).with_name("air.yaml")
SITECUSTOMIZE_DIR = os.path.dirname(auto_instrumentation.__file__)
ROLES = {"sql_writer", "answerer"}


def read_all(settings: Settings, short: str, record: str) -> list[dict[str, Any]]:
    """Every record of a topic up to its end offsets at call time (no waiting on a guess)."""
    return [value for _, _, value in read_topic(settings, short, record, to_end=True, timeout=60)]


def _role(span: dict[str, Any]) -> str | None:
    """The LangGraph node an OpenInference span names in its ``metadata``."""
    raw = attr(span, "metadata")
    return json.loads(raw).get("langgraph_node") if isinstance(raw, str) else None


def _config(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, stream: dict[str, Any],
            env: tuple[tuple[str, str], ...] = (), **changes: Any) -> PipelineConfig:
    """A `boltstream train` run of the SQL agent on the session stack, tiny model, 6 train / 2 test tasks."""
    for key, value in to_env(settings).items():  # train.run(external=True) reads the session stack from env
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("BOLTSTREAM_STATE_FILE", str(tmp_path / "no-stack.json"))
    train, test = sql_tasks.train_test(n_train=6, n_test=2, seed=5)
    for name, tasks in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    run_level: dict[str, Any] = {"model": "tiny", "lora": True, "group_size": 2, "steps": 2, "time_budget_s": 240,
                                 "runner_workers": 4, "eval_samples": 1, **changes}
    return PipelineConfig(
        agent="boltstream.examples.sql.agent:solve", train=tmp_path / "train.jsonl", test=tmp_path / "test.jsonl",
        out=tmp_path / "out", learner={"groups_per_step": 1}, stream={"air_rules_file": SQL_AIR_RULES, **stream},
        extra_env=(
            # what `opentelemetry-instrument` does: its sitecustomize loads every installed instrumentor
            ("PYTHONPATH", SITECUSTOMIZE_DIR),
            ("OTEL_TRACES_EXPORTER", "none"),  # the runner adds boltstream's exporter itself
            ("OTEL_METRICS_EXPORTER", "none"), ("OTEL_LOGS_EXPORTER", "none"),
            # LangChain's spans only: the OpenAI SDK one would sit outside the LangGraph node
            ("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "openai"),
            ("SQL_TEMPERATURE", "1.0"),
            *env,
        ),
        **run_level,
    )


def test_sql_agent_trains_only_the_selected_role(settings: Settings, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(settings, tmp_path, monkeypatch, stream={"agent_match": "^sql_writer$"})
    summary = run(cfg, external=True)

    steps = [r for r in read_jsonl(cfg.out / "metrics.jsonl") if r.get("event") == "step"]
    assert [r["step"] for r in steps][:2] == [1, 2] and all(r["samples"] > 0 for r in steps)
    assert summary["policy_version_served"] >= 2

    spans = read_all(settings, "spans", "Span")
    trajectories = read_all(settings, "trajectories", "Trajectory")
    trained = {t["rollout_id"]: t for t in trajectories}
    assert trained, "no trajectories"
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if span.get("rollout_id") in trained:
            by_rollout.setdefault(span["rollout_id"], []).append(span)

    # The agent called both roles: OpenInference's LLM spans name each LangGraph node.
    client_roles = {_role(s) for group in by_rollout.values() for s in group
                    if attr(s, "openinference.span.kind") == "LLM"}
    assert client_roles == ROLES
    # ... and the worker recorded every one of those calls with token ids (two per finished rollout).
    worker_calls = {rid: [s for s in group if has_token_ids(s)] for rid, group in by_rollout.items()}
    finished = [rid for rid, t in trained.items() if t["status"] == "ok"]
    assert finished and all(len(worker_calls[rid]) == 2 for rid in finished)
    # The httpx instrumentation sends a traceparent: each worker call hangs off the HTTP client span, a
    # sibling of OpenInference's ChatOpenAI span (LangChain's callbacks never make it current). The stream
    # app's time-containment repair puts the call under the ChatOpenAI span, whose metadata names the node.
    role_of_call: dict[str, str | None] = {}
    for rid in finished:
        tree = build_span_tree(by_rollout[rid])
        names = inherited_agent_names(tree.spans, tree.parent_of)
        role_of_call.update((c["span_id"], names[c["span_id"]]) for c in worker_calls[rid])
        assert sorted(names[c["span_id"]] for c in worker_calls[rid]) == ["answerer", "sql_writer"]

    # agent_match: only the sql_writer's call of each rollout became a training turn.
    turns = [turn for rid in finished for turn in trained[rid]["turns"]]
    assert len(turns) == len(finished)
    assert {turn["agent_name"] for turn in turns} == {"sql_writer"}
    assert {turn["span_id"] for turn in turns} == {sid for sid, role in role_of_call.items() if role == "sql_writer"}
    # AIR saw OpenInference's `execute_sql` tool span and rewarded the call that wrote the query.
    tool_spans = {rid: [s for s in by_rollout[rid] if s["name"] == "execute_sql"] for rid in finished}
    for rid in finished:
        (turn,), (tool,) = trained[rid]["turns"], tool_spans[rid]
        expected = {"sql_ran"} | ({"tool_error"} if tool["status"]["code"] == "ERROR" else set())
        assert {r["name"] for r in turn["rewards"]} == expected


def test_sql_agent_with_an_adapter_per_role_trains_the_writer_and_keeps_the_answerer_frozen(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train --roles writer=^sql_writer$ --frozen-roles answerer``: each role's client asks for its adapter by
    model name; one learner trains the writer's calls; the answerer's adapter never moves."""
    cfg = _config(settings, tmp_path, monkeypatch, stream={}, steps=1, roles=("writer=^sql_writer$",),
                  frozen_roles=("answerer=^answerer$",),
                  env=(("SQL_MODEL_WRITER", "writer"), ("SQL_MODEL_ANSWERER", "answerer")))
    summary = run(cfg, external=True)
    assert summary["roles"]["writer"]["learner_steps"] == 1 and summary["learner_steps"] == 1
    assert summary["policy_version_served"] == {"writer": 1, "answerer": 0}
    assert summary["stream"]["agent_match"] == "(?:^sql_writer$)"

    (step,) = [r for r in read_jsonl(cfg.out / "metrics-writer.jsonl") if r.get("event") == "step"]
    role_of_sample = {s["sample_id"]: s["agent_name"] for b in read_all(settings, "batches", "TrainingBatch")
                      for s in b["samples"]}
    assert step["sample_ids"] and {role_of_sample[i] for i in step["sample_ids"]} == {"sql_writer"}
    events = read_all(settings, "checkpoints", "CheckpointEvent")
    assert {e["model"] for e in events} == {"writer"}

    # every worker call was answered by its role's adapter, chosen by the client's model name
    spans = read_all(settings, "spans", "Span")
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_rollout.setdefault(span.get("rollout_id") or "", []).append(span)
    adapter_of_role = {"sql_writer": "writer", "answerer": "answerer"}
    checked = 0
    for group in by_rollout.values():
        tree = build_span_tree(group)
        names = inherited_agent_names(tree.spans, tree.parent_of)
        for call in (s for s in group if has_token_ids(s)):
            if names.get(call["span_id"]) in adapter_of_role:
                assert call["attributes"]["boltstream.adapter"] == adapter_of_role[names[call["span_id"]]]
                checked += 1
            if call["attributes"]["boltstream.adapter"] == "answerer":
                assert call["llm"]["policy_version"] == 0
    assert checked >= 4
