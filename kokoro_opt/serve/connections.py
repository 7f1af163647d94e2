"""What one connection may hold, on the application's side (server.guarded_http holds the protocol's): an answer
sent before its request's body was read closes it (ASGI middleware, around every route), and a client that stops
reading a whole answer holds one slice of it in the server's buffers until it is cut (`SlicedResponse`). A server
on a loopback address answers only requests that name a loopback host (`LoopbackHost`)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ABORT = "kokoro.abort"  # scope["extensions"] key: drops the connection with a reset (server.guarded_http sets it)


def abort_connection(scope: Scope) -> None:
    """Drop the connection with a reset, where the server lets the app (server.guarded_http): a stream cut short on
    HTTP/1.0 has no final chunk to leave out, and a clean close there reads as a complete file."""
    abort: Callable[[], None] | None = scope.get("extensions", {}).get(ABORT)
    if abort is not None:
        abort()


def is_loopback(host: str) -> bool:
    name = host.strip("[]").lower().rstrip(".")  # an address, or a name (`_host_name`'s)
    if name == "localhost" or name.endswith(".localhost"):  # resolved to loopback by browsers, never by DNS
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The host of a Host header (`name`, `name:port`, `[v6]`, `[v6]:port`), as compared: lower case, no final dot."""
    if value.startswith("["):
        value = value[: value.find("]") + 1] if "]" in value else value
    elif value.count(":") == 1:
        value = value.rsplit(":", 1)[0]
    return value.lower().rstrip(".")


class LoopbackHost:
    """Bound to a loopback address (the default), a request whose Host names another machine is refused. A web page
    can have its own domain re-pointed at 127.0.0.1 (DNS rebinding): the browser then sends it here as same-origin,
    no CORS preflight asked, but its Host header still names that domain. This machine's names are answered, and
    `allowed` ones (a reverse proxy on this machine passing its public name; "*": any). Bound to another address
    (`bound()`: the address the server's socket listens on, set once it is served) any Host is answered."""

    def __init__(self, app: ASGIApp, refusal: Callable[[str], Response], bound: Callable[[], str | None],
                 allowed: tuple[str, ...] = ()) -> None:  # fmt: skip
        import socket

        self.app, self.refusal, self.bound = app, refusal, bound
        self.allowed = {_host_name(name) for name in (*allowed, socket.gethostname())}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # where it listens (a name given as --host resolved); run by another server, the connection's own address
        bound = self.bound() or str((scope.get("server") or ("", 0))[0] or "")
        if scope["type"] == "http" and is_loopback(bound) and "*" not in self.allowed:
            host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
            name = _host_name(host)
            if host and not is_loopback(name) and name not in self.allowed:
                await self.refusal(host)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


class SlicedResponse(Response):
    """A whole body (with its length) sent in slices: a client that stops reading holds one slice in the server's
    write buffer until it is cut (server.guarded_http), where one write would hold the whole body."""

    SLICE = 64 * 1024

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = memoryview(self.body)
        for start in range(0, len(body), self.SLICE):
            await send({"type": "http.response.body", "body": bytes(body[start : start + self.SLICE]), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()
