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
take the worker down. A request's ``model`` may be any name: one the worker does not serve is
an alias of its policy unless ``strict_model_names`` (``serve --strict-model-names``).
:func:`create_app` wires the routes, one function per concern: completions, feedback,
models, health and metrics.
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
    strict_model_names: bool = False,
    rollout_temperature: float | None = None,
) -> FastAPI:
    """The worker app; starting it (lifespan) starts the backend, the span sink and the checkpoint follower.

    With ``api_key``, ``/v1/...`` requests without that bearer token get 401 (:mod:`.auth`).
    ``adapters``: the named LoRA adapters ``backend`` serves; each is also a model name clients may send.
    ``strict_model_names``: a request whose ``model`` is none of these names gets 404 ``model_not_found``;
    by default any other name is served as an alias of the policy (docs/inference.md, Model names).
    ``rollout_temperature``: captured calls sample at it whatever they ask (:meth:`CompletionService.explore`).
    """
    metrics = metrics or Metrics(served_names[0])
    status = status or ReloadStatus()
    served_names = tuple(dict.fromkeys((*served_names, *(a.name for a in adapters))))
    service = CompletionService(backend, sink, metrics, served_names=served_names,
                                default_max_tokens=default_max_tokens, adapters=adapters,
                                strict_model_names=strict_model_names, rollout_temperature=rollout_temperature)
    app = FastAPI(title="boltstream inference worker", docs_url=None, redoc_url=None,
                  lifespan=_lifespan(backend, sink, metrics, adapters, follower))
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # inner: sees the path without /rollout/...
    app.add_middleware(RolloutPathMiddleware)
    app.state.service = service
    app.state.metrics = metrics
    app.state.reload_status = status
    _add_error_handlers(app)
    _add_completion_routes(app, service, metrics)
    _add_feedback_route(app, sink, metrics)
    _add_model_routes(app, backend, served_names, adapters, strict_model_names)
    _add_health_routes(app, backend, served_names[0], adapters, follower, status, metrics)
    return app


def _lifespan(backend: Backend, sink: SpanSink, metrics: Metrics, adapters: tuple[AdapterSpec, ...],
              follower: CheckpointFollower | None) -> Any:
    """Start the backend, then the sink, then the follower; stop them in reverse, whatever failed."""

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

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body: no request gets a bare 500 page or takes the worker down."""

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


def _add_completion_routes(app: FastAPI, service: CompletionService, metrics: Metrics) -> None:
    """``POST /v1/chat/completions`` and ``/v1/completions``: parse, route to an adapter, generate."""

    async def answer(request: Request, kind: str) -> Response:
        body = parse_json(await request.body())
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            req = service.parse_chat(body) if kind == "chat" else service.parse_completion(body)
            service.route(req, request.headers)
        except ApiError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        ctx = CallContext.from_request(request.headers, getattr(request.state, "rollout_ids", None),
                                       getattr(request.state, "capture", True))
        service.explore(req, ctx)
        if req.stream:
            return StreamingResponse(service.stream(req, ctx), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await service.complete(req, ctx))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, "completion")


def _add_feedback_route(app: FastAPI, sink: SpanSink, metrics: Metrics) -> None:
    """``POST /v1/feedback``: 202 once the broker acknowledged the reward span."""

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


def _add_model_routes(app: FastAPI, backend: Backend, served_names: tuple[str, ...],
                      adapters: tuple[AdapterSpec, ...], strict_model_names: bool) -> None:
    """``GET /v1/models`` (the served names) and ``/v1/models/{name}`` (any name unless strict: an alias)."""
    adapter_names = {a.name for a in adapters}
    created = int(time.time())

    def card(name: str) -> dict[str, Any]:
        out = {"id": name, "object": "model", "created": created, "owned_by": "boltstream",
               "root": served_names[0], "max_model_len": backend.max_context,
               "policy_version": backend.version_of(name if name in adapter_names else None)}
        if name in adapter_names:
            out["adapter"] = name
        return out

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(n) for n in served_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        if strict_model_names and name not in served_names:
            raise ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return card(name)


def _add_health_routes(app: FastAPI, backend: Backend, model_name: str, adapters: tuple[AdapterSpec, ...],
                       follower: CheckpointFollower | None, status: ReloadStatus, metrics: Metrics) -> None:
    """``GET /health`` (versions, reload state; ``?min_version=&timeout=`` waits) and ``GET /metrics``."""
    adapter_names = {a.name for a in adapters}

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
            "model": model_name,
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
