"""Tool calls in answers (non-streaming and streaming), with an engine that 'samples' a fixed reply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from boltstream.inference.backend import Completion, Generation, SamplingParams, TokenCallback
from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.server import create_app
from boltstream.weights.models import byte_tokenizer

REPLY = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


class ScriptedBackend:
    """Implements the Backend interface and always answers REPLY (+ <|im_end|>)."""

    model_name = "tiny"
    max_context = 4096
    adapters: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.tokenizer = byte_tokenizer()
        self.policy_version = 7

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def version_of(self, adapter: str | None) -> int:
        return self.policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: TokenCallback | None = None, adapter: str | None = None) -> Generation:
        ids = [*self.tokenizer.encode(REPLY, add_special_tokens=False), self.tokenizer.eos_token_id]
        for t in ids:
            if on_token is not None:
                on_token(0, t, -0.5)
        return Generation(prompt_ids, [Completion(ids, [-0.5] * len(ids), "stop", REPLY)], self.policy_version)

    async def load_weights(self, path: Path, kind: str, version: int, adapter: str | None = None) -> None:
        raise NotImplementedError


def _client(sink: MemorySpanSink) -> TestClient:
    return TestClient(create_app(ScriptedBackend(), sink=sink, served_names=("tiny",)))


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "2+3?"}], "tools": TOOLS, **kw}


def test_tool_calls_are_returned_and_the_span_keeps_the_raw_tokens() -> None:
    sink = MemorySpanSink()
    with _client(sink) as c:
        r = c.post("/v1/chat/completions", json=_body()).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert r["system_fingerprint"] == "boltstream-v7"
    (span,) = sink.spans
    assert byte_tokenizer().decode(span["llm"]["response_token_ids"], skip_special_tokens=True) == REPLY
    assert span["llm"]["policy_version"] == 7


def test_streamed_tool_calls_arrive_at_the_end() -> None:
    sink = MemorySpanSink()
    with _client(sink) as c, c.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as r:
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in calls] == ["add"] and calls[0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert len(sink.spans) == 1


def test_tool_choice_none_answers_in_text() -> None:
    with _client(MemorySpanSink()) as c:
        r = c.post("/v1/chat/completions", json=_body(tool_choice="none")).json()
    assert r["choices"][0]["message"]["content"] == REPLY and "tool_calls" not in r["choices"][0]["message"]
