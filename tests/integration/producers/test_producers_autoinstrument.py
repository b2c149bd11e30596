"""Acceptance: an unmodified OpenAI-SDK agent, auto-instrumented, configured by env vars only.

``OTEL_TRACES_EXPORTER=boltstream opentelemetry-instrument python agent.py``
with the OpenInference OpenAI instrumentation, against a tiny local
OpenAI-compatible server; a consumer reads the spans back from the real broker
with rollout ids, messages and token counts normalised.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from boltstream.config import Settings

INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")

PLAIN_AGENT = '''
import os
from openai import OpenAI

client = OpenAI(base_url=os.environ["AGENT_BASE_URL"], api_key="not-needed")
reply = client.chat.completions.create(
    model="test-model", temperature=0.3,
    messages=[{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}],
)
print(reply.choices[0].message.content)
'''

ROLLOUT_AGENT = '''
import os
import boltstream
from openai import OpenAI

with boltstream.rollout(task_id="q-ctx", attempt=1) as ctx:
    client = OpenAI(base_url=os.environ["AGENT_BASE_URL"], api_key="not-needed", default_headers=ctx.headers)
    reply = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    boltstream.emit_reward(1.0, final=True)
print(ctx.rollout_id)
'''


class FakeOpenAI(BaseHTTPRequestHandler):
    seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        FakeOpenAI.seen.append((self.path, dict(self.headers), body))
        reply = json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1_700_000_000, "model": "test-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def openai_server() -> Iterator[str]:
    FakeOpenAI.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def run_agent(script: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "agent.py"
    path.write_text(script)
    proc = subprocess.run([str(INSTRUMENT), sys.executable, str(path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture
def agent_env(settings_env: dict[str, str], openai_server: str) -> dict[str, str]:
    env = {k: v for k, v in settings_env.items() if not k.startswith(("OTEL_", "OPENINFERENCE_"))}
    env.update(OTEL_TRACES_EXPORTER="boltstream", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
               OTEL_SERVICE_NAME="calc-agent", OTEL_BSP_SCHEDULE_DELAY="100", AGENT_BASE_URL=openai_server)
    return env


def test_env_only_agent(settings: Settings, agent_env: dict[str, str], tmp_path: Path, helpers: Any) -> None:
    env = dict(agent_env, BOLTSTREAM_ROLLOUT_ID="ro-env-1", BOLTSTREAM_ATTEMPT_ID="q1:0", BOLTSTREAM_TASK_ID="q1")
    proc = run_agent(PLAIN_AGENT, tmp_path, env)
    assert proc.stdout.strip() == "4"
    recs = helpers.read_topic(settings, "spans", "Span", count=1, timeout=30)
    llm_spans = [(key, r) for _, key, r in recs if r["llm"] is not None]
    assert len(llm_spans) == 1, [r["name"] for _, _, r in recs]
    key, span = llm_spans[0]
    assert key == b"ro-env-1"
    assert (span["rollout_id"], span["attempt_id"], span["task_id"]) == ("ro-env-1", "q1:0", "q1")
    assert span["attributes"]["boltstream.span.kind"] == "llm"
    assert span["attributes"]["openinference.span.kind"] == "LLM"
    llm = span["llm"]
    assert (llm["model"], llm["input_tokens"], llm["output_tokens"]) == ("test-model", 12, 1)
    assert llm["temperature"] == pytest.approx(0.3)
    messages_in = json.loads(span["attributes"]["gen_ai.input.messages"])
    assert messages_in == [{"role": "system", "parts": [{"type": "text", "content": "Answer with a number."}]},
                           {"role": "user", "parts": [{"type": "text", "content": "What is 2+2?"}]}]
    messages_out = json.loads(span["attributes"]["gen_ai.output.messages"])
    assert messages_out[0]["role"] == "assistant" and messages_out[0]["parts"][0]["content"] == "4"
    assert span["resource"]["service.name"] == "calc-agent"


def test_agent_with_one_rollout_block(settings: Settings, agent_env: dict[str, str], tmp_path: Path,
                                      helpers: Any) -> None:
    proc = run_agent(ROLLOUT_AGENT, tmp_path, agent_env)
    rollout_id = proc.stdout.strip().splitlines()[-1]
    recs = helpers.read_topic(settings, "spans", "Span", count=3, timeout=30)
    by_name = {r["name"]: r for _, _, r in recs}
    assert {"boltstream.rollout", "boltstream.reward"} <= set(by_name), list(by_name)
    llm = next(r for _, _, r in recs if r["llm"] is not None)
    assert {r["rollout_id"] for _, _, r in recs} == {rollout_id}
    assert llm["attempt_id"] == "q-ctx:1" and llm["trace_id"] == by_name["boltstream.rollout"]["trace_id"]
    assert by_name["boltstream.reward"]["attributes"]["boltstream.reward.final"] is True
    (path, headers, _), = FakeOpenAI.seen
    lower = {k.lower(): v for k, v in headers.items()}
    assert lower["x-boltstream-rollout-id"] == rollout_id and lower["x-boltstream-task-id"] == "q-ctx"
