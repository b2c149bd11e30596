"""In-process inference worker on the tiny model: no broker, spans collected in memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.server import create_app
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.weights.models import tiny_model_and_tokenizer

MAX_CONTEXT = 1024


@pytest.fixture(scope="session")
def tiny() -> tuple[Any, Any]:
    """(model, tokenizer) of the seed-0 tiny model, shared read-only by every test."""
    return tiny_model_and_tokenizer(0)


@pytest.fixture
def sink() -> MemorySpanSink:
    return MemorySpanSink()


@pytest.fixture
def backend(tiny: tuple[Any, Any]) -> TransformersBackend:
    model, tokenizer = tiny
    return TransformersBackend(model, tokenizer, model_name="tiny", max_context=MAX_CONTEXT, max_batch_size=8)


@pytest.fixture
def client(backend: TransformersBackend, sink: MemorySpanSink) -> Iterator[TestClient]:
    """A started app (lifespan ran: batching loop up); stopped when the test ends."""
    app = create_app(backend, sink=sink, served_names=("tiny",), default_max_tokens=12)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def chat_body(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


@pytest.fixture
def chat() -> Any:
    return chat_body


@pytest.fixture
def max_context() -> int:
    return MAX_CONTEXT
