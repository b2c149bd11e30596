"""Acceptance: the README's line, as a user runs it, against a real worker and the real broker.

``OTEL_TRACES_EXPORTER=boltstream opentelemetry-instrument python agent.py``
with a plain ``openai``-SDK agent (two chat turns, no boltstream import), no
other ``OTEL_*`` variable, the rollout ids and broker given by ``BOLTSTREAM_*``
only. OpenTelemetry must start (metrics/logs default to none instead of the
distro's missing OTLP/gRPC exporter), the agent's spans must reach ``spans``,
and the worker's LLM spans must join the agent's trace and rollout through the
``traceparent`` + ``baggage`` headers that the httpx instrumentation injects.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from boltstream.config import Settings
from boltstream.examples.sql import tasks as sql_tasks
from boltstream.inference.launch import WorkerProcess
from tests.integration.streams.stream_helpers import WORKER_ENV
from tests.integration.streams.stream_helpers import WorkerProcess as StreamWorker

# Run the launcher's script with this interpreter: in a normal install that is what its
# shebang says; here a worktree's venv may be a copy whose shebangs name another venv.
INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")
SQL_AIR_RULES = Path(sql_tasks.__file__).with_name("air.yaml")
IDS = {"BOLTSTREAM_ROLLOUT_ID": "ro-zero-1", "BOLTSTREAM_ATTEMPT_ID": "q7:0", "BOLTSTREAM_TASK_ID": "q7"}

PLAIN_AGENT = '''
import os
from openai import OpenAI

client = OpenAI(base_url=os.environ["AGENT_BASE_URL"], api_key="not-needed", max_retries=0)
messages = [{"role": "user", "content": "What is 2+2?"}]
for _ in range(2):
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=1.0)
    print("completion", reply.id)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "And again?"}]
print("turns", len(messages) // 2)
'''


def test_readme_line_trains_a_plain_openai_agent(settings: Settings, settings_env: dict[str, str],
                                                 tmp_path: Path, helpers: Any) -> None:
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024"], env=settings_env,
                           log_path=tmp_path / "worker.log")
    try:
        worker.start(90)
        env = {k: v for k, v in settings_env.items() if not k.startswith(("OTEL_", "OPENINFERENCE_"))}
        env.update(IDS, OTEL_TRACES_EXPORTER="boltstream", AGENT_BASE_URL=f"{worker.url}/v1")
        (tmp_path / "agent.py").write_text(PLAIN_AGENT)
        proc = subprocess.run([sys.executable, str(INSTRUMENT), sys.executable, "agent.py"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "turns 2", proc.stderr[-3000:]
        assert "Failed to auto initialize" not in proc.stderr, proc.stderr[-3000:]

        def worker_calls(recs: list[Any]) -> list[dict[str, Any]]:
            return [r for _, _, r in recs if r["resource"].get("service.name") == "boltstream-inference"]

        recs = helpers.read_topic(settings, "spans", "Span", timeout=30,
                                  until=lambda out: len(worker_calls(out)) >= 2
                                  and len(out) - len(worker_calls(out)) >= 4)
    finally:
        worker.stop()
    served = worker_calls(recs)
    agent = [r for _, _, r in recs if r not in served]
    assert len(served) == 2, [r["name"] for _, _, r in recs]
    # the agent's own spans: the OpenInference LLM spans and the httpx client spans, ids from the env
    assert sum(r["llm"] is not None for r in agent) == 2, [r["name"] for r in agent]
    assert {(r["rollout_id"], r["attempt_id"], r["task_id"]) for r in agent} == {("ro-zero-1", "q7:0", "q7")}
    by_span_id = {r["span_id"]: r for r in agent}
    for call in served:
        # the worker's LLM spans: same rollout (from baggage), same trace, parented by the caller's span
        assert (call["rollout_id"], call["attempt_id"], call["task_id"]) == ("ro-zero-1", "q7:0", "q7")
        assert call["attributes"]["boltstream.assigned"] is True
        caller = by_span_id.get(call["parent_span_id"])
        assert caller is not None, (call["parent_span_id"], sorted(by_span_id))
        assert call["trace_id"] == caller["trace_id"]
        assert call["llm"]["response_token_ids"], call["llm"]


SQL_AGENT = '''
import os, sys
from boltstream.examples.sql.agent import build_graph, make_llms, run_agent

sql_llm, answer_llm = make_llms(os.environ["AGENT_BASE_URL"], model="tiny", temperature=1.0)
print("answer", run_agent(build_graph(sql_llm, answer_llm), sys.argv[1], 0))
'''
# Short timers so the test never waits on production defaults (session idle, prompt window). The reward
# hold is long enough for a feedback sent after the agent exits; a rollout held for one closes on its arrival.
RUNNERLESS = {"BOLTSTREAM_STREAM_SESSION_IDLE_S": "1", "BOLTSTREAM_STREAM_REWARD_TIMEOUT_S": "60",
              "BOLTSTREAM_STREAM_PROMPT_WINDOW_S": "1"}


def run_agent(script: str, env: dict[str, str], tmp_path: Path, *args: str) -> str:
    (tmp_path / "agent.py").write_text(script)
    proc = subprocess.run([sys.executable, str(INSTRUMENT), sys.executable, "agent.py", *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()[-1]


@contextlib.contextmanager
def workers(settings: Settings, settings_env: dict[str, str], tmp_path: Path, boltstream_cmd: list[str],
            *stream_args: str, timers: dict[str, str] = RUNNERLESS) -> Iterator[tuple[WorkerProcess, dict[str, str]]]:
    """A stream worker and ``boltstream serve --model tiny``; yields the inference worker and the agent's env."""
    app_id = f"{settings.namespace}zc-{uuid.uuid4().hex[:6]}"
    stream = StreamWorker([*boltstream_cmd, "stream", "worker", "--app-id", app_id, *stream_args],
                          {**settings_env, **WORKER_ENV, **timers}, tmp_path / "stream.log")
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024"], env=settings_env,
                           log_path=tmp_path / "worker.log")
    try:
        worker.start(90)
        env = {k: v for k, v in settings_env.items() if not k.startswith(("OTEL_", "OPENINFERENCE_"))}
        env.update(OTEL_TRACES_EXPORTER="boltstream", AGENT_BASE_URL=f"{worker.url}/v1")
        yield worker, env
    finally:
        worker.stop()
        assert stream.stop() in (0, -15), stream.log_tail()


def served_calls(settings: Settings, helpers: Any) -> dict[str, dict[str, Any]]:
    spans = helpers.read_topic(settings, "spans", "Span", to_end=True, timeout=30)
    return {r["span_id"]: r for _, _, r in spans if r["resource"].get("service.name") == "boltstream-inference"}


def assert_worker_turns(traj: dict[str, Any], served: dict[str, dict[str, Any]]) -> None:
    """Every turn is one of the worker's calls, with its token ids and logprobs."""
    assert traj["turns"] and all(t["span_id"] in served for t in traj["turns"]), traj["dropped_calls"]
    for turn in traj["turns"]:
        llm = served[turn["span_id"]]["llm"]
        assert turn["prompt_token_ids"] == llm["prompt_token_ids"] and turn["response_token_ids"]
        assert turn["response_logprobs"] == llm["response_logprobs"]
        assert len(turn["response_logprobs"]) == len(turn["response_token_ids"])


def test_a_runnerless_agent_with_delayed_feedback_becomes_one_trajectory_and_reaches_batches(
        settings: Settings, settings_env: dict[str, str], tmp_path: Path, helpers: Any, boltstream_cmd: list[str],
        run_cli: Any) -> None:
    """No runner, no task: the env's rollout id names the rollout; it closes after ``session_idle_s`` and is
    held for a reward; ``boltstream feedback`` by the completion's own ``id``, sent after the agent exited,
    is its reward; its task-less group gets the agent baseline."""
    with workers(settings, settings_env, tmp_path, boltstream_cmd) as (_, env):
        (tmp_path / "agent.py").write_text(PLAIN_AGENT)
        proc = subprocess.run([sys.executable, str(INSTRUMENT), sys.executable, "agent.py"],
                              env={**env, "BOLTSTREAM_ROLLOUT_ID": "ro-zero-2"}, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "turns 2", proc.stderr[-3000:]
        completion = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("completion ")][-1]
        sent = run_cli("feedback", "--completion-id", completion, "--reward", "1")
        assert sent.returncode == 0, sent.stderr[-2000:]
        trajectories = helpers.read_topic(settings, "trajectories", "Trajectory", count=1, timeout=90)
        batches = helpers.read_topic(settings, "batches", "TrainingBatch", count=1, timeout=30)
    assert len(trajectories) == 1
    key, traj = trajectories[0][1], trajectories[0][2]
    assert (traj["rollout_id"], traj["task_id"], traj["status"], traj["final_reward"]) == ("ro-zero-2", "", "ok", 1.0)
    served = served_calls(settings, helpers)
    assert len(served) == 2 and len(traj["turns"]) == 2
    assert_worker_turns(traj, served)
    assert key.startswith(b"prompt:")  # task-less: grouped by the first prompt's fingerprint
    (batch,) = [b for _, _, b in batches]
    assert {s["rollout_id"] for s in batch["samples"]} == {"ro-zero-2"} and batch["complete"]
    assert {s["reward"] for s in batch["samples"]} == {1.0}
    assert all(s["advantage"] == 0.0 for s in batch["samples"])  # no peers, no history yet: advantage 0


def test_an_env_id_agent_asking_for_another_providers_model_closes_at_exit(
        settings: Settings, settings_env: dict[str, str], tmp_path: Path, helpers: Any,
        boltstream_cmd: list[str]) -> None:
    """The two last frictions of zero code, with the stream app's default timers (session_idle_s 60 s):
    an agent written for OpenAI asks for ``gpt-4o-mini`` (the worker serves it as an alias of its
    policy), and its rollout, given by env ids, closes when the process exits (the exporter's
    ``boltstream.rollout.end``), not a minute later. Its reward comes as feedback right after the exit."""
    with workers(settings, settings_env, tmp_path, boltstream_cmd, timers={}) as (worker, env):
        (tmp_path / "agent.py").write_text(PLAIN_AGENT.replace('model="tiny"', 'model="gpt-4o-mini"'))
        proc = subprocess.run([sys.executable, str(INSTRUMENT), sys.executable, "agent.py"],
                              env={**env, **IDS, "BOLTSTREAM_ROLLOUT_ID": "ro-zero-3"},
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        exited = time.monotonic()
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "turns 2", proc.stderr[-3000:]
        completion = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("completion ")][-1]
        r = httpx.post(f"{worker.url}/v1/feedback", json={"completion_id": completion, "reward": 1.0}, timeout=30)
        assert r.status_code == 202, r.text
        trajectories = helpers.read_topic(settings, "trajectories", "Trajectory", count=1,
                                          timeout=max(1.0, 30.0 - (time.monotonic() - exited)))
        closed_after = time.monotonic() - exited
    assert closed_after < 30.0
    (traj,) = [t for _, _, t in trajectories]
    assert (traj["rollout_id"], traj["task_id"], traj["status"], traj["final_reward"]) == ("ro-zero-3", "q7", "ok", 1.0)
    served = served_calls(settings, helpers)
    assert len(served) == 2 and len(traj["turns"]) == 2
    assert {s["attributes"]["gen_ai.request.model"] for s in served.values()} == {"gpt-4o-mini"}
    assert_worker_turns(traj, served)
    assert "serving model name 'gpt-4o-mini' as an alias of tiny" in worker.log_path.read_text()


def test_the_sql_langgraph_agent_standalone_trains_the_selected_node(
        settings: Settings, settings_env: dict[str, str], tmp_path: Path, helpers: Any, boltstream_cmd: list[str],
        run_cli: Any) -> None:
    """The SQL example's LangGraph agent run as a plain script, no runner, one env id. LangChain's callbacks
    never make a span current, so each HTTP call (and the worker's span under it) begins a trace of its own:
    the env id keeps them in one rollout, and the stream app places each call under the LangChain span
    containing it in time, so ``--agent-match`` picks the node. Its reward comes later, by rollout id."""
    question = sql_tasks.train_test(n_train=1, n_test=1, seed=5)[0][0]["question"]
    with workers(settings, settings_env, tmp_path, boltstream_cmd, "--agent-match", "^sql_writer$",
                 "--air-rules-file", str(SQL_AIR_RULES)) as (_, env):
        env.update(BOLTSTREAM_ROLLOUT_ID="sql-standalone-1",
                   OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="openai")  # LangChain's LLM spans only, as the example
        assert run_agent(SQL_AGENT, env, tmp_path, question).startswith("answer")
        sent = run_cli("feedback", "--rollout-id", "sql-standalone-1", "--reward", "0.5")
        assert sent.returncode == 0, sent.stderr[-2000:]
        trajectories = helpers.read_topic(settings, "trajectories", "Trajectory", count=1, timeout=90)
        batches = helpers.read_topic(settings, "batches", "TrainingBatch", count=1, timeout=30)
    (traj,) = [t for _, _, t in trajectories]
    served = served_calls(settings, helpers)
    assert len(served) == 2, "one call per LangGraph node"
    assert (traj["rollout_id"], traj["task_id"], traj["status"]) == ("sql-standalone-1", "", "ok")
    assert traj["final_reward"] == 0.5
    assert_worker_turns(traj, served)
    assert [t["agent_name"] for t in traj["turns"]] == ["sql_writer"] and traj["dropped_calls"] == []
    (batch,) = [b for _, _, b in batches]
    assert [s["rollout_id"] for s in batch["samples"]] == ["sql-standalone-1"]
