"""Repeats answered from the audio cache: the store on its own, then a real server with its default cache."""

from __future__ import annotations

import httpx
import pytest

from kokoro_opt.serve.cache import AudioCache, CacheKey, entry_bytes
from tests.serve_helpers import metric

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

PHRASE = "Checkbox checked."


def key(text: str, fmt: str = "pcm") -> CacheKey:
    return CacheKey(text, "alloy", 1.0, fmt, True)


def test_the_store_keeps_recent_bodies_within_its_bytes() -> None:
    one = entry_bytes(key("a"), b"a" * 100)  # a body, and the text of its key
    cache = AudioCache(max_bytes=16 * one)  # entries of up to `one` bytes are kept
    for text in "abcdefghijklmnop":
        cache.put(key(text), text.encode() * 100)
    assert len(cache) == 16 and cache.size == 16 * one
    assert cache.get(key("a")) == b"a" * 100  # used: now the most recent
    cache.put(key("q"), b"q" * 100)
    assert cache.get(key("b")) is None and cache.get(key("a")) is not None  # the least recently used went
    assert cache.size == 16 * one
    cache.put(key("a"), b"A" * 50)  # a new body for a key replaces the old one
    assert cache.get(key("a")) == b"A" * 50 and cache.size == 16 * one - 50
    cache.put(key("long"), b"x" * 101)  # larger than a sixteenth: not kept
    cache.put(key("empty"), b"")
    assert cache.get(key("long")) is None and cache.get(key("empty")) is None
    assert cache.get(key("a", fmt="wav")) is None  # another format is another response


def test_long_keys_count_against_the_store_s_bytes() -> None:
    """A key is the request's text: 4,096 characters outside the BMP hold 16 KB in Python beside a small body."""
    cache = AudioCache(max_bytes=1 << 20)
    for i in range(1000):
        cache.put(key(chr(0xF0000 + i) + "\U000f0000" * 4095), b"x" * 10)
    assert cache.size <= 1 << 20 and len(cache) < 70


@pytest.fixture(scope="module")
def cached_url(tiny_artifact):
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig, running

    config = ServeConfig(max_queue=4, first_chunk_tokens=20, chunk_tokens=120)  # the default cache
    assert config.audio_cache_mb > 0
    with running(resolve_artifact(str(tiny_artifact.path)), config) as base:
        yield base


def speak(url: str, headers: dict[str, str] | None = None, **fields: object) -> httpx.Response:
    body = {"model": "tts-1", "voice": "alloy", "input": PHRASE, "response_format": "pcm", **fields}
    return httpx.post(f"{url}/v1/audio/speech", json=body, headers=headers or {}, timeout=120)


def test_a_repeat_is_answered_without_synthesis(cached_url: str) -> None:
    first = speak(cached_url, stream=True)
    assert first.status_code == 200 and len(first.content) > 1000
    jobs, hits = metric(cached_url, "kokoro_jobs_total"), metric(cached_url, "kokoro_cache_hits_total")
    again = speak(cached_url, stream=True)
    assert again.status_code == 200 and again.content == first.content
    assert metric(cached_url, "kokoro_jobs_total") == jobs  # the worker did nothing
    assert metric(cached_url, "kokoro_cache_hits_total") == hits + 1
    whole = speak(cached_url, stream=False, response_format="wav")  # another response: synthesized, then kept
    assert whole.content[:4] == b"RIFF" and metric(cached_url, "kokoro_jobs_total") > jobs
    assert speak(cached_url, stream=False, response_format="wav").content == whole.content
    assert metric(cached_url, "kokoro_cache_hits_total") == hits + 2


def test_what_changes_the_audio_misses_and_no_cache_synthesizes(cached_url: str) -> None:
    speak(cached_url, stream=True)
    hits = metric(cached_url, "kokoro_cache_hits_total")
    for fields in ({"speed": 1.5}, {"voice": "tiny_1"}, {"input": "Checkbox unchecked."}, {"stream_format": "sse"}):
        jobs = metric(cached_url, "kokoro_jobs_total")
        assert speak(cached_url, stream=True, **fields).status_code == 200
        assert metric(cached_url, "kokoro_jobs_total") > jobs, fields
    jobs = metric(cached_url, "kokoro_jobs_total")
    fresh = speak(cached_url, headers={"Cache-Control": "no-cache"}, stream=True)  # what bench-serve sends
    assert fresh.status_code == 200 and metric(cached_url, "kokoro_jobs_total") > jobs
    assert speak(cached_url, stream_format="sse").status_code == 200  # events are never stored
    assert metric(cached_url, "kokoro_cache_hits_total") == hits
    private = {"input": "Password field.", "stream": True}
    assert speak(cached_url, headers={"Cache-Control": "no-store"}, **private).status_code == 200  # not kept
    jobs = metric(cached_url, "kokoro_jobs_total")
    assert speak(cached_url, **private).status_code == 200
    assert metric(cached_url, "kokoro_jobs_total") > jobs and metric(cached_url, "kokoro_cache_hits_total") == hits
    jobs = metric(cached_url, "kokoro_jobs_total")  # now it is kept: no-store is still not answered from it
    assert speak(cached_url, headers={"Cache-Control": "no-store"}, **private).status_code == 200
    assert metric(cached_url, "kokoro_jobs_total") > jobs and metric(cached_url, "kokoro_cache_hits_total") == hits


def test_the_cache_can_be_turned_off(url: str) -> None:
    """The shared test server runs with audio_cache_mb=0: every repeat is synthesized."""
    speak(url, stream=True)
    jobs = metric(url, "kokoro_jobs_total")
    assert speak(url, stream=True).status_code == 200
    assert metric(url, "kokoro_jobs_total") > jobs and metric(url, "kokoro_cache_hits_total") == 0
