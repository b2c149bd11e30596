"""Schema registry clients: the Confluent REST API over urllib, and an in-memory stand-in.

stdlib only (no requests/httpx) because the agent-side install carries this module into every
agent process that exports spans, and that install must stay light.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Protocol, runtime_checkable

from .errors import SchemaError

logger = logging.getLogger(__name__)

COMPATIBILITY = "BACKWARD_TRANSITIVE"
"""Every new version must read data written by ALL older versions: the `spans` topic is replayable
from the beginning, so a consumer can meet the oldest writer schema at any time."""

_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


@runtime_checkable
class SchemaRegistry(Protocol):
    """The two calls the codec needs from a registry."""

    def register(self, subject: str, schema_json: str) -> int:
        """Register (or find) ``schema_json`` under ``subject``; return its global schema id."""
        ...

    def get(self, schema_id: int) -> str:
        """The schema JSON registered under ``schema_id``; ``SchemaError`` if there is none."""
        ...


class InMemorySchemaRegistry:
    """A registry in a dict: offline runs, tests and golden fixtures (ids are deterministic).

    Mirrors the Confluent behaviour the codec relies on: one global id per distinct schema text,
    the same id when the same schema is registered under another subject, subjects keep versions.
    """

    def __init__(self, first_id: int = 1) -> None:
        self._next_id = first_id
        self._ids: dict[str, int] = {}
        self._schemas: dict[int, str] = {}
        self.subjects: dict[str, list[int]] = {}
        self.compatibility: dict[str, str] = {}
        self._lock = threading.Lock()

    def register(self, subject: str, schema_json: str) -> int:
        """Register ``schema_json`` under ``subject`` and return its id (idempotent)."""
        with self._lock:
            schema_id = self._ids.get(schema_json)
            if schema_id is None:
                schema_id = self._next_id
                self._next_id += 1
                self._ids[schema_json] = schema_id
                self._schemas[schema_id] = schema_json
            versions = self.subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            self.compatibility.setdefault(subject, COMPATIBILITY)
            return schema_id

    def get(self, schema_id: int) -> str:
        """The schema JSON for ``schema_id``; ``SchemaError`` for an id never registered here."""
        try:
            return self._schemas[schema_id]
        except KeyError:
            raise SchemaError(f"unknown schema id {schema_id} (in-memory schema registry)") from None


class HttpSchemaRegistry:
    """Confluent-compatible schema registry REST client (Redpanda's built-in one, Confluent, Apicurio's
    ccompat API). Credentials may be given in the URL (``http://user:secret@host:8081``); they are sent
    as HTTP basic auth and never appear in error messages.

    Both directions are cached: a subject is registered (and its compatibility set) once per process,
    and an id is fetched once, so the steady state makes no HTTP calls at all.
    """

    def __init__(self, url: str, timeout: float = 5.0, *, compatibility: str | None = COMPATIBILITY) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SchemaError(f"schema registry URL {url!r} is not an http(s) URL")
        self._auth: str | None = None
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        if parts.username is not None:
            userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self._auth = "Basic " + base64.b64encode(userinfo.encode()).decode("ascii")
        self.url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.timeout = timeout
        self.compatibility = compatibility
        self._ids: dict[tuple[str, str], int] = {}
        self._schemas: dict[int, str] = {}
        self._configured: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HttpSchemaRegistry({self.url!r})"

    def register(self, subject: str, schema_json: str) -> int:
        """POST the schema to ``/subjects/<subject>/versions`` (once), then set the subject's
        compatibility; the registry answers with the existing id when the schema is already there."""
        key = (subject, schema_json)
        schema_id = self._ids.get(key)
        if schema_id is not None:
            return schema_id
        with self._lock:  # one registration per subject even when several threads start encoding at once
            schema_id = self._ids.get(key)
            if schema_id is not None:
                return schema_id
            quoted = urllib.parse.quote(subject, safe="")
            body = self._request(
                "POST", f"/subjects/{quoted}/versions", {"schema": schema_json, "schemaType": "AVRO"}
            )
            schema_id = _int_field(body, "id", f"{self.url}/subjects/{quoted}/versions")
            if self.compatibility and subject not in self._configured:
                # After the first registration: some registries reject config for unknown subjects.
                self._request("PUT", f"/config/{quoted}", {"compatibility": self.compatibility})
                self._configured.add(subject)
            self._ids[key] = schema_id
            self._schemas.setdefault(schema_id, schema_json)
            logger.info("schema registry %s: subject %s -> schema id %d", self.url, subject, schema_id)
            return schema_id

    def get(self, schema_id: int) -> str:
        """GET ``/schemas/ids/<id>`` (once per id)."""
        schema = self._schemas.get(schema_id)
        if schema is not None:
            return schema
        try:
            body = self._request("GET", f"/schemas/ids/{int(schema_id)}")
        except _NotFound as exc:
            raise SchemaError(f"unknown schema id {schema_id} ({exc.reason})") from None
        schema = body.get("schema") if isinstance(body, dict) else None
        if not isinstance(schema, str):
            raise SchemaError(f"schema registry {self.url}/schemas/ids/{schema_id}: response has no 'schema'")
        schema_type = body.get("schemaType", "AVRO")
        if schema_type != "AVRO":
            raise SchemaError(f"schema id {schema_id} is a {schema_type} schema, not Avro")
        self._schemas[schema_id] = schema
        return schema

    def _request(self, method: str, path: str, payload: Any = None) -> Any:
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", _CONTENT_TYPE)
        if data is not None:
            request.add_header("Content-Type", _CONTENT_TYPE)
        if self._auth:
            request.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            reason = f"schema registry {method} {url}: HTTP {exc.code} {_error_message(exc)}"
            if exc.code == 404:
                raise _NotFound(reason) from None
            raise SchemaError(reason) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, DNS, timeout, bad URL
            why = getattr(exc, "reason", None) or exc
            raise SchemaError(f"schema registry {method} {url} failed: {why}") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise SchemaError(
                f"schema registry {method} {url}: response is not JSON: {raw[:200]!r}"
            ) from None


class _NotFound(SchemaError):
    """HTTP 404 from the registry; ``get`` turns it into 'unknown schema id'."""


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The registry's JSON error message (``{"error_code": 40401, "message": ...}``) or the HTTP reason."""
    try:
        body = json.loads(exc.read() or b"{}")
        if isinstance(body, dict) and body.get("message"):
            return f"{body.get('error_code', '')} {body['message']}".strip()
    except (ValueError, OSError):
        pass
    return str(exc.reason)


def _int_field(body: Any, name: str, where: str) -> int:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, int) or isinstance(value, bool):
        raise SchemaError(f"schema registry {where}: response has no integer {name!r}: {body!r}"[:300])
    return value
