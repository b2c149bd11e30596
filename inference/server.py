"""The OpenAI-compatible HTTP app of an inference worker (FastAPI; run by uvicorn in ``boltstream serve``).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /v1/feedback`` (a reward for a rollout that already ran, by completion id or rollout /
session / trace id; 202 once the broker acknowledged its reward span: producers/feedback.py),
``GET /health`` (loaded policy version, every adapter's, reload state; ``?min_version=N&timeout=S``
waits for a version, of ``&adapter=NAME`` when given, so tests and benchmarks need no polling loops),
``GET /metrics`` (Prometheus). Every route also answers under
``/rollout/<rollout_id>[/<attempt_id>/<task_id>]/...`` for agents that can only
set a base URL; the ids are taken from the path.

Every error is an OpenAI-style body with a 4xx/5xx status; no request can
take the worker down.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from boltstream.inference.adapters import AdapterSpec
from boltstream.inference.auth import ApiKeyMiddleware
from boltstream.inference.backend import Backend
from boltstream.inference.capture import CallContext, SpanSink
from boltstream.inference.metrics import Metrics
from boltstream.inference.protocol import ApiError, error_body, parse_json
from boltstream.inference.reload import CheckpointFollower, ReloadStatus
from boltstream.inference.service import CompletionService
from boltstream.producers.feedback import FeedbackError, feedback_span, parse_feedback
from boltstream.producers.headers import NO_CAPTURE_SEGMENT, decode_segment, parse_rollout_path
from boltstream.schemas.records import ROLLOUT_ID

log = logging.getLogger(__name__)

_SHORT_ROLLOUT = re.compile(r"^(?P<prefix>.*?)/rollout/(?P<r>[^/]+)(?P<rest>/v1(?:/.*)?)$")
MAX_HEALTH_WAIT = 300.0


def rollout_ids_from_path(path: str) -> tuple[dict[str, str], str] | None:
    """(ids, path without the rollout segment) for ``/rollout/<r>/<a>/<t>/v1/...`` or ``/rollout/<r>/v1/...``."""
    parsed = parse_rollout_path(path)
    if parsed is not None and (parsed[1].endswith("/v1") or "/v1/" in parsed[1]):
        return parsed
    m = _SHORT_ROLLOUT.match(path)
    if m is None:
        return None
    try:
        rollout = decode_segment(m.group("r"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not rollout:
        return None
    return {ROLLOUT_ID: rollout}, m.group("prefix") + m.group("rest")


class RolloutPathMiddleware:
    """Strips ``/rollout/...`` ids (or a ``/nocapture`` prefix) from the path before routing and keeps
    them in the request state."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(f"/{NO_CAPTURE_SEGMENT}/"):
            rest = scope["path"][len(NO_CAPTURE_SEGMENT) + 1:]
            scope = dict(scope, path=rest, raw_path=rest.encode())
            scope.setdefault("state", {})["capture"] = False
        elif scope["type"] == "http" and "/rollout/" in scope["path"]:
            parsed = rollout_ids_from_path(scope["path"])
            if parsed is not None:
                ids, rest = parsed
                scope = dict(scope, path=rest, raw_path=rest.encode())
                scope.setdefault("state", {})["rollout_ids"] = ids
        await self.app(scope, receive, send)


def create_app(
    backend: Backend,
    *,
    sink: SpanSink,
    served_names: tuple[str, ...],
    follower: CheckpointFollower | None = None,
    status: ReloadStatus | None = None,
    metrics: Metrics | None = None,
    default_max_tokens: int = 256,
    api_key: str | None = None,
    adapters: tuple[AdapterSpec, ...] = (),
) -> FastAPI:
    """The worker app; starting it (lifespan) starts the backend, the span sink and the checkpoint follower.

    With ``api_key``, ``/v1/...`` requests without that bearer token get 401 (:mod:`.auth`).
    ``adapters``: the named LoRA adapters ``backend`` serves; each is also a model name clients may send.
    """
    metrics = metrics or Metrics(served_names[0])
    status = status or ReloadStatus()
    served_names = tuple(dict.fromkeys((*served_names, *(a.name for a in adapters))))
    service = CompletionService(backend, sink, metrics, served_names=served_names,
                                default_max_tokens=default_max_tokens, adapters=adapters)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            await sink.start()
            try:
                metrics.set_version(backend.policy_version)
                for a in adapters:
                    metrics.set_version(backend.version_of(a.name), a.name)
                if follower is not None:
                    await follower.start()
                try:
                    yield
                finally:
                    if follower is not None:
                        await follower.stop()
            finally:
                await sink.stop()
        finally:
            await backend.stop()

    app = FastAPI(title="boltstream inference worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # inner: sees the path without /rollout/...
    app.add_middleware(RolloutPathMiddleware)
    app.state.service = service
    app.state.metrics = metrics
    app.state.reload_status = status

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, "invalid_request_error", None, str(exc.status_code)),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"invalid request: {first.get('msg', exc)}", "invalid_request_error",
                                       param, "invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {exc}", "server_error", None, "internal_error"),
                            status_code=500)

    def _context(request: Request) -> CallContext:
        return CallContext.from_request(request.headers, getattr(request.state, "rollout_ids", None),
                                        getattr(request.state, "capture", True))

    async def _answer(request: Request, kind: str) -> Response:
        body = parse_json(await request.body())
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            req = service.parse_chat(body) if kind == "chat" else service.parse_completion(body)
            service.route(req, request.headers)
        except ApiError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        ctx = _context(request)
        if req.stream:
            return StreamingResponse(service.stream(req, ctx), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await service.complete(req, ctx))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(request, "completion")

    @app.post("/v1/feedback", status_code=202)
    async def feedback(request: Request) -> dict[str, Any]:
        try:
            fb = parse_feedback(parse_json(await request.body()))
        except FeedbackError as exc:
            metrics.feedback.labels("400").inc()
            raise ApiError(400, str(exc), param=exc.field, code="invalid_value") from None
        try:
            await sink.send([feedback_span(fb)])
        except Exception as exc:
            metrics.feedback.labels("503").inc()
            log.error("feedback %s for rollout %s not written: %s", fb.target, fb.key, exc)
            raise ApiError(503, f"the feedback could not be written to the log ({exc}); retry it (the same "
                                "feedback twice counts once)", type="server_error", code="capture_failed") from exc
        metrics.feedback.labels("202").inc()
        return {"object": "feedback", "status": "accepted", "rollout_key": fb.key, "span_id": fb.span_id,
                "name": fb.name, "reward": fb.value}

    adapter_names = {a.name for a in adapters}

    def _model_card(name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": created, "owned_by": "boltstream",
                "root": served_names[0], "max_model_len": backend.max_context,
                "policy_version": backend.version_of(name if name in adapter_names else None)}
        if name in adapter_names:
            card["adapter"] = name
        return card

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(n) for n in served_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        if name not in served_names:
            raise ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return _model_card(name)

    @app.get("/health")
    async def health(min_version: int | None = None, min_failures: int | None = None,
                     timeout: float = 0.0, adapter: str | None = None) -> dict[str, Any]:
        if adapter is not None and adapter not in adapter_names:
            raise ApiError(404, f"adapter {adapter!r} is not served by this worker (it serves "
                                f"{', '.join(sorted(adapter_names)) or 'no named adapters'})", param="adapter",
                           code="adapter_not_found")

        def ready() -> bool:
            return (min_version is None or backend.version_of(adapter) >= min_version) and (
                min_failures is None or status.failures >= min_failures)

        if timeout > 0 and not math.isnan(timeout):
            await status.wait_until(ready, min(timeout, MAX_HEALTH_WAIT))
        return {
            "status": "ok",
            "model": served_names[0],
            "policy_version": backend.policy_version,
            "condition_met": ready(),
            "reloads": status.reloads,
            "reload_failures": status.failures,
            "last_reload_error": status.last_error,
            "last_reload_seconds": status.last_reload_seconds,
            "last_fetch_seconds": status.last_fetch_seconds,
            "following_checkpoints": follower is not None,
            "caught_up": status.caught_up,
            "adapters": {a.name: {"policy_version": backend.version_of(a.name),
                                  "checkpoint_model": a.checkpoint_model,
                                  **status.by_adapter.get(a.name, {"reloads": 0, "reload_failures": 0,
                                                                   "last_reload_error": None})}
                         for a in adapters},
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
