"""The OpenAI-compatible server, end to end: a real uvicorn on a free loopback port, the tiny artifact."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import re
import socket
import struct
import subprocess
import threading

import httpx
import numpy as np
import pytest
import soundfile as sf

from kokoro_opt.voices import OPENAI_VOICES
from tests import needs
from tests.serve_helpers import held_after_first_job, metric

JSON = {"content-type": "application/json"}
pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

LONG = " ".join(f"Sentence number {w} is here, and it keeps going." for w in ("one", "two", "three"))


def speech(url: str, **fields: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", **fields}, timeout=120)


def test_health_ready_models_voices(url: str, tiny_artifact) -> None:
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert httpx.get(f"{url}/ready").json() == {"status": "ready", "artifact": tiny_artifact.id}
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == tiny_artifact.id
    assert {"tts-1", "gpt-4o-mini-tts"} <= {m["id"] for m in models["data"]}
    voices = httpx.get(f"{url}/v1/audio/voices").json()["voices"]
    assert all(set(v) == {"id", "name"} for v in voices)
    assert {"tiny_0", "tiny_1", *OPENAI_VOICES} == {v["id"] for v in voices}
    assert "# TYPE kokoro_ttfa_seconds histogram" in httpx.get(f"{url}/metrics").text


@pytest.mark.parametrize("fmt", ["wav", "pcm", "mp3"])
def test_openai_client_streams(url: str, fmt: str) -> None:
    openai = needs.module("openai", "pip install 'kokoro-opt[dev]'")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="nova", input="Hello there. How are you today?", response_format=fmt
    ) as response:
        pieces = list(response.iter_bytes())
    data = b"".join(pieces)
    if fmt == "wav":
        assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF  # unknown size, as OpenAI
        audio = np.frombuffer(data[44:], dtype="<i2")
    elif fmt == "pcm":
        audio = np.frombuffer(data, dtype="<i2")
    else:
        audio, rate = sf.read(io.BytesIO(data))
        assert rate == 24_000
    assert len(audio) > 24_000 * 0.5 and np.abs(audio).max() > 0


def test_formats_decode(url: str) -> None:
    for fmt in ("opus", "flac", "wav"):
        response = speech(url, input="Hi there.", response_format=fmt, stream=False)
        assert response.status_code == 200, response.text
        audio, rate = sf.read(io.BytesIO(response.content))
        assert rate == 24_000 and len(audio) > 1000
    response = speech(url, input="Hi there.", response_format="wav", stream=False)
    assert struct.unpack("<I", response.content[40:44])[0] == len(response.content) - 44  # exact size without streaming


def test_first_bytes_before_last_chunk(served) -> None:
    """The first bytes reach the client while pieces of the same request still wait to be synthesized: the worker
    is held after the first job, so the response cannot have been made whole before it was sent."""
    url, engine = served
    with held_after_first_job(engine) as release:
        body = {"input": LONG, "response_format": "pcm", "speed": 2}
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=120) as r:
            chunks = r.iter_raw()
            first = next(chunks)
            waiting = metric(url, "kokoro_queue_depth")
            release.set()
            rest = b"".join(chunks)
    assert first and rest
    assert waiting > 0


def test_the_worker_goes_on_once_a_streamed_request_s_first_audio_is_sent(served) -> None:
    """After the unit that made a streamed request's first audio, the worker waits until the server has sent it on (the
    event loop and the client then have the cores), once per request; a whole answer has nothing to wait for. Here
    the worker waits as long as it takes, so what is asserted is the server's signal and the order, not timing."""
    url, engine = served
    order: list[str] = []
    step, let_out = engine.mode.step, engine._let_first_audio_out

    def unit(stream, tokens, last):
        order.append("unit")
        return step(stream, tokens, last)

    def waited(stream):
        if stream.bytes_out and stream.first_sent is not None:  # as the engine decides
            order.append(f"sent: {stream.first_sent.wait(60)}")
        let_out(stream)

    engine.mode.step, engine._let_first_audio_out = unit, waited
    try:
        streamed = speech(url, input=LONG, response_format="pcm", speed=2)
        assert streamed.status_code == 200 and order[:2] == ["unit", "sent: True"], order
        assert order.count("sent: True") == 1 and order.count("unit") > 2
        order.clear()
        whole = speech(url, input=LONG, response_format="pcm", speed=2, stream=False)
        assert whole.status_code == 200 and whole.content and set(order) == {"unit"}, order
    finally:
        engine.mode.step, engine._let_first_audio_out = step, let_out


def test_curl_no_buffer_streams(served) -> None:
    needs.program("curl", "install it (Debian: apt-get install curl)")
    url, engine = served
    body = json.dumps({"input": LONG, "voice": "alloy", "response_format": "pcm", "speed": 2})
    headers = ["-H", "Content-Type: application/json"]
    command = ["curl", "--no-buffer", "-sS", "-X", "POST", f"{url}/v1/audio/speech", *headers, "-d", body]
    with held_after_first_job(engine) as release, subprocess.Popen(command, stdout=subprocess.PIPE) as curl:
        assert curl.stdout is not None
        first = curl.stdout.read1(65536)
        waiting = metric(url, "kokoro_queue_depth")
        release.set()
        rest = curl.stdout.read()
    assert first and rest and waiting > 0


def test_sse_events(url: str) -> None:
    response = speech(url, input=LONG, response_format="pcm", stream_format="sse", speed=2)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] > 0
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) > 24_000


def test_first_chunks_are_served_first(tiny_artifact) -> None:
    """4 streams at once: the worker runs every one's first chunk before any one's second. The streams are all
    queued before the worker takes its second job, so what is asserted is the engine's order, never the
    threads' or the network's timing (ahead of a second chunk, a slow client's first would be luck)."""
    import asyncio

    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.encoders import make_encoder
    from kokoro_opt.serve.engine import Engine

    engine = Engine(resolve_artifact(str(tiny_artifact.path)), ServeConfig(first_chunk_tokens=20, chunk_tokens=120))
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.synth is not None, engine.error
        pack, queued, order, step = engine.synth.packs["tiny_0"], threading.Event(), [], engine.mode.step

        def held_step(stream, tokens, last):  # the engine's own unit of work, recorded in the order it runs
            assert queued.wait(60)
            order.append((stream.id, stream.jobs))
            return step(stream, tokens, last)

        engine.mode.step = held_step

        async def four_streams() -> None:
            encoder = make_encoder("pcm", engine.sample_rate, True)
            streams = [engine.submit(engine.plan(LONG, 2.0), pack, 2.0, encoder, True) for _ in range(4)]
            queued.set()
            for stream in streams:
                while (item := await asyncio.wait_for(stream.queue.get(), 120)) is not None:
                    assert isinstance(item, bytes), item

        asyncio.run(four_streams())
    finally:
        engine.stop()
    jobs = {stream_id: [n for i, n in order if i == stream_id] for stream_id, _ in order}
    assert len(jobs) == 4 and all(len(numbers) > 1 for numbers in jobs.values())  # every stream has a second chunk
    assert [n for _, n in order[:4]] == [0, 0, 0, 0] and len({i for i, _ in order[:4]}) == 4


def test_what_the_server_answers_without_reading_a_body_closes_the_connection(url: str) -> None:
    """A 404, 405 or 401 is sent before the body is read: the connection is closed instead of reading the rest of
    a body announced at any size, sent at any pace (uvicorn would read it all to reuse the connection)."""
    host, port = url.removeprefix("http://").split(":")
    for path in ("/nowhere", "/health", "/v1/audio/speech/"):  # 404, 405, 404 (no redirect naming the client's Host)
        with socket.create_connection((host, int(port)), timeout=60) as client:
            client.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000000000\r\n\r\n{{".encode())
            answer = b""
            while part := client.recv(65536):  # until the server closes the connection
                answer += part
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith((b"http/1.1 404", b"http/1.1 405")) and b"connection: close" in head, answer
        assert b"location" not in head
    for probe in ("/health", "/ready"):  # monitors that probe with HEAD
        assert httpx.head(f"{url}{probe}").status_code == 200
        refused = httpx.post(f"{url}{probe}")
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"


def test_voices_blends_and_openai_names(url: str) -> None:
    for voice in ("tiny_1", "tiny_0(2)+tiny_1(1)", "shimmer", "Echo", "alloy(1)+onyx(1)", {"id": "sage"}, "marin", "cedar"):
        response = speech(url, input="Hi.", voice=voice, response_format="pcm", stream=False)
        assert response.status_code == 200, (voice, response.text)
    a = speech(url, input="Hi.", voice="tiny_0", response_format="pcm", stream=False).content
    b = speech(url, input="Hi.", voice="tiny_1", response_format="pcm", stream=False).content
    assert a != b
    # weights are relative, however large or small: two of 1e299 or of 1e-300 blend like 1 and 1
    even = speech(url, input="Hi.", voice="tiny_0+tiny_1", response_format="pcm", stream=False).content
    for weight in ("1" + "0" * 299, "0." + "0" * 299 + "1"):
        blend = f"tiny_0({weight})+tiny_1({weight})"
        assert speech(url, input="Hi.", voice=blend, response_format="pcm", stream=False).content == even


def requests_with_status(url: str, status: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return sum(
        s.value for f in families for s in f.samples if s.name == "kokoro_requests_total" and s.labels["status"] == str(status)
    )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": "   "}, 400, "input"),
        ({}, 400, "input"),
        ({"input": "Hi.", "voice": "nobody"}, 400, "voice"),
        ({"input": "Hi.", "voice": "alloy(2)+"}, 400, "voice"),
        ({"input": "Hi.", "speed": 10}, 400, "speed"),
        ({"input": "Hi.", "speed": 0.1}, 400, "speed"),
        ({"input": "Hi.", "response_format": "wma"}, 400, "response_format"),
        ({"input": "Hi.", "stream_format": "video"}, 400, "stream_format"),
        ({"input": "x " * 3000}, 400, "input"),
        ({"input": "a" * 1_000_000}, 413, None),  # the body's size: before any field is read
        ({"input": "Hi.", "voice": "tiny_0(" + "9" * 400 + ")"}, 400, "voice"),  # a weight float() makes inf of
        ({"input": "Hi.", "voice": "tiny_0(0)+tiny_1"}, 400, "voice"),  # a weight that changes nothing
        ({"input": "Hi.", "voice": "tiny_0\t"}, 400, "voice"),  # spaces only, as the OpenAPI pattern says
        ({"input": "Hi.", "voice": "alloy\n"}, 400, "voice"),  # nor a final newline, which Python's `$` lets by
        ({"input": "Hi.", "speeed": 0.5}, 400, "speeed"),  # a misspelt argument would change nothing
        ({"input": "Hi.", "response_format": "\ud800"}, 400, "response_format"),  # quoted back, not a 500
        ({"input": "1234567890" * 400}, 413, "input"),  # 4,000 characters, 21,000 phoneme tokens
        ({"input": "Hi.", "speed": "2"}, 400, "speed"),  # types are strict, as the OpenAPI document says
        ({"input": "Hi.", "stream": "yes"}, 400, "stream"),
        ({"input": "Hi.", "\ud800": 1}, 400, None),  # a key that is no text: the body as a whole is named
    ],
)
def test_bad_input_is_an_openai_error_and_server_keeps_serving(url: str, body: dict, status: int, param: str) -> None:
    content = json.dumps(body)  # escaped: a lone surrogate ("\ud800") is valid JSON, though not UTF-8
    counted = requests_with_status(url, status)
    response = httpx.post(f"{url}/v1/audio/speech", content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert requests_with_status(url, status) == counted + 1  # in kokoro_requests_total, refused early or late
    assert speech(url, input="Still here.", response_format="pcm", stream=False).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"voice": "alloy"}, "input", "missing_required_parameter"),
        ({"input": "Hi.", "user": "u1"}, "user", "unknown_parameter"),
        ({"input": "Hi.", "speed": 5}, "speed", "decimal_above_max_value"),
        ({"input": "Hi.", "speed": 0.2}, "speed", "decimal_below_min_value"),
        ({"input": "Hi.", "instructions": "x" * 4097}, "instructions", "string_above_max_length"),
        ({"input": "Hi.", "speed": "2"}, "speed", None),
    ],
)
def test_a_refused_argument_has_openai_s_error_code(url: str, body: dict, param: str, code: str | None) -> None:
    """Clients that switch on `error.code` see OpenAI's codes for what the schema refuses."""
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == (param, code), response.text


def test_a_normalization_bomb_is_refused_before_synthesis(url: str) -> None:
    """4,000 characters under the 4,096 limit that normalize into ~20 minutes of speech: refused with the
    limit and the request's size, before any synthesis, and fast to refuse (normalization is linear)."""
    jobs = metric(url, "kokoro_jobs_total")
    response = httpx.post(f"{url}/v1/audio/speech", json={"input": "1234567890" * 400, "voice": "alloy"}, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "input_too_long" and error["param"] == "input"
    assert re.search(r"input is [\d,]+ phoneme tokens after normalization; the limit is 6,000", error["message"])
    slow = speech(url, input=" ".join(["Sentence number one is here, and it keeps going."] * 40), speed=0.25, stream=False)
    assert slow.status_code == 413 and "at speed 0.25 is the work of" in slow.json()["error"]["message"]
    assert metric(url, "kokoro_jobs_total") == jobs


def test_nothing_to_voice_is_a_short_silence(url: str) -> None:
    for fmt in ("wav", "mp3", "pcm"):
        response = speech(url, input="\u200b|_", response_format=fmt, stream=False)
        assert response.status_code == 200, response.text
        if fmt == "wav":
            audio, rate = sf.read(io.BytesIO(response.content))
            assert rate == 24_000 and len(audio) == 2_400 and not np.any(audio)
    pauses = speech(url, input="… ?!", response_format="wav", stream=False)  # pauses alone: not a breath
    assert not np.any(sf.read(io.BytesIO(pauses.content))[0])
    separators = speech(url, input="\x1c\x1f\x85", response_format="wav", stream=False)  # str.isspace's, not blank
    assert separators.status_code == 200 and not np.any(sf.read(io.BytesIO(separators.content))[0])
    assert speech(url, input="\ufeff\u3000", stream=False).status_code == 400  # blank, as the OpenAPI `input` says
    events = speech(url, input="|", stream_format="sse").text
    assert '"speech.audio.done"' in events


def test_an_endless_body_is_dropped_after_a_bounded_read(url: str) -> None:
    """A body past the limit is read (and dropped) up to 8 MB, so a client still sending sees the 413; past that the
    server stops reading. Here a client announces 1 GB and keeps sending: it is cut off long before 64 MB."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1073741824\r\n\r\n")  # fmt: skip
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            while sent < 64 << 20:  # a server still reading takes it all; one that stopped closes or stops taking it
                sock.sendall(b" " * (1 << 20))
                sent += 1 << 20
    assert sent < 64 << 20
    assert speech(url, input="Still here.", response_format="pcm", stream=False).status_code == 200
    # a client that waits to be asked for its body (`Expect: 100-continue`, curl's way above 1 MB) is never asked
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 999999999\r\nExpect: 100-continue\r\n\r\n")  # fmt: skip
        answer = b""
        while part := sock.recv(65536):
            answer += part
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer, answer[:200]


def test_a_body_nested_past_json_s_recursion_is_a_400(url: str) -> None:
    for body in ('{"input": ' + "[" * 3000 + "]" * 3000 + "}", '{"input": "Hi.", "x": ' + '{"a": ' * 3000 + "1" + "}" * 3001):
        response = httpx.post(f"{url}/v1/audio/speech", content=body.encode(), headers=JSON, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_json" and "nests too deeply" in response.json()["error"]["message"]
    assert speech(url, input="Still here.", response_format="pcm", stream=False).status_code == 200


def test_control_characters_are_spaces_not_the_end_of_the_text(url: str) -> None:
    """espeak stops at NUL: "hello<NUL>world" was spoken as "hello"."""
    spaced = speech(url, input="Hello world, again.", response_format="pcm", stream=False)
    for control in ("\x00", "\x07", "\x1b", "\x7f", "\x85"):
        response = speech(url, input=f"Hello{control}world, again.", response_format="pcm", stream=False)
        assert response.status_code == 200 and len(response.content) == len(spaced.content), repr(control)


def test_malformed_json_and_unknown_route(url: str) -> None:
    post = functools.partial(httpx.post, f"{url}/v1/audio/speech", headers=JSON)
    response = post(content=b'{"input": "hi"')
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = post(content=b"[1, 2]")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = post(content=b'{"input": "Hi \\ud800"}')  # JSON carries a lone surrogate
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    for literal in (b"NaN", b"Infinity"):  # Python's JSON reads them; no speed is either
        response = post(content=b'{"input": "Hi.", "speed": ' + literal + b"}")
        assert response.status_code == 400 and response.json()["error"]["param"] == "speed"
        assert "finite" in response.json()["error"]["message"], response.text
    response = httpx.get(f"{url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"
    assert response.json()["error"]["code"] is None  # as OpenAI answers a path it does not have
    assert speech(url, input="Still here.", response_format="pcm", stream=False).status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_not_sent_as_json_is_refused(url: str, content_type: str | None) -> None:
    """A web page may POST these types to a server on the listener's machine without asking first (a CORS simple
    request); only JSON is read, which a browser sends across origins only after a preflight this server refuses."""
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{url}/v1/audio/speech", content=b'{"input": "Hi.", "voice": "alloy"}', headers=headers)
    error = response.json()["error"]
    assert response.status_code == 415 and error["code"] == "unsupported_media_type", response.text
    assert "application/json" in error["message"] and response.headers["connection"] == "close"
    sent_as_json = httpx.post(f"{url}/v1/audio/speech", content=b'{"input": "Hi.", "stream": false}',
                              headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
    assert sent_as_json.status_code == 200


@pytest.mark.parametrize(
    ("host", "answered"),
    [("attacker.example", False), ("attacker.example:8880", False), ("127.0.0.1.attacker.example", False),
     ("localhost", True), ("localhost:8880", True), ("127.0.0.1:8880", True), ("[::1]:8880", True), ("x.localhost", True),
     ("localhost.:8880", True), (socket.gethostname(), True)],
)  # fmt: skip
def test_on_a_loopback_address_only_requests_for_this_machine_are_answered(url: str, host: str, answered: bool) -> None:
    """A web page whose own domain was re-pointed at 127.0.0.1 (DNS rebinding) is same-origin to the browser, so
    no preflight stops its POSTs; its Host header still names that domain, and it is refused, before its body."""
    response = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "stream": False}, headers={"Host": host})
    if answered:
        assert response.status_code == 200, response.text
    else:
        error = response.json()["error"]
        assert response.status_code == 421 and error["code"] == "invalid_host" and host in error["message"]
        assert response.headers["connection"] == "close"  # its body was not read
        assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 421  # nor what it would read


def test_a_reverse_proxy_s_host_is_answered_when_allowed_and_any_host_off_loopback(tiny_artifact) -> None:
    """A proxy on this machine passing its public name (nginx's `proxy_set_header Host $host`) is answered once
    allowed; on another address than loopback no Host is refused (--allowed-host there is refused instead)."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig, create_app, running
    from kokoro_opt.serve.server import ServerThread

    selection = resolve_artifact(str(tiny_artifact.path))
    config = ServeConfig(warmup=False, allowed_hosts=("tts.example.com",))
    with running(selection, config) as base:
        assert httpx.get(f"{base}/v1/models", headers={"Host": "tts.example.com"}).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={"Host": "TTS.example.com.:443"}).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={"Host": "other.example.com"}).status_code == 421
    with ServerThread(create_app(selection, ServeConfig(warmup=False)), host="0.0.0.0") as server:
        port = server.url.rsplit(":", 1)[1]
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Host": "tts.example.com"}).status_code == 200


def test_long_input_is_not_truncated(url: str) -> None:
    """Text far past one 510-token window: all of it is spoken (audio grows with the text)."""
    sentence = "Sentence number one is here, and it keeps going for a while."
    short = speech(url, input=sentence, response_format="pcm", stream=False, speed=2.0)
    long = speech(url, input=" ".join([sentence] * 12), response_format="pcm", stream=False, speed=2.0)
    assert short.status_code == long.status_code == 200
    assert len(long.content) > 0.9 * 12 * len(short.content)
