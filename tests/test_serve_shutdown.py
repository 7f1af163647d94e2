"""Stopping and restarting `kokoro-opt serve`, as a real process on the tiny artifact: SIGTERM drains
(/ready and new requests 503 with Retry-After, requests in flight finish, exit 0); kill -9 leaves a
stream a client can tell is incomplete, and a server started again on the port answers at once."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kokoro_opt.artifacts import Artifact
from tests.serve_helpers import metric
from tests.servers import free_port, wait_healthy
from tests.test_serve_load import wait_for

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

TEXT = "This is the first sentence, which goes on a little. Here is a second one. And a third sentence ends it."


def start(artifact: Artifact, port: int, log: Path, drain_timeout: float = 300) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kokoro_opt.cli", "serve", "--artifact", str(artifact.path), "--port", str(port),
               "--first-chunk-tokens", "20", "--chunk-tokens", "120", "--drain-timeout", str(drain_timeout)]  # fmt: skip
    with open(log, "ab") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    if not wait_healthy(f"http://127.0.0.1:{port}", server, 300, path="/ready"):
        server.kill()
        pytest.fail(f"the server did not become ready: {log.read_text()[-3000:]}")
    return server


@pytest.fixture
def server(tiny_artifact: Artifact, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    port, log = free_port(), tmp_path / "serve.log"
    process = start(tiny_artifact, port, log)
    try:
        yield process, f"http://127.0.0.1:{port}", log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def held_request(url: str, body: dict[str, object]) -> tuple[socket.socket, bytes]:
    """A speech request whose headers and all but the last byte of its body are sent: in flight, held by us."""
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload[:-1])
    return sock, payload[-1:]


def read_response(sock: socket.socket) -> http.client.HTTPResponse:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response


def test_sigterm_drains_then_exits_0(server: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    process, url, log = server
    body = {"model": "tts-1", "input": TEXT, "voice": "tiny_0", "response_format": "pcm", "speed": 2.0}
    held, last_byte = held_request(url, body)  # arrives before the signal, its body completes after it
    wait_for(lambda: metric(url, "kokoro_open_requests") == 1, 60)
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=300) as streaming:
        assert streaming.status_code == 200
        chunks = streaming.iter_raw()
        received = len(next(chunks))
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 503, 60)  # the socket stays open: it answers
        ready = httpx.get(f"{url}/ready")
        assert ready.json()["status"] == "draining" and int(ready.headers["retry-after"]) >= 1
        refused = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/health").status_code == 200  # alive while it drains
        received += sum(len(c) for c in chunks)  # the stream in flight ends complete: no protocol error
    assert received > 24_000 and received % 2 == 0
    assert process.poll() is None  # the held request keeps it draining
    held.sendall(last_byte)
    response = read_response(held)
    assert response.status == 200
    audio = response.read()  # http.client raises IncompleteRead on a cut chunked stream
    assert len(audio) > 24_000
    held.close()
    assert process.wait(60) == 0, log.read_text()[-3000:]


def test_a_drain_timeout_cuts_what_still_runs_in_one_line_and_exits_0(tiny_artifact: Artifact, tmp_path: Path) -> None:
    """Past --drain-timeout what is still in flight is cut: a stream its client does not read (its synthesis long
    done or not), a request whose body never completes. Their connections are dropped, so each client sees an error
    and the server says it in one line: no synthesis failure, no traceback, no uvicorn cancellation."""
    port, log = free_port(), tmp_path / "serve.log"
    process = start(tiny_artifact, port, log, drain_timeout=1)
    url = f"http://127.0.0.1:{port}"
    # minutes of audio: megabytes more than the sockets between us buffer, so unread it cannot end by itself
    body = {"model": "tts-1", "input": " ".join([TEXT] * 12), "voice": "tiny_0", "response_format": "pcm", "speed": 0.25}
    try:
        held, _ = held_request(url, {**body, "input": TEXT})
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=300) as streaming:
            chunks = streaming.iter_raw()
            assert streaming.status_code == 200 and next(chunks)
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: "drain timeout" in log.read_text(), 60)
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):  # cut, never a complete body
                for _ in chunks:
                    pass
        with contextlib.suppress(ConnectionResetError):  # dropped with nothing sent: a reset, or the stream's end
            assert held.recv(1) == b""
        held.close()
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert text.count("drain timeout: cutting 2 requests still in flight") == 1
    assert "Traceback" not in text and "ERROR" not in text and "synthesis failed" not in text, text[-3000:]


def test_kill_9_leaves_an_incomplete_stream_and_a_restart_answers(
    server: tuple[subprocess.Popen[bytes], str, Path], tiny_artifact: Artifact
) -> None:
    process, url, log = server
    # ~1,200 tokens at a quarter speed (~4,800 of the 6,000 a request may ask for): four times the frames to
    # decode, so the kill comes while most of it is still to be synthesized, however busy the machine
    long = " ".join([TEXT] * 12)
    body = {"model": "tts-1", "input": long, "voice": "tiny_0", "response_format": "pcm", "stream_format": "sse", "speed": 0.25}
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=300) as streaming:
        lines = streaming.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["type"] == "speech.audio.delta"
        assert metric(url, "kokoro_queue_depth") > 0  # more of this stream is still to be synthesized
        process.send_signal(signal.SIGKILL)
        events = []
        with pytest.raises(httpx.RemoteProtocolError):  # the chunked body ends without its last chunk
            events.extend(json.loads(line[6:])["type"] for line in lines if line.startswith("data: "))
    assert "speech.audio.done" not in events  # and an SSE client sees no done event
    process.wait(30)
    port = int(url.rsplit(":", 1)[1])
    again = start(tiny_artifact, port, log)  # the same port, at once
    try:
        response = httpx.post(f"{url}/v1/audio/speech", json={**body, "stream_format": "audio"}, timeout=300)
        assert response.status_code == 200 and len(response.content) > 24_000
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0
