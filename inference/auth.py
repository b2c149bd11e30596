"""API-key check of the inference worker: OpenAI clients send ``Authorization: Bearer <key>``.

Only the OpenAI API (``/v1/...``) is guarded: ``/health`` and ``/metrics`` stay open because load
balancers, compose healthchecks and Prometheus probe them without credentials, and they reveal
nothing a request could not. A refused request gets the body OpenAI itself sends for a bad key, so
clients raise their usual ``AuthenticationError``. The key never appears in a response or a log line.
"""

from __future__ import annotations

import hmac
import json
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from boltstream.inference.protocol import error_body

log = logging.getLogger(__name__)

GUARDED_PREFIX = "/v1/"


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer`` header (OpenAI SDKs) or an ``api-key`` header (Azure style)."""
    for name, value in headers:
        key = name.lower()
        if key == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif key == b"api-key" and value:
            return value.decode("latin-1").strip()
    return None


class ApiKeyMiddleware:
    """Refuses ``/v1/...`` requests whose bearer token is not the key (401, OpenAI-style body).

    Sits inside the rollout-path middleware, so ``/rollout/<ids>/v1/...`` is guarded as ``/v1/...``.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._key = api_key.encode()

    def _allowed(self, scope: Scope) -> bool:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            return True
        token = bearer_token(scope.get("headers") or [])
        return token is not None and hmac.compare_digest(token.encode(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._allowed(scope):
            await self.app(scope, receive, send)
            return
        log.info("refused %s %s: missing or wrong API key", scope.get("method"), scope["path"])
        body = json.dumps(error_body(
            "Incorrect API key provided. Send it as 'Authorization: Bearer <key>' (the worker's "
            "BOLTSTREAM_SERVE_API_KEY).", "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
