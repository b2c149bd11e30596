"""The HTTP API in-process: responses, captured spans, rollout ids, streaming."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.server import rollout_ids_from_path
from boltstream.schemas.records import span_key

ROLLOUT = {"X-Boltstream-Rollout-Id": "r-1", "X-Boltstream-Attempt-Id": "t-1:0", "X-Boltstream-Task-Id": "t-1"}


def _check_span(span: dict[str, Any], tokenizer: Any, text: str) -> None:
    llm = span["llm"]
    assert tokenizer.decode(llm["response_token_ids"], skip_special_tokens=True) == text
    assert len(llm["response_logprobs"]) == len(llm["response_token_ids"]) > 0
    assert all(lp <= 0 for lp in llm["response_logprobs"])
    assert llm["policy_version"] == 0 and llm["model"] == "tiny"


def test_chat_answer_is_captured_with_rollout_ids(client: TestClient, sink: MemorySpanSink, tiny, chat) -> None:
    r = client.post("/v1/chat/completions", json=chat(temperature=0.7, seed=3), headers=ROLLOUT)
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert body["object"] == "chat.completion" and body["system_fingerprint"] == "boltstream-v0"
    assert body["usage"]["completion_tokens"] == 8
    (span,) = sink.spans
    _check_span(span, tiny[1], text)
    assert (span["rollout_id"], span["attempt_id"], span["task_id"]) == ("r-1", "t-1:0", "t-1")
    assert span_key(span) == b"r-1"
    assert span["name"] == "chat tiny" and span["attributes"]["gen_ai.operation.name"] == "chat"
    assert span["attributes"]["gen_ai.usage.input_tokens"] == len(span["llm"]["prompt_token_ids"])
    assert span["llm"]["temperature"] == 0.7 and span["llm"]["seed"] == 3
    assert span["attributes"]["boltstream.logprobs_mode"] == "temperature_scaled"


def test_unassigned_call_is_traced_under_its_trace_id(client: TestClient, sink: MemorySpanSink, chat) -> None:
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert client.post("/v1/chat/completions", json=chat(), headers={"traceparent": parent}).status_code == 200
    (span,) = sink.spans
    assert span["rollout_id"] is None and span["attributes"]["boltstream.assigned"] is False
    assert span["trace_id"] == "ab" * 16 and span["parent_span_id"] == "cd" * 8
    assert span_key(span) == ("ab" * 16).encode()


def test_rollout_ids_from_base_url(client: TestClient, sink: MemorySpanSink, chat) -> None:
    assert client.post("/rollout/r-9/r-9:1/~/v1/chat/completions", json=chat()).status_code == 200
    assert client.post("/rollout/r-8/v1/chat/completions", json=chat()).status_code == 200
    assert client.get("/rollout/r-8/v1/models").status_code == 200
    assert [(s["rollout_id"], s["attempt_id"], s["task_id"]) for s in sink.spans] == [
        ("r-9", "r-9:1", None), ("r-8", None, None)]


def test_rollout_path_parsing() -> None:
    assert rollout_ids_from_path("/rollout/a/b/c/v1/chat/completions")[1] == "/v1/chat/completions"
    ids, rest = rollout_ids_from_path("/rollout/a/v1/completions")
    assert ids == {"boltstream.rollout_id": "a"} and rest == "/v1/completions"
    assert rollout_ids_from_path("/v1/chat/completions") is None


def test_n_choices_seed_and_logprobs(client: TestClient, sink: MemorySpanSink, tiny, chat) -> None:
    body = chat(n=3, temperature=1.0, seed=11, logprobs=True, return_token_ids=True)
    a = client.post("/v1/chat/completions", json=body).json()
    b = client.post("/v1/chat/completions", json=body).json()
    assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]
    assert len({c["message"]["content"] for c in a["choices"]}) > 1
    assert [s["attributes"]["boltstream.choice_index"] for s in sink.spans[:3]] == [0, 1, 2]
    for choice, span in zip(a["choices"], sink.spans[:3], strict=True):
        _check_span(span, tiny[1], choice["message"]["content"])
        assert choice["token_ids"] == span["llm"]["response_token_ids"].tolist()
        # The span holds float32 logprobs (what the Span record carries), the API float64.
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(
            span["llm"]["response_logprobs"].tolist(), rel=1e-6)
    assert a["prompt_token_ids"] == sink.spans[0]["llm"]["prompt_token_ids"].tolist()


def test_stop_string_cuts_text_but_keeps_sampled_tokens(client: TestClient, sink: MemorySpanSink, tiny, chat) -> None:
    first = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12)).json()
    full = first["choices"][0]["message"]["content"]
    stop = full[3:5]
    r = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12, stop=[stop])).json()
    assert r["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    span = sink.spans[-1]
    assert stop in tiny[1].decode(span["llm"]["response_token_ids"], skip_special_tokens=True)
    assert span["attributes"]["boltstream.stop_string"] == stop


def _sse(lines: list[str]) -> list[Any]:
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_streaming_chat_is_captured_whole(client: TestClient, sink: MemorySpanSink, tiny, chat) -> None:
    body = chat(stream=True, n=2, max_tokens=10, seed=1, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body, headers=ROLLOUT) as r:
        assert r.status_code == 200
        events = _sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 20 and events[-2]["choices"] == []
    texts = {0: "", 1: ""}
    finishes = {}
    for e in events[:-2]:
        (c,) = e["choices"]
        texts[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    assert len(sink.spans) == 2
    for k, span in enumerate(sink.spans):
        _check_span(span, tiny[1], texts[k])
        assert span["rollout_id"] == "r-1"


def test_completions_endpoint(client: TestClient, sink: MemorySpanSink, tiny) -> None:
    ids = tiny[1].encode("abc", add_special_tokens=False)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["abc", ids], "max_tokens": 5,
                                             "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert choices[0]["text"] == choices[1]["text"]  # same prompt, greedy
    assert len(choices[0]["logprobs"]["token_logprobs"]) == 5
    assert [s["llm"]["prompt_token_ids"].tolist() for s in sink.spans] == [ids, ids]
    assert sink.spans[0]["name"] == "text_completion tiny"
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 5,
                                                         "temperature": 0, "stream": True}) as s:
        events = _sse(list(s.iter_lines()))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choices[0]["text"]


def test_tools_reach_the_template(client: TestClient, sink: MemorySpanSink, tiny, chat) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = client.post("/v1/chat/completions", json=chat(tools=tools))
    assert r.status_code == 200, r.text
    prompt = tiny[1].decode(sink.spans[-1]["llm"]["prompt_token_ids"])
    assert '"name": "add"' in prompt and "<tools>" in prompt


def test_models_health_metrics(client: TestClient, chat) -> None:
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["policy_version"] == 0
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["policy_version"] == 0
    client.post("/v1/chat/completions", json=chat(temperature=0))  # greedy: 8 tokens, no early stop
    metrics = client.get("/metrics").text
    assert 'boltstream_inference_requests_total{endpoint="chat",status="200"} 1.0' in metrics
    assert 'boltstream_inference_policy_version{model="tiny"} 0.0' in metrics
    assert "boltstream_inference_completion_tokens_total 8.0" in metrics


def test_captured_calls_sample_at_the_rollout_temperature_and_evaluations_at_their_own(
        backend: Any, sink: MemorySpanSink, chat) -> None:
    from boltstream.inference.server import create_app

    app = create_app(backend, sink=sink, served_names=("tiny",), default_max_tokens=12, rollout_temperature=1.0)
    greedy = chat(n=3, temperature=0, logprobs=True)
    with TestClient(app, raise_server_exceptions=False) as client:
        evaluation = client.post("/nocapture/v1/chat/completions", json=greedy).json()
        rollout = client.post("/v1/chat/completions", json=greedy, headers=ROLLOUT).json()
    # not captured: greedy as asked, three times the same answer; captured: sampled at 1.0, and said so
    assert len({c["message"]["content"] for c in evaluation["choices"]}) == 1
    assert len({c["message"]["content"] for c in rollout["choices"]}) > 1
    assert [s["llm"]["temperature"] for s in sink.spans] == [1.0] * 3
    for choice, span in zip(rollout["choices"], sink.spans, strict=True):
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(
            span["llm"]["response_logprobs"].tolist(), rel=1e-6)
