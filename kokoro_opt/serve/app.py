"""The OpenAI-compatible HTTP server: FastAPI routes over one `Engine`.

`Service` holds what the routes share (engine, limits, queue slots, the drain on shutdown); the probes
(/health, /ready, /metrics) and the OpenAI routes (/v1/...) are two routers over it; a speech request is
a `SpeechHandler` (speech.py); the OpenAPI document says all of it (openapi.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kokoro_opt.runtime.availability import runtime_problem
from kokoro_opt.select import Selection
from kokoro_opt.serve import openapi
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.connections import CloseUnread, LoopbackHost
from kokoro_opt.serve.engine import Engine
from kokoro_opt.serve.metrics import Metrics
from kokoro_opt.serve.openai_compat import ApiError, validation_message, voice_entries
from kokoro_opt.serve.service import RETRY_SECONDS, Service, keys_match
from kokoro_opt.serve.speech import SpeechHandler
from kokoro_opt.voices import OPENAI_VOICES

log = logging.getLogger("kokoro_opt.serve")
_BEARER = HTTPBearer(auto_error=False, description="the server's --api-key")
_HEAD_TOO = ("/health", "/ready")  # GET routes that answer HEAD too (a route of their own, out of the document)
BearerKey = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]


class _KeyCheck:
    """The dependency that checks the bearer key; FastAPI's HTTPBearer puts the scheme into the OpenAPI document."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def __call__(self, credentials: BearerKey) -> None:
        if credentials is None or not keys_match(credentials.credentials.strip(), self.key):
            raise ApiError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},  # RFC 6750: the scheme a client should use
            )


def _auth(config: ServeConfig) -> list[Any]:
    """Dependencies of the routes behind the key: none without --api-key."""
    return [Depends(_KeyCheck(config.api_key))] if config.api_key else []


def _probes(service: Service) -> APIRouter:
    """/health (liveness), /ready (readiness: 503 while loading or draining), /metrics (Prometheus)."""
    router = APIRouter()
    engine, config = service.engine, service.config

    @router.get("/health", response_model=None, responses=openapi.ok(openapi.Health, "The process answers"))
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "ready": engine.ready.is_set()})

    ready_docs = {**openapi.ok(openapi.Ready, "Loaded, warmed up and taking requests"), **openapi.not_ready()}

    @router.get("/ready", response_model=None, responses=ready_docs)
    async def ready() -> JSONResponse:
        if engine.ready.is_set() and not service.draining:
            return JSONResponse({"status": "ready", "artifact": service.selection.artifact.id})
        status = "draining" if service.draining else "failed" if engine.error is not None else "loading"
        body = {"status": status, "error": str(engine.error) if engine.error else None}
        return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_SECONDS})

    for path, probe in zip(_HEAD_TOO, (health, ready), strict=True):  # monitors that probe with HEAD (RFC 9110)
        router.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)

    guarded = not config.public_metrics and bool(config.api_key)
    metrics_docs = {**openapi.metrics_response(), **(openapi.errors(401) if guarded else {})}

    @router.get("/metrics", response_class=Response, responses=metrics_docs, dependencies=_auth(config) if guarded else [])
    async def prometheus() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _v1(service: Service) -> APIRouter:
    """The OpenAI routes: models, voices, speech; behind the API key when there is one."""
    auth = _auth(service.config)
    router = APIRouter(prefix="/v1", dependencies=auth)
    common = openapi.errors(401, 503) if auth else openapi.errors(503)

    @router.get("/models", response_model=None, responses={**openapi.ok(openapi.ModelList, "The served artifact and the "
                "OpenAI model names that stand for it"), **common})  # fmt: skip
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": service.model_entries()})

    @router.get("/models/{model_id}", response_model=None,
                responses={**openapi.ok(openapi.ModelEntry, "One model"), **openapi.errors(404), **common})  # fmt: skip
    async def model(model_id: str) -> JSONResponse:
        for entry in service.model_entries():
            if entry["id"] == model_id:
                return JSONResponse(entry)
        raise ApiError(404, f"no model '{model_id}'", param="model", code="model_not_found")

    voice_docs = {**openapi.ok(openapi.VoiceList, "The artifact's voices, then the OpenAI names"), **common}

    @router.get("/audio/voices", response_model=None, responses=voice_docs)
    async def voices() -> JSONResponse:
        service.require_ready()
        assert service.engine.synth is not None
        return JSONResponse({"voices": voice_entries(service.engine.synth.voices, service.aliases)})

    voice_names = [*service.selection.artifact.voice_names, *OPENAI_VOICES]
    speech_docs = {**openapi.speech_responses(), **common}

    @router.post("/audio/speech", response_class=Response, responses=speech_docs,
                 openapi_extra=openapi.speech_body(voice_names, service.config))  # fmt: skip
    async def speech(request: Request) -> Response:
        return await SpeechHandler(service, request).respond()

    return router


class _Gate:
    """Counts the /v1 requests in progress (from their headers to their last byte) and, while the server
    drains, turns new ones away with 503: a request that arrived before the drain finishes, even one
    still sending its body."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.service.draining:
            refusal = self.service.shutting_down()
            self.service.metrics.errors.labels(refusal.code).inc()
            await refusal.response()(scope, receive, send)
            return
        self.service.open_scopes[id(scope)] = scope
        try:
            await self.app(scope, receive, send)
        finally:
            del self.service.open_scopes[id(scope)]


def _error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error as OpenAI's error body, counted by code; framework errors keep their headers (405's Allow)."""

    def fail(exc: ApiError) -> JSONResponse:
        metrics.errors.labels(exc.code or str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return fail(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = validation_message(list(exc.errors()))
        return fail(ApiError(400, message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = exc.headers
        if exc.status_code == 405 and request.url.path in _HEAD_TOO:  # Starlette's Allow names one route's methods
            headers = {**(headers or {}), "Allow": "GET, HEAD"}
        message, path = str(exc.detail), request.url.path[:200]  # quoted back: a client's path may be any length
        if exc.status_code == 404:  # as OpenAI words it
            message = f"Invalid URL ({request.method} {path})"
        elif exc.status_code == 405 and headers and "Allow" in headers:
            message = f"{request.method} is not allowed on {path}: use {headers['Allow']}"
        return fail(ApiError(exc.status_code, message, headers=headers))


def create_app(selection: Selection, config: ServeConfig | None = None, *, engine: Engine | None = None) -> FastAPI:
    """The app serving `selection`; the engine loads and warms up when the app starts (lifespan).
    An artifact that cannot run here (Core ML off macOS) is refused now, before a server starts."""
    problem = runtime_problem(selection.artifact)
    if problem is not None:
        raise problem
    if config is None:
        config = engine.config if engine is not None else ServeConfig.for_selection(selection)
    metrics = engine.metrics if engine and engine.metrics else Metrics()
    engine = engine or Engine(selection, config, metrics)
    service = Service(selection, config, engine, metrics)
    metrics.bind(engine.queue_depth, lambda: service.inflight, lambda: float(engine.busy()), lambda: float(engine.ready.is_set()),
                 lambda: service.open_requests)  # fmt: skip

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    # no redirects of a path with a trailing slash: their Location names whatever Host the client sent
    app = FastAPI(title="kokoro-opt", summary="OpenAI-compatible Kokoro TTS", description=openapi.DESCRIPTION, lifespan=lifespan,
                  redirect_slashes=False)  # fmt: skip
    app.state.serve = service
    app.add_middleware(_Gate, service=service)

    def foreign_host(host: str) -> Response:
        message = f"this server answers requests for this machine only, not for host {host[:100]!r}"
        refusal = ApiError(421, f"{message}: ask for 127.0.0.1 or localhost, or start it with --allowed-host NAME "
                           "(a reverse proxy's name)", code="invalid_host")  # fmt: skip
        metrics.errors.labels(refusal.code).inc()
        return refusal.response()

    app.state.bound_host = None  # where it listens, once served (server.py)
    app.add_middleware(LoopbackHost, refusal=foreign_host, bound=lambda: app.state.bound_host, allowed=config.allowed_hosts)
    app.add_middleware(CloseUnread)  # outermost: also for what routing and auth answer
    _error_handlers(app, metrics)
    app.include_router(_probes(service))
    app.include_router(_v1(service))
    openapi.install(app)
    return app
