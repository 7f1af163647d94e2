"""The OpenAI-compatible HTTP server: FastAPI routes over one `Engine`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kokoro_opt.errors import UserError
from kokoro_opt.runtime.availability import runtime_problem
from kokoro_opt.select import Selection
from kokoro_opt.serve.cache import AudioCache, CacheKey
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.encoders import MEDIA_TYPES, make_encoder, supported_formats
from kokoro_opt.serve.engine import Engine, Stream
from kokoro_opt.serve.metrics import Metrics
from kokoro_opt.serve.openai_compat import (
    OPENAI_MODELS,
    SpeechRequest,
    error_response,
    openai_voice_map,
    sse_delta,
    sse_done,
    sse_event,
    validation_message,
    voice_entries,
)
from kokoro_opt.voices import blend_voice

log = logging.getLogger("kokoro_opt.serve")
_DRAIN_LIMIT = 8 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so the client sees the 413


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type_, self.headers = status, message, param, code, type_, headers


class _Aborted(Exception):
    """A stream that cannot finish (timeout, synthesis error) after its headers left: drop the connection."""


class AudioStreamResponse(StreamingResponse):
    """A StreamingResponse whose cleanup runs however it ends: done, client gone (even before the first
    byte, when the body generator never starts), or aborted."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except* _Aborted:
            pass  # returning without the final chunk makes the server close the connection: the client sees the failure
        finally:
            self._on_close()


class _State:
    def __init__(self, engine: Engine, config: ServeConfig, metrics: Metrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        self.inflight = 0  # touched only on the event loop
        self._aliases: dict[str, str] | None = None
        self.cache = AudioCache(int(config.audio_cache_mb * 1024 * 1024))

    def cache_key(self, req: SpeechRequest) -> CacheKey | None:
        """Where this request's response is kept; None when the cache is off, or for SSE events."""
        if self.cache.max_bytes <= 0 or req.stream_format == "sse":
            return None
        return CacheKey(req.input, req.voice, req.speed, req.response_format, req.stream)

    @property
    def aliases(self) -> dict[str, str]:
        if self._aliases is None:
            assert self.engine.synth is not None
            self._aliases = openai_voice_map(self.engine.synth.voices)
        return self._aliases

    def pack(self, spec: str) -> Any:
        assert self.engine.synth is not None
        packs = self.engine.synth.packs
        try:
            return blend_voice(spec, packs, self.aliases)
        except UserError as exc:
            if spec.lower() != spec:  # "Alloy", "JF_ALPHA": names are lower case
                with contextlib.suppress(UserError):
                    return blend_voice(spec.lower(), packs, self.aliases)
            raise ApiError(400, exc.message + (f"; {exc.hint}" if exc.hint else ""), param="voice") from None


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    body = bytearray()
    too_big = False
    async for part in request.stream():
        if not too_big:
            body += part
            too_big = len(body) > limit
        if too_big and len(body) + len(part) > _DRAIN_LIMIT:
            break
    if too_big:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large",
                       param="input")  # fmt: skip
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"could not parse the JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the JSON body must be an object", code="invalid_json")
    return data


def _parse(data: dict[str, Any], state: _State) -> SpeechRequest:
    try:
        req = SpeechRequest.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise ApiError(400, message, param=param) from None
    if req.response_format not in supported_formats():
        raise ApiError(400, f"unsupported response_format '{req.response_format}'; use one of: {', '.join(supported_formats())}",
                       param="response_format")  # fmt: skip
    if req.stream_format == "sse":
        req.stream = True  # events are a stream by definition
    if not req.input.strip():
        raise ApiError(400, "input is empty: give some text to speak", param="input")
    if len(req.input) > state.config.max_input_chars:
        raise ApiError(400, f"input is {len(req.input)} characters; the limit is {state.config.max_input_chars}",
                       param="input", code="string_above_max_length")  # fmt: skip
    return req


async def _chunks(stream: Stream, deadline: float) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    while True:
        try:
            item = await asyncio.wait_for(stream.queue.get(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise ApiError(504, "the request timed out", type_="server_error", code="timeout") from None
        if item is None:
            return
        if isinstance(item, BaseException):
            raise ApiError(500, f"synthesis failed: {item}", type_="server_error", code="synthesis_failed")
        yield item


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(selection: Selection, config: ServeConfig | None = None, *, engine: Engine | None = None) -> FastAPI:
    """The app serving `selection`; the engine loads and warms up when the app starts (lifespan).
    An artifact that cannot run here (Core ML off macOS) is refused now, before a server starts."""
    problem = runtime_problem(selection.artifact)
    if problem is not None:
        raise problem
    config = config or ServeConfig.for_selection(selection)
    metrics = engine.metrics if engine and engine.metrics else Metrics()
    engine = engine or Engine(selection, config, metrics)
    state = _State(engine, config, metrics)
    metrics.bind(engine.queue_depth, lambda: state.inflight, lambda: float(engine.busy()), lambda: float(engine.ready.is_set()))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="kokoro-opt", summary="OpenAI-compatible Kokoro TTS", lifespan=lifespan)
    app.state.serve = state

    def fail(exc: ApiError) -> JSONResponse:
        metrics.errors.labels(exc.code or str(exc.status)).inc()
        return error_response(exc.status, exc.message, type_=exc.type_, param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return fail(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return fail(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return fail(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    def auth(request: Request) -> None:
        if not config.api_key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    def require_ready() -> None:
        if engine.error is not None:
            raise ApiError(503, f"the model failed to load: {engine.error}", type_="server_error", code="load_failed")
        if not engine.ready.is_set():
            raise ApiError(503, "the model is still warming up", type_="server_error", code="not_ready",
                           headers={"Retry-After": "2"})  # fmt: skip

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "ready": engine.ready.is_set()}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if engine.ready.is_set():
            return JSONResponse({"status": "ready", "artifact": selection.artifact.id})
        status = "failed" if engine.error is not None else "loading"
        return JSONResponse({"status": status, "error": str(engine.error) if engine.error else None}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_entries() -> list[dict[str, Any]]:
        art = selection.artifact
        created = int(art.path.stat().st_mtime)
        base = {"object": "model", "created": created, "owned_by": "kokoro-opt"}
        served = {"id": art.id, **base, "name": art.name, "reason": selection.reason}
        return [served, *({"id": m, **base, "root": art.id} for m in OPENAI_MODELS)]

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_entries()}

    @app.get("/v1/models/{model_id}", dependencies=[Depends(auth)])
    async def model(model_id: str) -> dict[str, Any]:
        for entry in model_entries():
            if entry["id"] == model_id:
                return entry
        raise ApiError(404, f"no model '{model_id}'", param="model", code="model_not_found")

    @app.get("/v1/audio/voices", dependencies=[Depends(auth)])
    async def voices() -> dict[str, Any]:
        require_ready()
        assert engine.synth is not None
        return {"voices": voice_entries(engine.synth.voices, state.aliases)}

    @app.post("/v1/audio/speech", dependencies=[Depends(auth)])
    async def speech(request: Request) -> Response:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        req = _parse(await _read_json(request, config.max_body_bytes), state)
        require_ready()
        pack = state.pack(req.voice)
        label = "true" if req.stream else "false"
        directives = request.headers.get("cache-control", "").lower()
        key = None if "no-store" in directives else state.cache_key(req)  # no-store: neither read nor kept
        cached = state.cache.get(key) if key and "no-cache" not in directives else None
        if cached is not None:  # a repeat: no synthesis, no queue slot
            metrics.cache_hits.inc()
            metrics.requests.labels(req.response_format, label, "200").inc()
            metrics.ttfa.labels(label).observe(time.perf_counter() - started)
            return Response(cached, media_type=MEDIA_TYPES[req.response_format])
        if state.inflight >= config.max_queue:
            raise ApiError(429, f"server busy: {state.inflight} requests in progress (limit {config.max_queue})",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(engine.retry_after(state.inflight))})  # fmt: skip
        state.inflight += 1
        outcome = {"status": "cancelled"}
        stream: Stream | None = None

        def close() -> None:
            state.inflight -= 1
            if stream is not None:
                engine.cancel(stream)  # a no-op when it finished
            metrics.requests.labels(req.response_format, label, outcome["status"]).inc()

        try:
            try:
                pieces = await asyncio.to_thread(engine.plan, req.input)
            except UserError as exc:
                raise ApiError(400, str(exc), param="input") from None
            if not pieces:
                raise ApiError(400, "nothing to say: the input has no pronounceable characters", param="input")
            encoder = make_encoder(req.response_format, engine.sample_rate, streaming=req.stream)
            stream = engine.submit(pieces, pack, req.speed, encoder, req.stream)
        except BaseException as exc:
            outcome["status"] = str(exc.status) if isinstance(exc, ApiError) else "500"
            close()
            raise
        assert stream is not None
        deadline = loop.time() + config.request_timeout
        tokens = sum(map(len, pieces))

        if not req.stream:
            watcher = asyncio.ensure_future(_until_disconnect(request))
            collector = asyncio.ensure_future(_collect(stream, deadline))
            try:
                await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
                if not collector.done():  # the client left: stop its synthesis now
                    collector.cancel()
                    return Response(status_code=499)
                body = collector.result()
                outcome["status"] = "200"
            except ApiError as exc:
                outcome["status"] = str(exc.status)
                raise
            finally:
                watcher.cancel()
                close()
            elapsed = time.perf_counter() - started
            metrics.ttfa.labels(label).observe(elapsed)
            metrics.response.labels(label).observe(elapsed)
            if key:
                state.cache.put(key, body)
            return Response(body, media_type=MEDIA_TYPES[req.response_format])

        async def body() -> AsyncIterator[bytes]:
            first = True
            sent = 0
            kept: list[bytes] | None = [] if key else None  # the body, for the cache, while it fits there
            try:
                async for data in _chunks(stream, deadline):
                    if first:
                        metrics.ttfa.labels(label).observe(time.perf_counter() - started)
                        first = False
                    sent += len(data)
                    if kept is not None and sent <= state.cache.entry_limit:
                        kept.append(data)
                    else:
                        kept = None
                    yield sse_delta(data) if req.stream_format == "sse" else data
            except ApiError as exc:
                outcome["status"] = str(exc.status)
                metrics.errors.labels(exc.code or str(exc.status)).inc()
                log.warning("request aborted after %d bytes: %s", sent, exc.message)
                if req.stream_format != "sse":
                    raise _Aborted from None
                yield sse_event("error", error={"message": exc.message, "type": exc.type_, "code": exc.code})
                return
            if req.stream_format == "sse":
                yield sse_done(tokens, stream.audio_out)
            outcome["status"] = "200"
            if key and kept is not None:
                state.cache.put(key, b"".join(kept))
            metrics.response.labels(label).observe(time.perf_counter() - started)

        sse = req.stream_format == "sse"
        return AudioStreamResponse(
            body(),
            close,
            media_type="text/event-stream" if sse else MEDIA_TYPES[req.response_format],
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


async def _collect(stream: Stream, deadline: float) -> bytes:
    return b"".join([data async for data in _chunks(stream, deadline)])
