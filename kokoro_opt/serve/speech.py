"""POST /v1/audio/speech: one request from its body to the last byte sent.

A request is read (bounded), parsed (strict types, the limits of the OpenAPI document), admitted (a
queue slot, or 429), planned (normalized and phonemized off the event loop, then its cost checked
against `max_input_tokens` before any synthesis), then either collected whole or streamed. However it
ends (done, client gone, timeout, error), its slot is given back and its synthesis cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kokoro_opt.characters import lone_surrogate
from kokoro_opt.errors import UserError
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.connections import SlicedResponse, abort_connection
from kokoro_opt.serve.encoders import MEDIA_TYPES, make_encoder, supported_formats
from kokoro_opt.serve.openai_compat import (
    BLANK,
    ApiError,
    SpeechRequest,
    sse_delta,
    sse_done,
    sse_event,
    validation_message,
)
from kokoro_opt.serve.plan import Piece
from kokoro_opt.serve.stream import Stream

if TYPE_CHECKING:
    from kokoro_opt.serve.service import Service

log = logging.getLogger("kokoro_opt.serve")
T = TypeVar("T")
# blank as the OpenAPI document says (openai_compat.BLANK), not as str.isspace: that also counts U+001C-U+001F and
# U+0085, control characters, which are read as spaces and answered with silence like the others
_BLANK = re.compile(f"[{BLANK}]*")
_DRAIN_LIMIT = 8 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so the client sees the 413
SILENCE_SECONDS = 0.1  # the answer to input with nothing to voice (only symbols espeak does not read)


class _Aborted(Exception):
    """A stream that cannot finish (timeout, synthesis error) after its headers left: drop the connection."""


class AudioStreamResponse(StreamingResponse):
    """A StreamingResponse whose cleanup runs however it ends: done, client gone (even before the first
    byte, when the body generator never starts), aborted, or cut (server.guarded_http)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except* _Aborted:
            # without its final chunk an HTTP/1.1 client sees the failure; HTTP/1.0 has none: the connection is reset
            abort_connection(scope)
        finally:
            self._on_close()


async def read_json(request: Request, limit: int, seconds: float) -> dict[str, Any]:
    """The body as a JSON object, read within `seconds` (a stalled upload would hold its connection open).

    Only a body sent as JSON: a web page may POST `text/plain` to a server on this machine without asking it first
    (a CORS "simple request"), where `application/json` needs a preflight this server never answers."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        sent = f"as {media!r}" if media else "without a content type"
        raise ApiError(415, f"the body is sent {sent}; send it as application/json (Content-Type header)",
                       code="unsupported_media_type")  # fmt: skip
    declared = request.headers.get("content-length", "")
    if request.headers.get("expect", "").lower() == "100-continue" and declared.isdigit() and int(declared) > limit:
        # the client waits to be asked for its body (curl does above 1 MB): it is refused before the first read,
        # which would ask for it; a client already sending is read on, up to _DRAIN_LIMIT, so it sees the 413
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    received = 0
    try:
        async with asyncio.timeout(seconds):
            async for part in request.stream():
                received += len(part)
                if received <= limit:
                    body += part
                elif received > _DRAIN_LIMIT:
                    break
    except TimeoutError:
        if received <= limit:
            raise ApiError(408, f"the request body did not arrive within {seconds:g} s", code="request_timeout") from None
    except ClientDisconnect:  # gone before its body was complete: nobody reads the answer
        raise ApiError(400, "the client closed the connection before its body was complete", code="client_closed") from None
    if received > limit:  # the rest of the body is not read: the answer closes the connection (connections.CloseUnread)
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"could not parse the JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # json's decoder recurses once per level
        raise ApiError(400, "the JSON body nests too deeply: send a flat object", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the JSON body must be an object", code="invalid_json")
    return data


def parse(data: dict[str, Any], config: ServeConfig) -> SpeechRequest:
    try:
        req = SpeechRequest.model_validate(data)
    except ValidationError as exc:
        message, param, code = validation_message(exc.errors())
        raise ApiError(400, message, param=param, code=code) from None
    if req.response_format not in supported_formats():
        raise ApiError(400, f"unsupported response_format '{req.response_format}'; use one of: {', '.join(supported_formats())}",
                       param="response_format")  # fmt: skip
    if req.stream_format == "sse":
        req.stream = True  # events are a stream by definition
    if _BLANK.fullmatch(req.input):
        raise ApiError(400, "input is empty: give some text to speak", param="input")
    if len(req.input) > config.max_input_chars:
        raise ApiError(400, f"input is {len(req.input)} characters; the limit is {config.max_input_chars}",
                       param="input", code="string_above_max_length")  # fmt: skip
    if (position := lone_surrogate(req.input)) is not None:  # JSON can carry one ("\ud800"); it is no text
        raise ApiError(400, f"input has an invalid character at position {position} (a lone surrogate)", param="input")
    return req


def check_cost(tokens: int, speed: float, limit: int) -> None:
    """The work a request asks for, known after normalization and phonemization, before any synthesis.
    Slower speech decodes more frames per token: below speed 1 a token weighs 1/speed."""
    cost = tokens / min(speed, 1.0)
    if cost > limit:
        weighed = "" if speed >= 1.0 else f", which at speed {speed:g} is the work of {round(cost):,}"
        raise ApiError(
            413,
            f"input is {tokens:,} phoneme tokens after normalization{weighed}; the limit is {limit:,} "
            "(serve --max-input-tokens): send it as several requests",
            param="input",
            code="input_too_long",
        )


async def _chunks(stream: Stream, time_left: Callable[[], float]) -> AsyncIterator[bytes]:
    """The stream's audio as the engine makes it, each next piece awaited for `time_left()` seconds at most; what is
    already made is never cut (asyncio.wait_for with no time left drops a ready item on Python 3.11)."""
    while True:
        try:
            if not stream.queue.empty():
                item = stream.queue.get_nowait()
            else:
                item = await asyncio.wait_for(stream.queue.get(), max(0.0, time_left()))
        except TimeoutError:
            raise ApiError(504, "the request timed out", type_="server_error", code="timeout") from None
        if item is None:
            return
        if isinstance(item, BaseException):
            raise ApiError(500, f"synthesis failed: {item}", type_="server_error", code="synthesis_failed")
        yield item


async def _collect(stream: Stream, deadline: float) -> bytes:
    loop = asyncio.get_running_loop()
    return b"".join([data async for data in _chunks(stream, lambda: deadline - loop.time())])


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Gone(Exception):
    """The client left before its answer (or a stream's first audio) was ready."""


async def _before_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled and _Gone raised (before a
    response starts, nothing else listens for the disconnect)."""
    watcher = asyncio.ensure_future(_until_disconnect(request))
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({watcher, task}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise _Gone
        return task.result()
    finally:  # gone, or this handler cancelled (a shutdown): neither task outlives it
        watcher.cancel()
        task.cancel()


class SpeechHandler:
    """One speech request: `await SpeechHandler(service, request).respond()`."""

    def __init__(self, service: Service, request: Request) -> None:
        self.service, self.request = service, request
        self.started = time.perf_counter()
        self.status = "cancelled"  # what the request counts as in kokoro_requests_total, if nothing else is set
        self.stream: Stream | None = None
        self.req: SpeechRequest | None = None
        self.first_sent = threading.Event()  # the first audio is on its connection (Engine._let_first_audio_out)

    @property
    def label(self) -> str:
        return "true" if self.req is not None and self.req.stream else "false"

    async def respond(self) -> Response:
        service = self.service
        config = service.config
        try:  # refused before it has a slot: counted here, as `close` counts the others
            self.req = req = parse(await read_json(self.request, config.body_bytes, config.body_timeout), config)
            service.require_ready()
            pack = service.pack(req.voice)
            directives = self.request.headers.get("cache-control", "").lower()
            key = None if "no-store" in directives else service.cache_key(req)  # no-store: neither read nor kept
            cached = service.cache.get(key) if key and "no-cache" not in directives else None
            if cached is None:
                service.admit()
        except ApiError as exc:
            fmt = self.req.response_format if self.req is not None else "unread"
            service.metrics.requests.labels(fmt, self.label, str(exc.status)).inc()
            raise
        if cached is not None:  # a repeat: no synthesis, no queue slot
            service.metrics.cache_hits.inc()
            service.metrics.requests.labels(req.response_format, self.label, "200").inc()
            self._observe(whole=False)
            return SlicedResponse(cached, media_type=MEDIA_TYPES[req.response_format])
        try:
            pieces, tokens = await self._plan(req)
            if pieces:
                engine = service.engine
                encoder = make_encoder(req.response_format, engine.sample_rate, streaming=req.stream)
                sent = self.first_sent if req.stream else None
                self.stream = engine.enqueue(Stream(pieces, pack, req.speed, encoder, req.stream, engine.new_joiner(), sent))
        except BaseException as exc:
            self.status = str(exc.status) if isinstance(exc, ApiError) else "500"
            self.close()
            raise
        if not pieces:
            self.status = "200"
            self.close()
            return self._silence(req)
        if not req.stream:
            return await self._whole(key)
        return await self._streaming(key, tokens=tokens)

    async def _plan(self, req: SpeechRequest) -> tuple[list[Piece], int]:
        """The request's pieces, and the tokens they speak (what a 413 and SSE's usage count)."""
        planning = self.service.planning
        planning.append(len(req.input))  # what a 429 meanwhile prices it at (`Engine.retry_after`)
        try:
            pieces = await asyncio.to_thread(self.service.engine.plan, req.input, req.speed)
        except UserError as exc:
            raise ApiError(400, str(exc), param="input") from None
        finally:
            planning.remove(len(req.input))
        # what the input asks for: the context a cut adds is a few words (and its frames are not decoded)
        tokens = self.service.engine.spoken_tokens(pieces)
        check_cost(tokens, req.speed, self.service.config.max_input_tokens)
        return pieces, tokens

    def close(self) -> None:
        """Give the queue slot back and stop the synthesis (a no-op when it finished): once, however it ended."""
        self.service.release()
        self.first_sent.set()  # nothing more will be sent: the worker need not wait for it
        if self.stream is not None:
            self.service.engine.cancel(self.stream)
        assert self.req is not None
        self.service.metrics.requests.labels(self.req.response_format, self.label, self.status).inc()

    def _observe(self, whole: bool = True) -> None:
        """A response sent in one piece: its first audio is its last byte."""
        elapsed = time.perf_counter() - self.started
        self.service.metrics.ttfa.labels(self.label).observe(elapsed)
        if whole:
            self.service.metrics.response.labels(self.label).observe(elapsed)

    def _silence(self, req: SpeechRequest) -> Response:
        """Input with nothing to voice gets a short silence in the format asked for, as a player expects."""
        rate = self.service.engine.sample_rate
        encoder = make_encoder(req.response_format, rate, streaming=req.stream)
        audio = encoder.encode(np.zeros(round(SILENCE_SECONDS * rate), dtype=np.float32)) + encoder.finish()
        self._observe()
        if req.stream_format == "sse":
            return Response(sse_delta(audio) + sse_done(0, SILENCE_SECONDS), media_type="text/event-stream")
        return Response(audio, media_type=MEDIA_TYPES[req.response_format])

    async def _whole(self, key: Any) -> Response:
        assert self.stream is not None and self.req is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.service.config.request_timeout
        try:
            body = await _before_disconnect(self.request, _collect(self.stream, deadline))
            self.status = "200"
        except _Gone:  # the client left: its synthesis stops now (close)
            return Response(status_code=499)
        except ApiError as exc:
            self.status = str(exc.status)
            raise
        finally:
            self.close()
        self._observe()
        if key:
            self.service.cache.put(key, body)
        return SlicedResponse(body, media_type=MEDIA_TYPES[self.req.response_format])

    async def _streaming(self, key: Any, tokens: int) -> Response:
        req, stream = self.req, self.stream
        assert req is not None and stream is not None
        sse = req.stream_format == "sse"
        # the headers go with the first audio: a stream that fails before it (a timeout, synthesis) is then an
        # error response (504, 500), not a 200 cut short
        chunks = _chunks(stream, lambda: self.service.config.request_timeout)
        try:
            first = await _before_disconnect(self.request, anext(chunks, None))
        except _Gone:  # the client left before its first audio: its slot and synthesis go now
            self.close()
            return Response(status_code=499)
        except BaseException as exc:
            if isinstance(exc, ApiError):
                self.status = str(exc.status)
            self.close()
            raise
        return AudioStreamResponse(
            self._body(key, tokens, chunks, first),
            self.close,
            media_type="text/event-stream" if sse else MEDIA_TYPES[req.response_format],
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _body(self, key: Any, tokens: int, chunks: AsyncIterator[bytes], first: bytes | None) -> AsyncIterator[bytes]:
        """`first`, then the rest of `chunks`: a stream played in real time lasts as long as its speech, so the wait
        for its next audio is what is bounded (`_chunks`)."""
        stream, req, service = self.stream, self.req, self.service
        assert stream is not None and req is not None
        metrics, sse = service.metrics, req.stream_format == "sse"
        if first is not None:
            metrics.ttfa.labels(self.label).observe(time.perf_counter() - self.started)
        sent = 0
        kept: list[bytes] | None = [] if key else None  # the body, for the cache, while it fits there

        async def audio() -> AsyncIterator[bytes]:
            if first is not None:
                yield first
                self.first_sent.set()  # resumed once the server handed it to the connection
                async for data in chunks:
                    yield data

        try:
            async for data in audio():
                sent += len(data)
                if kept is not None and sent <= service.cache.entry_limit:
                    kept.append(data)
                else:
                    kept = None
                yield sse_delta(data) if sse else data
        except ApiError as exc:
            self.status = str(exc.status)
            metrics.errors.labels(exc.code or str(exc.status)).inc()
            log.warning("request aborted after %d bytes: %s", sent, exc.message)
            if not sse:
                raise _Aborted from None
            yield sse_event("error", error={"message": exc.message, "type": exc.type_, "param": exc.param, "code": exc.code})
            return
        if sse:
            yield sse_done(tokens, stream.audio_out)
        self.status = "200"
        if key and kept is not None:
            service.cache.put(key, b"".join(kept))
        metrics.response.labels(self.label).observe(time.perf_counter() - self.started)
