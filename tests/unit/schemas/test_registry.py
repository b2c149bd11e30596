"""Schema registry clients. The HTTP client is exercised against a tiny Confluent-style fake served
on loopback by the stdlib (no network, no Docker; the real Redpanda registry is integration-tier)."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from boltstream.schemas import Codec, HttpSchemaRegistry, InMemorySchemaRegistry, SchemaError, SchemaRegistry
from boltstream.schemas.packed import as_lists
from tests.unit.schemas.record_examples import EXAMPLES


class FakeRegistry(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, str, Any, str | None]] = []
        self.ids: dict[str, int] = {}
        self.schemas: dict[int, str] = {}
        self.config: dict[str, str] = {}
        self.reject: dict[str, tuple[int, dict]] = {}  # subject -> (status, body)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeRegistry

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _reply(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(length)) if length else None
        path = urllib.parse.unquote(self.path)
        self.server.requests.append((self.command, path, payload, self.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if self.command == "POST" and parts[0] == "subjects" and parts[-1] == "versions":
            subject = "/".join(parts[1:-1])
            if subject in self.server.reject:
                status, body = self.server.reject[subject]
                return self._reply(status, body)
            assert payload["schemaType"] == "AVRO"
            schema_id = self.server.ids.setdefault(payload["schema"], len(self.server.ids) + 1)
            self.server.schemas[schema_id] = payload["schema"]
            return self._reply(200, {"id": schema_id})
        if self.command == "PUT" and parts[0] == "config":
            self.server.config[parts[1]] = payload["compatibility"]
            return self._reply(200, payload)
        if self.command == "GET" and parts[:2] == ["schemas", "ids"]:
            schema = self.server.schemas.get(int(parts[2]))
            if schema is None:
                return self._reply(404, {"error_code": 40403, "message": "Schema not found"})
            return self._reply(200, {"schema": schema})
        return self._reply(404, {"error_code": 404, "message": "HTTP 404 Not Found"})

    do_GET = do_POST = do_PUT = _handle


@pytest.fixture
def fake() -> Iterator[FakeRegistry]:
    server = FakeRegistry()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_both_registries_implement_the_protocol(fake: FakeRegistry) -> None:
    assert isinstance(InMemorySchemaRegistry(), SchemaRegistry)
    assert isinstance(HttpSchemaRegistry(fake.url), SchemaRegistry)


def test_registers_subject_once_sets_compatibility_and_round_trips(fake: FakeRegistry) -> None:
    codec = Codec(registry=HttpSchemaRegistry(fake.url, timeout=2))
    for _ in range(5):
        data = codec.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    assert data[:5] == b"\x00\x00\x00\x00\x01"
    assert [(m, p) for m, p, _, _ in fake.requests] == [
        ("POST", "/subjects/boltstream.spans-value/versions"),
        ("PUT", "/config/boltstream.spans-value"),
    ]
    assert fake.config == {"boltstream.spans-value": "BACKWARD_TRANSITIVE"}
    assert json.loads(fake.requests[0][2]["schema"])["name"] == "Span"
    assert as_lists(codec.decode(data, topic="boltstream.spans")) == EXAMPLES["Span"]
    assert len(fake.requests) == 2  # its own id is known without a GET

    # Another process (fresh codec) fetches the writer schema by id, once.
    reader = Codec(registry=HttpSchemaRegistry(fake.url))
    for _ in range(3):
        assert as_lists(reader.decode(data, topic="boltstream.spans", expect="Span")) == EXAMPLES["Span"]
    assert [(m, p) for m, p, _, _ in fake.requests[2:]] == [("GET", "/schemas/ids/1")]


def test_unknown_schema_id_from_http_registry(fake: FakeRegistry) -> None:
    codec = Codec(registry=HttpSchemaRegistry(fake.url))
    with pytest.raises(
        SchemaError, match=r"topic 'boltstream.spans': unknown schema id 42 .*40403 Schema not found"
    ):
        codec.decode(b"\x00\x00\x00\x00\x2a\x00", topic="boltstream.spans")


def test_registry_rejection_names_url_and_reason(fake: FakeRegistry) -> None:
    fake.reject["boltstream.spans-value"] = (
        409,
        {"error_code": 409, "message": "Schema being registered is incompatible"},
    )
    codec = Codec(registry=HttpSchemaRegistry(fake.url))
    with pytest.raises(SchemaError) as info:
        codec.encode("Span", EXAMPLES["Span"], topic="boltstream.spans")
    message = str(info.value)
    assert message.startswith("topic 'boltstream.spans': ")
    assert f"{fake.url}/subjects/boltstream.spans-value/versions" in message
    assert "HTTP 409" in message and "incompatible" in message


def test_unreachable_registry_names_url_and_reason() -> None:
    registry = HttpSchemaRegistry("http://127.0.0.1:1/", timeout=1)
    with pytest.raises(SchemaError, match=r"http://127.0.0.1:1/schemas/ids/5 failed: .*refused"):
        registry.get(5)
    with pytest.raises(SchemaError, match="not an http"):
        HttpSchemaRegistry("localhost:8081")


def test_basic_auth_from_url_and_secret_kept_out_of_messages(fake: FakeRegistry) -> None:
    url = fake.url.replace("http://", "http://alice:s3cr%40t@")
    registry = HttpSchemaRegistry(url)
    assert "s3cr" not in repr(registry) and "alice" not in registry.url
    registry.register("x-value", '{"type":"record","name":"X","fields":[]}')
    assert fake.requests[0][3] == "Basic YWxpY2U6czNjckB0"  # base64("alice:s3cr@t")
    with pytest.raises(SchemaError) as info:
        registry.get(99)
    assert "s3cr" not in str(info.value)


def test_in_memory_registry_ids_are_global_and_deterministic() -> None:
    registry = InMemorySchemaRegistry(first_id=10)
    assert registry.register("a-value", "s1") == 10
    assert registry.register("b-value", "s1") == 10
    assert registry.register("a-value", "s2") == 11
    assert registry.get(11) == "s2"
    assert registry.subjects == {"a-value": [10, 11], "b-value": [10]}
    with pytest.raises(SchemaError, match="unknown schema id 12"):
        registry.get(12)


def test_foreign_record_from_registry_is_decoded_but_fails_expect() -> None:
    registry = InMemorySchemaRegistry()
    schema_id = registry.register(
        "other-value", '{"type":"record","name":"Other","namespace":"x","fields":[{"name":"a","type":"int"}]}'
    )
    codec = Codec(registry=registry)
    data = b"\x00" + schema_id.to_bytes(4, "big") + b"\x06"
    assert codec.decode(data, topic="other") == {"a": 3}
    with pytest.raises(SchemaError, match="expected a Span record, got x.Other"):
        codec.decode(data, topic="other", expect="Span")
    bad_id = registry.register("bad-value", "not json")
    with pytest.raises(SchemaError, match=f"topic 'other': schema id {bad_id} is not valid JSON"):
        codec.decode(b"\x00" + bad_id.to_bytes(4, "big") + b"\x06", topic="other")
