"""The HTTP side of several adapters: routing a request, the span's adapter and version, /health, errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from boltstream.inference.adapters import parse_adapters
from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.server import create_app
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.weights.models import tiny_model_and_tokenizer
from tests.unit.inference.test_inference_backend import _adapter

ADAPTERS = parse_adapters(["writer", "checker=sql-checker"], ["checker=^sql_check"])


@pytest.fixture
def served(sink: MemorySpanSink, tmp_path: Path) -> Iterator[tuple[TestClient, Any]]:
    model, tok = tiny_model_and_tokenizer(0)  # its own: loading an adapter injects modules into the model
    backend = TransformersBackend(model, tok, model_name="tiny", max_context=1024,
                                  adapters=tuple(a.name for a in ADAPTERS))
    app = create_app(backend, sink=sink, served_names=("tiny",), adapters=ADAPTERS)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.portal.call(backend.load_weights, _adapter(0, 2, tmp_path / "c"), "lora", 4, "checker")
        yield c, backend


def _ask(c: TestClient, model: str = "tiny", headers: dict[str, str] | None = None) -> Any:
    return c.post("/v1/completions", headers=headers or {},
                  json={"model": model, "prompt": "SELECT", "max_tokens": 6, "temperature": 0})


def test_requests_are_routed_and_spans_carry_adapter_and_version(served: Any, sink: MemorySpanSink) -> None:
    c, _ = served
    asks = [("tiny", {}, "writer", 0),  # default adapter
            ("checker", {}, "checker", 4),  # model field
            ("tiny", {"X-Boltstream-Adapter": "checker"}, "checker", 4),  # header
            ("checker", {"X-Boltstream-Adapter": "writer"}, "writer", 0),  # header beats model
            ("tiny", {"baggage": "boltstream.agent_name=sql_checker"}, "checker", 4)]  # agent rule
    texts = {}
    for model, headers, adapter, version in asks:
        r = _ask(c, model, headers)
        assert r.status_code == 200, r.text
        assert r.json()["system_fingerprint"] == f"boltstream-v{version}"
        texts.setdefault(adapter, set()).add(r.json()["choices"][0]["text"])
    assert [(s["attributes"]["boltstream.adapter"], s["attributes"]["boltstream.policy_version"],
             s["llm"]["policy_version"]) for s in sink.spans] == [(a, v, v) for _, _, a, v in asks]
    assert len(texts["writer"]) == len(texts["checker"]) == 1 and texts["writer"] != texts["checker"]


def test_streaming_answers_from_the_chosen_adapter(served: Any, sink: MemorySpanSink) -> None:
    c, _ = served
    with c.stream("POST", "/v1/completions", json={"model": "checker", "prompt": "SELECT", "max_tokens": 4,
                                                   "temperature": 0, "stream": True}) as r:
        body = "".join(r.iter_text())
    assert r.status_code == 200 and "boltstream-v4" in body and body.rstrip().endswith("[DONE]")
    assert sink.spans[-1]["attributes"]["boltstream.adapter"] == "checker"


def test_unknown_adapter_is_a_404_naming_the_served_ones(served: Any, sink: MemorySpanSink) -> None:
    c, _ = served
    r = _ask(c, headers={"X-Boltstream-Adapter": "planner"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "adapter_not_found" and err["param"] == "X-Boltstream-Adapter"
    assert "'planner'" in err["message"] and "writer, checker" in err["message"]
    assert _ask(c, model="planner").status_code == 200, "an unknown model name is an alias, not an adapter"
    assert sink.spans[-1]["attributes"]["boltstream.adapter"] == "writer"
    sink.spans.clear()
    assert c.get("/health", params={"adapter": "planner"}).json()["error"]["code"] == "adapter_not_found"
    assert sink.spans == []


def test_health_and_models_report_every_adapters_version(served: Any) -> None:
    c, _ = served
    health = c.get("/health", params={"adapter": "checker", "min_version": 4, "timeout": 5}).json()
    assert health["condition_met"] and health["policy_version"] == 0  # the default adapter's
    assert {n: (a["policy_version"], a["checkpoint_model"]) for n, a in health["adapters"].items()} == {
        "writer": (0, "writer"), "checker": (4, "sql-checker")}
    assert not c.get("/health", params={"adapter": "writer", "min_version": 1}).json()["condition_met"]
    cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert (cards["checker"]["policy_version"], cards["checker"]["adapter"]) == (4, "checker")
    assert cards["tiny"]["policy_version"] == 0 and "adapter" not in cards["tiny"]


def test_an_alias_is_routed_by_header_and_baggage(served: Any, sink: MemorySpanSink) -> None:
    c, _ = served
    for headers, adapter in (({"X-Boltstream-Adapter": "checker"}, "checker"),
                             ({"baggage": "boltstream.agent_name=sql_checker"}, "checker"), ({}, "writer")):
        r = _ask(c, "gpt-4o-mini", headers)
        assert r.status_code == 200, r.text
        assert sink.spans[-1]["attributes"]["boltstream.adapter"] == adapter, headers


def test_a_worker_without_adapters_refuses_the_header(client: TestClient, chat: Any) -> None:
    r = client.post("/v1/chat/completions", json=chat(), headers={"X-Boltstream-Adapter": "writer"})
    assert r.status_code == 404 and "serves no named adapters" in r.json()["error"]["message"]
