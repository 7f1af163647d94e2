"""Running the app under uvicorn: in the foreground (CLI) or on a background thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import h11
import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kokoro_opt.errors import UserError
from kokoro_opt.select import Selection
from kokoro_opt.serve.app import create_app
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.connections import ABORT, is_loopback
from kokoro_opt.serve.engine import Engine
from kokoro_opt.serve.service import Service
from kokoro_opt.tables import plain

log = logging.getLogger("kokoro_opt.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM (or a first Ctrl-C) drains before it stops: /ready and new requests get 503
    with Retry-After while the requests in flight finish (up to the app's drain timeout); then uvicorn
    closes its socket and exits, and the process ends with 0. A second signal stops at once.

    uvicorn alone closes the listening socket at the first signal (new requests and probes see
    "connection refused") and cuts what runs past its graceful timeout; it also raises the signal again
    after its shutdown, so the process would end killed by SIGTERM rather than with 0."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.service.draining:
            self.should_exit = self.force_exit = True  # the second signal: stop now
        else:
            self.service.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.service.drained() or self.service.engine.error is not None:  # nothing to serve: say why and end
            self.should_exit = True
        return await super().on_tick(counter)


def guarded_http(config: ServeConfig) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with two limits on what one connection may hold:

    - a request's headers must arrive within `body_timeout` of the connection being ready for them (opened, or its
      last response sent), else it is closed: uvicorn's own keep-alive timer stops at any byte, so a client that
      sent half its headers, or a byte now and then, held its connection forever;
    - a client that reads nothing of an answer for `request_timeout` (the server's writes paused, its buffers full)
      is cut: the connection is aborted, which frees what was buffered for it, and the request ends as a
      disconnect, giving its place in the queue back. A player reading as it plays never waits that long."""
    headers_seconds, stall_seconds = config.body_timeout, config.request_timeout

    class GuardedHTTP(H11Protocol):
        _due: asyncio.TimerHandle | None = None  # when the headers awaited now must have arrived
        _stalled: asyncio.TimerHandle | None = None  # when a client that stopped reading is cut

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._wait_for_headers()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None:  # a new request's: it may drop the connection with a reset (abort_connection)
                self.cycle.scope.setdefault("extensions", {})[ABORT] = self._reset

        def _reset(self) -> None:
            """Close with a reset (RST), not a FIN: the client sees an error, never an end of the body."""
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
            if self.cycle is not None:  # now, not when the loop reports the loss: dropped on purpose, the response it
                self.cycle.disconnected = True  # leaves unfinished is no error of the app's for uvicorn to log

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._wait_for_headers()

        def pause_writing(self) -> None:
            super().pause_writing()
            self._stalled = self.loop.call_later(stall_seconds, self._cut)

        def resume_writing(self) -> None:
            if self._stalled is not None:
                self._stalled.cancel()
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._due, self._stalled):  # else the loop holds the closed connection until they run
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def _wait_for_headers(self) -> None:
            if self._due is not None:
                self._due.cancel()
            self._due = self.loop.call_later(headers_seconds, self._headers_due)

        def _headers_due(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def _cut(self) -> None:
            log.warning("a client read nothing for %g s: its connection is cut", stall_seconds)
            self.transport.abort()

    return GuardedHTTP


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the artifact loads: a port in use or an unknown host is one error at once,
    not a log line after the model has loaded and warmed up."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {host}: {exc.strerror}", "pass --host an address of this machine") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}", "stop what uses it, or pass another --port") from None
    return sock


def serve_forever(selection: Selection, config: ServeConfig, host: str = "127.0.0.1", port: int = 8880) -> None:
    """Serve until SIGTERM or Ctrl-C (then drain, see `DrainingServer`); the artifact loads and warms up
    while /health already answers."""
    # plain output (a screen reader, a braille display): no timestamp ahead of every line, and no line per request
    quiet = plain()
    logging.basicConfig(level=logging.INFO, format=("" if quiet else "%(asctime)s ") + "%(levelname)s %(name)s: %(message)s")
    sock = listening_socket(host, port)
    if not is_loopback(sock.getsockname()[0]) and not config.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it (set --api-key)", host)
    shown = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (Ctrl-C to stop)", shown, sock.getsockname()[1])  # uvicorn's own line needs its bind
    try:
        app = create_app(selection, config)
    except BaseException:
        sock.close()
        raise
    app.state.bound_host = bound = sock.getsockname()[0]  # a name given as --host, resolved
    if config.allowed_hosts and not is_loopback(bound):
        sock.close()
        raise UserError(f"--allowed-host changes nothing on {host}: any Host is answered there", "drop --allowed-host")
    # after the drain nothing should be left: what still runs (past the drain timeout) is cut after 1 s
    settings = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=1,
                              http=guarded_http(config), access_log=not quiet, use_colors=False if quiet else None)  # fmt: skip
    DrainingServer(settings, app.state.serve).run(sockets=[sock])
    if (error := app.state.serve.engine.error) is not None:  # the artifact did not load: the process ends with it
        raise error if isinstance(error, UserError) else UserError(f"loading the artifact failed: {error!r}")


class ServerThread:
    """uvicorn on a daemon thread, on a free loopback port by default; `url` once started."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        service = getattr(app.state, "serve", None)
        http = guarded_http(service.config) if service is not None else "h11"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=http))
        self.host = host
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise UserError("the server did not start", "is the port free?")
            time.sleep(0.02)
        address = self.server.servers[0].sockets[0].getsockname()
        port = address[1]
        with contextlib.suppress(AttributeError):  # a Starlette app: where it listens (connections.LoopbackHost)
            self.app.state.bound_host = address[0]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def wait_ready(url: str, timeout: float = 300.0) -> None:
    """Block until GET /ready answers 200 (loaded and warmed up)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{url}/ready", timeout=5.0)
            if response.status_code == 200:
                return
            if response.json().get("status") == "failed":
                raise UserError(f"the server failed to load its artifact: {response.json().get('error')}")
        if time.monotonic() > deadline:
            raise UserError("the server did not become ready in time", "check that the artifact loads: kokoro-opt say")
        time.sleep(0.1)


@contextlib.contextmanager
def running(selection: Selection, config: ServeConfig, timeout: float = 300.0, engine: Engine | None = None) -> Iterator[str]:
    """A warmed-up server on a free loopback port for the duration of the block; yields its URL. `engine`: one
    made by the caller (who may then watch or steer its worker), else the app makes its own."""
    with ServerThread(create_app(selection, config, engine=engine)) as server:
        wait_ready(server.url, timeout)
        yield server.url
