"""What one connection may hold: an answer sent before its request's body was read closes it, and a client that
stops reading an answer is cut (ASGI middleware, around every route), holding one slice of a whole answer in the
server's buffers at most (`SlicedResponse`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kokoro_opt.serve")


class Aborted(Exception):
    """An answer that cannot finish after its headers left (a timeout, a synthesis error, a listener that stopped
    reading): the app returns without its end, and the server closes the connection, so the client sees it cut."""


class CloseUnread:
    """A response sent before its request's body was read to the end (401, 404, 405, 408, 413, 415, ...) closes the
    connection: to reuse it, uvicorn would otherwise read the rest of that body, of any size and at any pace."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", [])) if scope["type"] == "http" else {}
        unread = headers.get(b"content-length", b"0") != b"0" or b"chunked" in headers.get(b"transfer-encoding", b"")
        if not unread:
            await self.app(scope, receive, send)
            return

        async def receive_noting_the_end() -> Message:
            nonlocal unread
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                unread = False
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and unread:
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*kept, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive_noting_the_end, send_closing)


class CutStalled:
    """A client that reads nothing of an answer for `seconds` (its connection's buffers full, so the server's next
    write waits) is cut: it would hold that answer's memory, and a stream's place in the queue, for as long as it
    likes. A player reading as it plays never waits that long for one piece."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_or_cut(message: Any) -> None:
            try:
                async with asyncio.timeout(self.seconds):
                    await send(message)
            except TimeoutError:
                log.warning("a client read nothing for %g s: its answer is cut", self.seconds)
                raise Aborted from None

        try:
            await self.app(scope, receive, send_or_cut)
        except* Aborted:
            pass


class SlicedResponse(Response):
    """A whole body (with its length) sent in slices: a client that stops reading holds one slice in the server's
    write buffer once it is cut (`CutStalled`), where one write of the whole body stays there until it reads."""

    SLICE = 64 * 1024

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = memoryview(self.body)
        for start in range(0, len(body), self.SLICE):
            await send({"type": "http.response.body", "body": bytes(body[start : start + self.SLICE]), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()
