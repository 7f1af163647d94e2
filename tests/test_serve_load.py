"""Load and faults on a real server: admission (429), disconnects, timeouts, auth, and a memory soak."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable

import httpx
import psutil
import pytest
from rich.console import Console

from kokoro_opt.select import resolve_artifact
from kokoro_opt.serve import ServeConfig, bench, running
from kokoro_opt.serve.app import create_app
from kokoro_opt.serve.server import ServerThread, wait_ready
from tests import needs
from tests.serve_helpers import held_after_first_job, held_before_first_job, metric

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

SHORT = "Hello there, how are you?"
LONG = " ".join(f"This is sentence number {n}, which goes on for a little while." for n in range(1, 13))


def wait_for(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    started = time.perf_counter()
    while not condition():
        assert time.perf_counter() - started < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.perf_counter() - started


def idle(url: str) -> bool:
    return all(metric(url, m) == 0 for m in ("kokoro_active_requests", "kokoro_queue_depth", "kokoro_worker_busy"))


def body(text: str, **extra: object) -> dict[str, object]:
    return {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm", **extra}


def assert_nothing_left_running(url: str) -> None:
    """A cancelled request's work is gone, by order rather than by waiting: a one-job request sent now is served,
    and it is the only job run meanwhile (what a cancelled request left queued would be due first)."""
    jobs = metric(url, "kokoro_jobs_total")
    assert httpx.post(f"{url}/v1/audio/speech", json=body("Hi.", stream=False), timeout=120).status_code == 200
    assert metric(url, "kokoro_jobs_total") == jobs + 1 and idle(url)


def test_four_concurrent_streams_without_errors(url: str) -> None:
    results: list[tuple[int, int]] = []

    def client() -> None:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body(SHORT), timeout=120) as r:
            results.append((r.status_code, len(r.read())))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(status == 200 and size > 10_000 for status, size in results)


def test_beyond_the_queue_limit_gets_429(url: str) -> None:
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as stack:
        held = [stack.enter_context(client.stream("POST", f"{url}/v1/audio/speech", json=body(LONG))) for _ in range(4)]
        assert all(r.status_code == 200 for r in held)
        for extra in range(2):  # the 5th and the 6th
            rejected = client.post(f"{url}/v1/audio/speech", json=body(SHORT))
            assert rejected.status_code == 429
            assert int(rejected.headers["retry-after"]) >= 1
            assert rejected.json()["error"]["code"] == "rate_limit_exceeded", extra
            assert "4 of 4 request slots in use (serve --max-queue)" in rejected.json()["error"]["message"]
    wait_for(lambda: idle(url), 10)  # closing the held streams freed every slot
    assert httpx.post(f"{url}/v1/audio/speech", json=body(SHORT), timeout=120).status_code == 200


def test_bench_reports_a_rejection_with_its_scenario_and_status(url: str) -> None:
    out = io.StringIO()
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as stack:
        held = [stack.enter_context(client.stream("POST", f"{url}/v1/audio/speech", json=body(LONG))) for _ in range(4)]
        assert all(r.status_code == 200 for r in held)  # the queue is full while they are held
        scenarios = bench.bench(url, [1], requests=1, full=False)
    wait_for(lambda: idle(url), 10)
    bench.render(scenarios, Console(file=out, width=200), "held")
    rejected = scenarios[0].summary()
    assert rejected["ok"] == 0 and rejected["rejected_429"] == 1
    assert "stream x1: HTTP 429: server busy" in out.getvalue()


def test_disconnect_mid_stream_frees_the_worker_within_one_chunk(served) -> None:
    url, engine = served
    cancelled, dropped = metric(url, "kokoro_cancelled_total"), metric(url, "kokoro_dropped_pieces_total")
    with held_after_first_job(engine):  # the client leaves mid-stream, however fast the model is
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body(LONG), timeout=120) as r:
            assert r.status_code == 200
            pieces = r.iter_raw()  # kept: a dropped iterator closes the connection already
            next(pieces)
            assert metric(url, "kokoro_queue_depth") > 0
            jobs = metric(url, "kokoro_jobs_total")
        wait_for(lambda: metric(url, "kokoro_cancelled_total") == cancelled + 1, 60)
    wait_for(lambda: idle(url), 60)
    assert metric(url, "kokoro_jobs_total") == jobs  # freed after the job it held: no other piece of LONG ran
    assert metric(url, "kokoro_cancelled_total") == cancelled + 1
    assert metric(url, "kokoro_dropped_pieces_total") > dropped
    assert_nothing_left_running(url)


def test_disconnect_without_streaming_stops_generation(served) -> None:
    url, engine = served
    cancelled, dropped = metric(url, "kokoro_cancelled_total"), metric(url, "kokoro_dropped_pieces_total")
    with held_after_first_job(engine):  # the response cannot be complete when the client gives up, however fast
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/audio/speech", json=body(LONG, stream=False), timeout=1.0)
        wait_for(lambda: metric(url, "kokoro_cancelled_total") == cancelled + 1, 30)
    wait_for(lambda: idle(url), 30)
    assert metric(url, "kokoro_cancelled_total") == cancelled + 1
    assert metric(url, "kokoro_dropped_pieces_total") > dropped  # the rest of LONG was never synthesized


def test_a_stream_left_before_its_first_audio_gives_its_place_back(served) -> None:
    """A stream's headers wait for its first audio; a client that leaves before it is noticed then, not when the
    first audio (or the timeout) comes: its slot and its synthesis go at once."""
    url, engine = served
    cancelled = metric(url, "kokoro_cancelled_total")
    with held_before_first_job(engine):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/audio/speech", json=body(LONG), timeout=1.0)
        wait_for(lambda: metric(url, "kokoro_cancelled_total") == cancelled + 1, 30)  # the worker still held
        assert metric(url, "kokoro_active_requests") == 0  # its queue slot given back
    wait_for(lambda: idle(url), 30)


def test_soak_keeps_memory_flat(url: str) -> None:
    """200 requests of every kind: RSS grows less than 25 MB after warm-up (0.9 MB measured). In MB, not as a share:
    the server shares this process with what earlier tests imported (0.9-2 GB), and a share of that hid leaks."""
    kinds = [
        body("Hi.", speed=2.0),
        body("Hello there.", response_format="mp3", speed=2.0),
        body("Okay, fine.", response_format="wav", stream=False, speed=2.0),
        body("Yes.", response_format="opus", voice="tiny_0(1)+tiny_1(1)", speed=2.0),
        body("Right.", stream_format="sse", speed=2.0),
        body("", speed=2.0),  # an error path too
    ]
    errors: list[str] = []

    def client(n: int, offset: int) -> None:
        with httpx.Client(timeout=120) as c:
            for i in range(n):
                kind = kinds[(offset + i) % len(kinds)]
                r = c.post(f"{url}/v1/audio/speech", json=kind)
                if r.status_code != (400 if not kind["input"] else 200):
                    errors.append(f"{r.status_code} {r.text[:100]}")

    def burst(total: int) -> None:
        threads = [threading.Thread(target=client, args=(total // 4, k)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    process = psutil.Process()
    burst(40)  # warm-up: every code path, allocator pools filled
    gc.collect()
    baseline = process.memory_info().rss
    burst(200)
    gc.collect()
    wait_for(lambda: idle(url), 10)
    grown_mb = (process.memory_info().rss - baseline) / 1e6
    assert not errors, errors[:3]
    assert grown_mb < 25, f"RSS grew {grown_mb:.1f} MB over 200 requests"


def http10(base: str, path: str, payload: bytes, headers: dict[str, str]) -> bytes:
    """A POST as an HTTP/1.0 client sends it: the answer is whatever arrives until the server closes."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    lines = [f"POST {path} HTTP/1.0", f"Host: {host}", "Content-Type: application/json", f"Content-Length: {len(payload)}"]
    request = "\r\n".join([*lines, *(f"{k}: {v}" for k, v in headers.items()), "", ""]).encode() + payload
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_auth_and_timeout(tiny_artifact) -> None:
    from kokoro_opt.serve import Engine
    from kokoro_opt.serve.metrics import Metrics

    openai = needs.module("openai", "pip install 'kokoro-opt[dev]'")
    config = ServeConfig(api_key="s3cret", request_timeout=5.0, warmup=False, first_chunk_tokens=20, chunk_tokens=120)
    selection = resolve_artifact(str(tiny_artifact.path))
    engine = Engine(selection, config, Metrics())
    with running(selection, config, engine=engine) as base:
        assert httpx.get(f"{base}/health").status_code == 200  # probes need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{base}/v1/audio/speech", json=body(SHORT), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"  # the scheme to use (RFC 6750)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret")
        with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Hi.") as response:
            assert len(response.read()) > 100
        key = {"Authorization": "Bearer s3cret"}
        # the engine held after the first job: the request outlives its timeout however fast the machine is
        with held_after_first_job(engine):
            r = httpx.post(f"{base}/v1/audio/speech", json=body(LONG, stream=False), headers=key, timeout=30)
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        # a stream that cannot finish is cut, never passed off as complete: on HTTP/1.1 without its last chunk, on
        # HTTP/1.0 (nginx's default to upstreams), which ends a body by closing, with a reset
        with (
            held_after_first_job(engine),
            pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)),
            httpx.stream("POST", f"{base}/v1/audio/speech", json=body(LONG), headers=key, timeout=30) as r,
        ):
            r.read()
        with held_after_first_job(engine), pytest.raises(ConnectionResetError):
            http10(base, "/v1/audio/speech", json.dumps(body(LONG)).encode(), key)
        # a stream that fails before its first audio is an error response, not a 200 with nothing in it
        with held_before_first_job(engine):
            r = httpx.post(f"{base}/v1/audio/speech", json=body(SHORT), headers=key, timeout=30)
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        # events say so in an `error` event, of the error body's schema
        from kokoro_opt.serve.openai_compat import ErrorDetail

        with held_after_first_job(engine):
            events = httpx.post(f"{base}/v1/audio/speech", json=body(LONG, stream_format="sse"), headers=key, timeout=30)
        last = json.loads(events.text.strip().split("\n\n")[-1].removeprefix("data: "))
        assert last["type"] == "error" and ErrorDetail.model_validate(last["error"]).code == "timeout"
        assert set(last["error"]) == set(ErrorDetail.model_fields)
        assert httpx.post(f"{base}/v1/audio/speech", json=body("Hi."), headers=key, timeout=30).status_code == 200
        # a stream longer than the timeout (5 s) in all, its audio coming in time, plays to its end: 2 s after each of
        # its first three jobs (of ~20), 3 s of margin for a busy machine's synthesis between them
        step = engine.mode.step

        def slow(stream: object, tokens: list[int], last: bool) -> None:
            step(stream, tokens, last)
            if not last and getattr(stream, "jobs", 0) <= 3:
                time.sleep(2.0)

        engine.mode.step = slow
        try:
            started = time.monotonic()
            with httpx.stream("POST", f"{base}/v1/audio/speech", json=body(LONG), headers=key, timeout=30) as r:
                assert r.status_code == 200 and len(r.read()) > 0
            assert time.monotonic() - started > config.request_timeout  # it did outlast the timeout
        finally:
            engine.mode.step = step
        # with a key, /metrics needs it too
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer s3cre"}).status_code == 401
        assert "kokoro_requests_total" in httpx.get(f"{base}/metrics", headers=key).text
    public = ServeConfig(api_key="s3cret", public_metrics=True, warmup=False)
    with running(resolve_artifact(str(tiny_artifact.path)), public) as base:
        assert httpx.get(f"{base}/metrics").status_code == 200  # --public-metrics: for a scraper without the key
        assert httpx.get(f"{base}/v1/models").status_code == 401


def test_a_stalled_or_abandoned_upload_holds_nothing(tiny_artifact) -> None:
    """Headers and part of a body, then silence: 408 after --body-timeout. Then closed mid-body: no traceback in
    the log. Neither leaves a request open, and the server goes on serving."""
    config = ServeConfig(body_timeout=0.5, warmup=False, first_chunk_tokens=20, chunk_tokens=120, audio_cache_mb=0)
    failures: list[logging.LogRecord] = []
    watcher = logging.Handler(logging.ERROR)
    watcher.emit = failures.append  # type: ignore[method-assign]
    logging.getLogger("uvicorn.error").addHandler(watcher)
    try:
        with running(resolve_artifact(str(tiny_artifact.path)), config) as base:
            address = (httpx.URL(base).host, httpx.URL(base).port)
            head = b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            head += b"Content-Length: 100\r\n\r\n"
            with socket.create_connection(address, timeout=60) as stalled:
                stalled.sendall(head + b'{"input": ')
                answer = ""
                while "request_timeout" not in answer and (part := stalled.recv(65536)):  # the head, then the body
                    answer += part.decode()
            assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer, answer
            with socket.create_connection(address, timeout=60) as gone:
                gone.sendall(head + b'{"input": ')
            deadline = time.monotonic() + 60  # the server notices the close in its own time
            while metric(base, "kokoro_open_requests") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric(base, "kokoro_open_requests") == 0
            assert httpx.post(f"{base}/v1/audio/speech", json=body("Hi."), timeout=60).status_code == 200
    finally:
        logging.getLogger("uvicorn.error").removeHandler(watcher)
    assert not failures, [r.getMessage() for r in failures]


def test_keys_are_compared_whole() -> None:
    from kokoro_opt.serve.service import keys_match

    assert keys_match("s3cret", "s3cret") and keys_match("ключ", "ключ")
    assert not any(keys_match(given, "s3cret") for given in ("s3cre", "s3cret ", "S3cret", "", "s3cret" * 100))


def test_a_client_that_stops_in_its_headers_is_closed(tiny_artifact) -> None:
    """uvicorn's keep-alive timer stops at any byte: half a request's headers held a connection forever. They must
    arrive within the body timeout, as the body must; a request sent in time on the same server is served."""
    config = ServeConfig(body_timeout=1.0, audio_cache_mb=0)
    with running(resolve_artifact(str(tiny_artifact.path)), config) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=120) as stalled:
            stalled.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: app")
            assert stalled.recv(100) == b""  # closed, with no answer to half a request
        assert httpx.post(f"{url}/v1/audio/speech", json=body(SHORT, stream=False), timeout=120).status_code == 200


def test_a_client_that_stops_reading_is_cut_and_gives_its_place_back(tiny_artifact) -> None:
    """Its connection's buffers fill and the server's writes wait: after --timeout without a byte read, the
    connection is cut (what was buffered for it freed) and its queue place is free, where both were held for as
    long as the client kept the socket open. Streamed, and whole (whose place was free once it was synthesized)."""
    config = ServeConfig(max_queue=1, request_timeout=12.0, audio_cache_mb=0)
    cuts: list[logging.LogRecord] = []
    watcher = logging.Handler(logging.WARNING)
    watcher.emit = lambda record: cuts.append(record) if "read nothing" in record.getMessage() else None  # type: ignore[method-assign]
    logging.getLogger("kokoro_opt.serve").addHandler(watcher)
    try:
        with ServerThread(create_app(resolve_artifact(str(tiny_artifact.path)), config)) as server:
            # the connections it accepts take the listener's send buffer: a small one makes the server's writes wait
            # after ~100 KB, whatever the system lets a buffer grow to, so the audio is made long before --timeout
            server.server.servers[0].sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            url = server.url
            wait_ready(url)
            host, port = url.removeprefix("http://").split(":")
            head = "POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            hi = body("Hi.", stream=False)
            for cut, streamed in enumerate((True, False), start=1):
                payload = httpx.Request("POST", "/", json=body(LONG, stream=streamed)).content  # 2.4 MB of audio
                with socket.socket() as deaf:
                    deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small: the server's writes wait soon
                    deaf.connect((host, int(port)))
                    deaf.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)  # never reads
                    wait_for(lambda: len(cuts) >= cut, 120)  # noqa: B023 (called within the iteration)
                    received = b""
                    with contextlib.suppress(ConnectionResetError):
                        while part := deaf.recv(1 << 20):
                            received += part
                answer, _, audio = received.partition(b"\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 200"), answer  # cut, not answered with an error
                if not streamed:
                    length = int(re.search(rb"content-length: (\d+)", answer.lower()).group(1))  # type: ignore[union-attr]
                    assert len(audio) < length
                wait_for(lambda: httpx.post(f"{url}/v1/audio/speech", json=hi, timeout=60).status_code == 200, 120)
    finally:
        logging.getLogger("kokoro_opt.serve").removeHandler(watcher)
