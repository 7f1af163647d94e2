"""One bench-serve scenario: concurrent clients sending the same request, and what each response gave.

Per request it records when every piece of the body arrived, which gives time to first audio (TTFA),
the full-response time, RTF (response time / audio seconds), the largest gap between pieces, and
*lag*: a player that starts at the first audio byte and plays in real time needs `t * bytes_per_second`
bytes by time t; lag is the worst shortfall in seconds. Lag above a 20 ms tolerance is an underrun.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import numpy as np

UNDERRUN_TOLERANCE = 0.02  # seconds: scheduling jitter of the reading client, not a real stall
_WAV_HEADER = 44


@dataclass
class Sample:
    status: int
    ttfa: float = float("nan")
    total: float = float("nan")
    audio_s: float = 0.0
    max_gap: float = 0.0
    lag: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def playback(arrivals: list[tuple[float, int]], bytes_per_second: float, skip: int = 0) -> tuple[float, float, float]:
    """(audio seconds, largest gap between pieces, worst lag behind real-time playback from the first audio byte:
    a piece that is all header, `skip` bytes, starts nothing)."""
    heard = _audio_arrivals(arrivals, skip)
    if not heard:
        return 0.0, 0.0, 0.0
    received = sum(n for _, n in arrivals[: len(arrivals) - len(heard)]) - skip  # header bytes still to come: <= 0
    t0 = previous = heard[0][0]
    lag = gap = 0.0
    for t, n in heard:
        lag = max(lag, (t - t0) - max(received, 0) / bytes_per_second)  # before this piece arrives
        gap = max(gap, t - previous)
        previous = t
        received += n
    return max(received, 0) / bytes_per_second, gap, max(lag, 0.0)


def _audio_arrivals(arrivals: list[tuple[float, int]], skip: int) -> list[tuple[float, int]]:
    """The pieces from the first one that carries audio (past `skip` header bytes) on."""
    received = 0
    for i, (_, n) in enumerate(arrivals):
        received += n
        if received > skip:
            return arrivals[i:]
    return []


async def timed_request(client: httpx.AsyncClient, payload: dict[str, Any], sample_rate: int) -> Sample:
    """One request to /v1/audio/speech, timed piece by piece (`playback`)."""
    started = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    try:
        async with client.stream("POST", "/v1/audio/speech", json=payload) as response:
            if response.status_code != 200:
                body = await response.aread()
                try:
                    message = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = body[:200].decode(errors="replace")
                return Sample(response.status_code, error=message)
            async for piece in response.aiter_raw():
                arrivals.append((time.perf_counter(), len(piece)))
    except httpx.HTTPError as exc:
        return Sample(0, error=f"{type(exc).__name__}: {exc}")
    skip = _WAV_HEADER if payload["response_format"] == "wav" else 0
    if not (heard := _audio_arrivals(arrivals, skip)):
        return Sample(200, error="no audio in the body")
    audio_s, gap, lag = playback(arrivals, 2.0 * sample_rate, skip)
    return Sample(200, heard[0][0] - started, arrivals[-1][0] - started, audio_s, gap, lag)


@dataclass
class Scenario:
    mode: Literal["stream", "full", "repeat"]  # streamed, one response, or the same request again (the audio cache)
    clients: int
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    text: str = ""  # set for a short-phrase scenario
    rss_mb: float = float("nan")  # the server's resident memory after the scenario, and its peak so far
    peak_rss_mb: float = float("nan")
    client_delay: float = 0.0  # seconds: how late this client's own event loop woke up at worst (a busy machine)

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.ok]
        messages = {f"HTTP {s.status}: {s.error}" if s.status else s.error for s in self.samples if s.error}

        def pct(values: list[float], q: float) -> float:
            return float(np.percentile(values, q)) if values else float("nan")

        ttfa, total = [s.ttfa for s in ok], [s.total for s in ok]
        return {
            "mode": self.mode,
            "clients": self.clients,
            "requests": len(self.samples),
            "ok": len(ok),
            "rejected_429": sum(s.status == 429 for s in self.samples),
            "errors": sum(not s.ok and s.status != 429 for s in self.samples),
            "ttfa_p50": pct(ttfa, 50),
            "ttfa_p95": pct(ttfa, 95),
            "total_p50": pct(total, 50),
            "total_p95": pct(total, 95),
            "rtf_p50": pct([s.total / s.audio_s for s in ok if s.audio_s > 0], 50),
            "audio_s": pct([s.audio_s for s in ok], 50),
            "max_gap": max((s.max_gap for s in ok), default=float("nan")),
            "worst_lag": max((s.lag for s in ok), default=float("nan")),
            "underruns": sum(s.lag > UNDERRUN_TOLERANCE for s in ok) if self.mode == "stream" else 0,
            "error_messages": sorted(messages)[:3],
            "text": self.text,
            "rss_mb": self.rss_mb,
            "peak_rss_mb": self.peak_rss_mb,
            "client_delay": self.client_delay,
        }


async def run_scenario(
    url: str, mode: str, clients: int, requests: int, payload: dict[str, Any], sample_rate: int, api_key: str | None
) -> Scenario:
    """`mode` "stream" or "full" measures synthesis (`Cache-Control: no-cache`: never the server's audio
    cache); "repeat" streams what was just asked, as a client repeating a phrase would. Each of the `requests`
    rounds starts every client's request together, as listeners pressing play at once, over connections opened
    before the first."""
    scenario = Scenario(mode, clients)
    body = {**payload, "stream": mode != "full"}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if mode != "repeat":
        headers["Cache-Control"] = "no-cache"
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:
        await asyncio.gather(*(client.get("/ready") for _ in range(clients)))  # a connection each: none opens in a round
        together = asyncio.Barrier(clients)

        async def one_client() -> None:
            for _ in range(requests):
                await together.wait()
                scenario.samples.append(await timed_request(client, body, sample_rate))

        watch = asyncio.create_task(_watch_delay(scenario))
        started = time.perf_counter()
        try:
            await asyncio.gather(*(one_client() for _ in range(clients)))
        finally:
            watch.cancel()
        scenario.wall = time.perf_counter() - started
        scenario.rss_mb, scenario.peak_rss_mb = await _server_rss(client)
    return scenario


async def _watch_delay(scenario: Scenario, tick: float = 0.005) -> None:
    """Keep the worst lateness of this process's event loop: every time it reads is late by as much."""
    while True:
        began = time.perf_counter()
        await asyncio.sleep(tick)
        scenario.client_delay = max(scenario.client_delay, time.perf_counter() - began - tick)


async def _server_rss(client: httpx.AsyncClient) -> tuple[float, float]:
    """(current, peak) resident memory of the server in MB from its /metrics; NaN if it does not say."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {"kokoro_process_rss_bytes": math.nan, "kokoro_process_peak_rss_bytes": math.nan}
    try:
        text = (await client.get("/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name] = sample.value / 1e6
    except (httpx.HTTPError, ValueError):
        pass
    return found["kokoro_process_rss_bytes"], found["kokoro_process_peak_rss_bytes"]
