"""Bad input gets OpenAI-style 4xx errors and the worker keeps serving."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.server import create_app
from boltstream.inference.transformers_backend import TransformersBackend


def _error(r: Any, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


BAD_PARAMS = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"seed": "x"}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize(("override", "param"), BAD_PARAMS, ids=[p for _, p in BAD_PARAMS])
def test_invalid_parameters_are_400(client: TestClient, chat, override: dict[str, Any], param: str) -> None:
    _error(client.post("/v1/chat/completions", json=chat(**override)), 400, param=param)


def test_malformed_json_and_wrong_shapes(client: TestClient, chat) -> None:
    headers = {"content-type": "application/json"}
    _error(client.post("/v1/chat/completions", content=b"{not json", headers=headers), 400, "invalid_json")
    _error(client.post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400, "invalid_json")
    _error(client.post("/v1/chat/completions", content=b"\xff\xfe", headers=headers), 400, "invalid_json")
    _error(client.post("/v1/completions", json={"model": "tiny", "prompt": 5}), 400, param="prompt")
    _error(client.post("/v1/completions", json={"model": "tiny", "prompt": [10**6]}), 400, param="prompt")
    _error(client.post("/v1/completions", json={"model": "tiny"}), 400, param="prompt")
    _error(client.get("/health", params={"min_version": "abc", "timeout": 1}), 400)


def test_unknown_model_and_route(client: TestClient, chat) -> None:
    body = chat()
    del body["model"]
    _error(client.post("/v1/chat/completions", json=body), 400, "missing_required_parameter", "model")
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/chat/completions"), 405)


def test_strict_model_names_refuse_a_name_not_served(backend: TransformersBackend, sink: MemorySpanSink,
                                                      chat) -> None:
    app = create_app(backend, sink=sink, served_names=("tiny",), default_max_tokens=12, strict_model_names=True)
    with TestClient(app, raise_server_exceptions=False) as strict:
        body = chat()
        body["model"] = "gpt-17"
        err = _error(strict.post("/v1/chat/completions", json=body), 404, "model_not_found", "model")
        assert "serves tiny" in err["message"]
        _error(strict.get("/v1/models/gpt-17"), 404, "model_not_found")
        assert strict.post("/v1/chat/completions", json=chat()).status_code == 200
    assert len(sink.spans) == 1


def test_any_model_name_is_served_as_an_alias_logged_once(client: TestClient, sink: MemorySpanSink, chat,
                                                         caplog) -> None:
    body = chat()
    body["model"] = "gpt-4o-mini"
    with caplog.at_level("INFO", logger="boltstream.inference.service"):
        for _ in range(2):
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "gpt-4o-mini"
    said = [r.message for r in caplog.records if "alias" in r.message]
    assert said == ["serving model name 'gpt-4o-mini' as an alias of tiny (serve --strict-model-names refuses "
                    "names it does not serve)"]
    assert [s["attributes"]["gen_ai.request.model"] for s in sink.spans] == ["gpt-4o-mini"] * 2
    card = client.get("/v1/models/gpt-4o-mini").json()
    assert (card["id"], card["root"]) == ("gpt-4o-mini", "tiny")
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]


def test_context_too_long(client: TestClient, chat, max_context: int) -> None:
    _error(client.post("/v1/chat/completions", json=chat("x" * max_context)), 400, "context_length_exceeded")
    near = chat("x" * (max_context - 100), max_tokens=200)
    _error(client.post("/v1/chat/completions", json=near), 400, "context_length_exceeded", "max_tokens")
    _error(client.post("/v1/completions", json={"model": "tiny", "prompt": "y" * (max_context + 5)}), 400,
           "context_length_exceeded", "prompt")


def test_server_keeps_serving_after_errors(client: TestClient, chat) -> None:
    for override, _ in BAD_PARAMS:
        client.post("/v1/chat/completions", json=chat(**override))
    client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    metrics = client.get("/metrics").text
    assert 'boltstream_inference_requests_total{endpoint="chat",status="400"}' in metrics


def test_openai_client_raises_typed_errors(client: TestClient, chat) -> None:
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:  # a worker without adapters asked for one
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    extra_headers={"X-Boltstream-Adapter": "writer"})
    assert missing.value.code == "adapter_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=9)
    assert info.value.code == "invalid_value" and info.value.param == "temperature"


class _FailingSink(MemorySpanSink):
    async def send(self, spans: list[dict[str, Any]]) -> None:
        raise ConnectionError("broker unreachable")


def test_capture_failure_refuses_the_answer(backend: TransformersBackend, chat) -> None:
    app = create_app(backend, sink=_FailingSink(), served_names=("tiny",))
    with TestClient(app) as c:
        _error(c.post("/v1/chat/completions", json=chat()), 503, "capture_failed")
        with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert "capture_failed" in lines[-1] and "[DONE]" not in lines[-1]
        assert c.get("/health").status_code == 200
