"""Fuzz the inference worker's OpenAI HTTP API in-process (the real app, the tiny model): arbitrary
bodies, damaged valid requests, hostile headers and rollout paths get a 2xx or a 4xx with an
OpenAI-style error body, never a 5xx from an unhandled exception, never a hang; a good request is
answered afterwards.

The app runs with a 64-token context so that any ``max_tokens`` a fuzzed body can ask for stays cheap.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.server import create_app
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.weights.models import tiny_model_and_tokenizer
from tests.unit.fuzz.fuzzing import JSON_VALUES, fuzz_settings, mutated

SLOW_S = 60.0  # wall seconds (the app runs in another thread): a hang, not a loaded machine
FAST = 100  # each example is a real request (some generate): fewer than the pure targets
CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
CHAT_TOOLS = {**CHAT, "tools": TOOLS, "messages": [*CHAT["messages"], {
    "role": "assistant", "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"}]}
BODIES = {"/v1/chat/completions": [CHAT, CHAT_TOOLS], "/v1/completions": [COMPLETION]}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "seed", "stop", "stream",
          "stream_options", "temperature", "top_p", "logprobs", "top_logprobs", "tools", "tool_choice",
          "logit_bias", "presence_penalty", "top_k", "return_token_ids", "user"]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    model, tokenizer = tiny_model_and_tokenizer(0)
    backend = TransformersBackend(model, tokenizer, model_name="tiny", max_context=64, max_batch_size=8)
    app = create_app(backend, sink=MemorySpanSink(), served_names=("tiny",), default_max_tokens=4)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
        _still_answers(c)


def _still_answers(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def _check(client: TestClient, method: str, path: str, **kw: Any) -> None:
    t0 = time.perf_counter()
    r = client.request(method, path, **kw)
    took = time.perf_counter() - t0
    assert r.status_code < 500, f"{method} {path} -> {r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text
    assert took < SLOW_S, f"{method} {path} took {took:.1f}s"


def _encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def damaged_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(BODIES)))
    body = json.loads(json.dumps(draw(st.sampled_from(BODIES[path]))))
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS) | st.text(max_size=12))
        if draw(st.booleans()) and field in body and isinstance(body[field], list | dict) and body[field]:
            target = body[field]  # go one level down: a message, a tool, a part
            key = draw(st.sampled_from(range(len(target)) if isinstance(target, list) else sorted(target)))
            if isinstance(target[key], dict) and draw(st.booleans()):
                sub = target[key]
                names = st.sampled_from(sorted(sub)) | st.text(max_size=8) if sub else st.text(max_size=8)
                sub[draw(names)] = draw(JSON_VALUES)
            else:
                target[key] = draw(JSON_VALUES)
        elif draw(st.integers(0, 5)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(JSON_VALUES)
    return path, _encoded(body)


@fuzz_settings(FAST)
@given(damaged_bodies())
def test_damaged_requests(client: TestClient, case: tuple[str, bytes]) -> None:
    path, body = case
    _check(client, "POST", path, content=body, headers={"content-type": "application/json"})


SEEDS = [_encoded(b) for bodies in BODIES.values() for b in bodies]


@fuzz_settings(FAST)
@given(st.sampled_from(sorted(BODIES)), st.binary(max_size=512) | mutated(SEEDS),
       st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
def test_arbitrary_bodies(client: TestClient, path: str, body: bytes, content_type: str) -> None:
    _check(client, "POST", path, content=body, headers={"content-type": content_type})


HEADER_NAMES = ["X-Boltstream-Rollout-Id", "X-Boltstream-Attempt-Id", "X-Boltstream-Task-Id",
                "X-Boltstream-Capture", "traceparent", "baggage", "content-length", "authorization"]
HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80) | st.sampled_from(
    ["00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "off", "-", "~",
     "boltstream.rollout_id=r%ZZ", "boltstream.rollout_id=" + "x" * 5000])
SEGMENT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#"), min_size=1, max_size=24) | st.sampled_from(
    ["-", "~", "%", "%ff", "b64.!!", "b64." + "A" * 10, ".."])


@fuzz_settings(FAST)
@given(st.dictionaries(st.sampled_from(HEADER_NAMES), HEADER_VALUE, max_size=4),
       st.lists(SEGMENT, max_size=3), st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models",
                                                       "/health", "/v1/models/tiny", "/nothing"]))
def test_hostile_headers_and_paths(client: TestClient, headers: dict[str, str], segments: list[str],
                                   route: str) -> None:
    prefix = "/rollout/" + "/".join(segments) if segments else ""
    method = "POST" if route.endswith("completions") else "GET"
    kw: dict[str, Any] = {"json": CHAT if "chat" in route else COMPLETION} if method == "POST" else {}
    headers = {k: v for k, v in headers.items() if k != "content-length"} | (
        {"content-length": headers["content-length"]} if "content-length" in headers and method == "GET" else {})
    _check(client, method, prefix + route, headers=headers, **kw)


# ``timeout`` is a documented wait of up to MAX_HEALTH_WAIT (300 s) for the condition; only values that
# return at once are fuzzed here ("inf" or "1e309" would wait the full 300 s, by design).
_QUERY_VALUE = st.sampled_from(["", "nan", "inf", "-inf", "1e309", "-1", "0", "x", "9" * 30, "2.5"])


@fuzz_settings(FAST)
@given(st.fixed_dictionaries({}, optional={"min_version": _QUERY_VALUE, "min_failures": _QUERY_VALUE,
                                           "timeout": st.sampled_from(["", "nan", "-inf", "-1", "0", "x", "0.01"])}))
def test_health_query(client: TestClient, query: dict[str, str]) -> None:
    _check(client, "GET", "/health", params=query)


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_a_top_p_below_float32_keeps_the_most_likely_token(client: TestClient, top_p: float) -> None:
    """Found by this fuzzer: a top_p that rounds to 0 in float32 dropped every token (500, and every
    other request of the same generation batch failed with it)."""
    r = client.post("/v1/completions", json={**COMPLETION, "top_p": top_p, "logprobs": 0})
    assert r.status_code == 200, r.text
    greedy = client.post("/v1/completions", json={**COMPLETION, "temperature": 0, "logprobs": 0})
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_a_temperature_below_float32_is_greedy(client: TestClient, temperature: float) -> None:
    """Found by this fuzzer: logits / 5e-324 overflowed in float32 (500, failing the whole batch)."""
    r = client.post("/v1/completions", json={**COMPLETION, "temperature": temperature, "logprobs": 0})
    assert r.status_code == 200, r.text
    greedy = client.post("/v1/completions", json={**COMPLETION, "temperature": 0, "logprobs": 0})
    assert r.json()["choices"][0] == greedy.json()["choices"][0]
