"""Completion ids that name their rollout, and ``POST /v1/feedback``, in-process (spans kept in memory)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient

from boltstream.inference.capture import MemorySpanSink
from boltstream.producers.feedback import decode_completion_id, feedback_span_id
from boltstream.schemas import records
from boltstream.schemas.records import span_key
from boltstream.streams.spans import reward_of

ROLLOUT = {"X-Boltstream-Rollout-Id": "r-1", "X-Boltstream-Attempt-Id": "t-1:0", "X-Boltstream-Task-Id": "t-1"}


def test_completion_id_names_the_span_key_and_the_llm_span(client: TestClient, sink: MemorySpanSink, chat) -> None:
    body = client.post("/v1/chat/completions", json=chat(n=2), headers=ROLLOUT).json()
    first, second = sink.spans
    assert decode_completion_id(body["id"]) == (span_key(first).decode(), first["span_id"])
    assert first["attributes"]["gen_ai.response.id"] == second["attributes"]["gen_ai.response.id"] == body["id"]
    # a call with no rollout: its trace id is the key
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                       headers={"traceparent": parent}).json()
    assert body["id"].startswith("cmpl-bs1.")
    assert decode_completion_id(body["id"]) == ("ab" * 16, sink.spans[-1]["span_id"])


def test_streamed_completion_id_names_the_rollout(client: TestClient, sink: MemorySpanSink, chat) -> None:
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=ROLLOUT) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    (span,) = sink.spans
    assert {c["id"] for c in chunks} == {span["attributes"]["gen_ai.response.id"]}
    assert decode_completion_id(chunks[0]["id"]) == ("r-1", span["span_id"])


def test_feedback_by_completion_id_is_written_once_acked(client: TestClient, sink: MemorySpanSink, chat) -> None:
    cid = client.post("/v1/chat/completions", json=chat(), headers=ROLLOUT).json()["id"]
    r = client.post("/v1/feedback", json={"completion_id": cid, "reward": 1, "idempotency_key": "click-7"})
    assert r.status_code == 202, r.text
    llm, reward = sink.spans
    assert r.json() == {"object": "feedback", "status": "accepted", "rollout_key": "r-1",
                        "span_id": feedback_span_id("click-7"), "name": "reward", "reward": 1.0}
    assert span_key(reward) == b"r-1" and reward["parent_span_id"] == llm["span_id"]
    assert reward["attributes"][records.FEEDBACK] is True
    info = reward_of(reward)
    assert info is not None and info.final and info.primary and info.value == 1.0
    assert b'boltstream_inference_feedback_total{status="202"} 1.0' in client.get("/metrics").content


def _error(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_bad_feedback_is_a_400_naming_the_field(client: TestClient, sink: MemorySpanSink) -> None:
    for raw, param in [
        ('{"rollout_id": "r-1", "reward": NaN}', "reward"),
        ('{"rollout_id": "r-1", "reward": Infinity}', "reward"),
        ('{"rollout_id": "r-1", "reward": "1"}', "reward"),
        ('{"rollout_id": "r-1"}', "reward"),
        ('{"reward": 1}', "target"),
        ('{"completion_id": "chatcmpl-0123456789", "reward": 1}', "completion_id"),
    ]:
        err = _error(client.post("/v1/feedback", content=raw, headers={"content-type": "application/json"}))
        assert err["param"] == param and err["code"] == "invalid_value", err
    assert "finite" in _error(client.post("/v1/feedback", content='{"rollout_id": "r", "reward": NaN}'))["message"]
    assert _error(client.post("/v1/feedback", content="[1]"))["code"] == "invalid_json"
    assert sink.spans == []  # nothing written for a refused feedback
