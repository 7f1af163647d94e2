"""Disconnects under load: clients that hang up at random points mid-stream, for `--minutes`.

    .venv/bin/python benchmarks/disconnect_soak.py --artifact artifacts/int8-mixed --minutes 10
    .venv/bin/python benchmarks/disconnect_soak.py --artifact artifacts/int8-mixed --windowed --minutes 10

A `kokoro-opt serve` on a free loopback port takes `--clients` streaming clients (4: the load the
server is sized for) that loop over long, odd and ordinary requests (paragraphs, several paragraphs,
speeds 0.25 to 4, blends, SSE, wav/mp3/pcm, and a normalization bomb that must get 413). Each request
is hung up at a random byte with probability `--hangup`; the others are read to the end and must be
complete (status 200, or 413 for the bomb; a 429 is retried after its Retry-After, as a client would).

Printed every `--every` seconds and as a table at the end: requests, disconnects, errors of the
clients that stayed, 429s, the server's RSS and peak RSS. At the end, how long the server took from a
cancellation to its worker being free of that request (`kokoro_cancel_release_seconds`, p50/p99/max
as histogram bucket bounds) against its mean job or window (synthesis seconds / jobs). Bounded:
`--minutes` and `--max-requests`, loopback only; the server is stopped (SIGTERM, drained) at the end.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table
from soak import soak_args, soak_parser  # beside this script

from kokoro_opt.serve.bench import PARAGRAPH, PHRASES
from kokoro_opt.serve.spawn import spawned_server
from kokoro_opt.tables import print_table

BOMB = "1234567890" * 400  # 4,000 characters, 21,000 phoneme tokens after normalization: 413
PLAIN = {"input": PARAGRAPH, "response_format": "pcm"}  # the load the bound is measured with
KINDS: list[dict[str, Any]] = [
    PLAIN,
    {"input": " ".join([PARAGRAPH] * 2), "response_format": "pcm", "speed": 0.5},  # long and slow
    {"input": PARAGRAPH, "response_format": "mp3", "speed": 4.0, "voice": "alloy(2)+echo(0.5)"},
    {"input": PHRASES[1], "response_format": "wav", "speed": 0.25},
    {"input": PARAGRAPH, "response_format": "pcm", "stream_format": "sse"},
    {"input": PHRASES[0], "response_format": "wav"},
    {"input": "Café 😀 — naïve “quotes”, 3.5 km/h at 10:30 pm on March 3, 2024 (#42).", "response_format": "opus"},
    {"input": BOMB, "response_format": "pcm"},
]


@dataclass
class Counts:
    requests: int = 0
    disconnects: int = 0
    completed: int = 0
    refused: int = 0  # 413 for the bomb: expected
    retried: int = 0  # 429, retried after Retry-After
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **changes: int) -> None:
        with self.lock:
            for name, by in changes.items():
                setattr(self, name, getattr(self, name) + by)


def scrape(url: str) -> dict[str, Any]:
    """Every sample of /metrics by name (summed over labels), and the cancel-release histogram's buckets."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values: dict[str, Any] = {}
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
            if s.name == "kokoro_cancel_release_seconds_bucket":
                buckets[float(s.labels["le"])] = s.value
    values["release_buckets"] = sorted(buckets.items())
    return values


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket holding quantile `q` (inf past the last finite bound); nan when empty."""
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return float("nan")
    return next(bound for bound, count in buckets if count >= q * total)


def one_request(client: httpx.Client, kind: dict[str, Any], hangup_at: int | None, counts: Counts, stop: threading.Event) -> None:
    body = {"model": "tts-1", "voice": "alloy", **kind}
    for _ in range(20):  # 429: retried after Retry-After, as a client would
        counts.add(requests=1)
        with client.stream("POST", "/v1/audio/speech", json=body, headers={"Cache-Control": "no-store"}) as response:
            if response.status_code == 429:
                counts.add(retried=1)
                time.sleep(min(2.0, float(response.headers.get("retry-after", "1"))))
                continue
            expected = 413 if kind["input"] is BOMB else 200
            if response.status_code != expected:
                counts.errors.append(f"{response.status_code} {response.read()[:200]!r}")
                return
            if expected == 413:
                counts.add(refused=1)
                return
            received, tail = 0, b""
            try:
                for chunk in response.iter_raw():
                    received += len(chunk)
                    tail = (tail + chunk)[-300:]
                    if (hangup_at is not None and received >= hangup_at) or stop.is_set():
                        counts.add(disconnects=1)
                        return  # leaving the block closes the connection mid-stream
            except httpx.HTTPError as exc:  # a stream cut short: the server failed a client that stayed
                counts.errors.append(f"incomplete after {received} bytes: {exc!r}")
                return
            if kind.get("stream_format") == "sse" and b'"speech.audio.done"' not in tail:
                counts.errors.append("SSE without speech.audio.done")
                return
            counts.add(completed=1)
            return
    counts.errors.append("429 twenty times in a row")


def client_loop(url: str, seed: int, hangup: float, stop: threading.Event, counts: Counts, max_requests: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop.is_set() and counts.requests < max_requests:
            kind = rng.choice(KINDS)
            hangup_at = rng.randint(1, 400_000) if rng.random() < hangup else None  # up to ~4 s of pcm audio
            try:
                one_request(client, kind, hangup_at, counts, stop)
            except httpx.HTTPError as exc:
                counts.errors.append(f"{type(exc).__name__}: {exc}")


def baseline(url: str, clients: int) -> None:
    """Two rounds of `clients` plain streams (the paragraph at speed 1), together: the load whose peak RSS
    is the bound for the soak."""
    counts, never = Counts(), threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=1200) as c:
            for _ in range(2):
                one_request(c, PLAIN, None, counts, never)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if counts.errors:
        raise SystemExit(f"the plain load failed: {counts.errors[:3]}")


def main() -> None:
    parser = soak_parser(__doc__, minutes=10.0)
    parser.add_argument("--hangup", type=float, default=0.5, help="share of requests hung up mid-stream")
    parser.add_argument("--max-requests", type=int, default=20_000, help="a bound on the requests sent in all")
    parser.add_argument("--seed", type=int, default=1)
    args, serve = soak_args(parser)
    console = Console(width=140)
    counts, stop = Counts(), threading.Event()
    # --timeout: on a busy machine a slow stream shared four ways can take longer than the default 300 s
    serve += ["--audio-cache-mb", "0", "--timeout", "1800"]
    samples: list[dict[str, float]] = []
    with spawned_server(serve) as url:
        warm = scrape(url)["kokoro_process_peak_rss_bytes"] / 1e6
        baseline(url, args.clients)
        bound = scrape(url)["kokoro_process_peak_rss_bytes"] / 1e6
        console.print(
            f"peak RSS warm {warm:.0f} MB; after {2 * args.clients} plain streams, {args.clients} at a time: {bound:.0f} MB"
        )
        started = time.monotonic()

        def sample() -> None:
            m = scrape(url)
            row = {"minute": round((time.monotonic() - started) / 60, 1), "requests": counts.requests,
                   "disconnects": counts.disconnects, "completed": counts.completed, "errors": len(counts.errors),
                   "retried_429": counts.retried, "rss_mb": m["kokoro_process_rss_bytes"] / 1e6,
                   "peak_rss_mb": m["kokoro_process_peak_rss_bytes"] / 1e6}  # fmt: skip
            samples.append(row)
            console.print("  ".join(f"{k} {v:.0f}" if k.endswith("_mb") else f"{k} {v}" for k, v in row.items()))

        sample()
        loops = [(url, args.seed + k, args.hangup, stop, counts, args.max_requests) for k in range(args.clients)]
        threads = [threading.Thread(target=client_loop, args=loop, daemon=True) for loop in loops]
        for t in threads:
            t.start()
        deadline = started + 60 * args.minutes
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            time.sleep(max(0.0, min(args.every, deadline - time.monotonic())))
            sample()
        stop.set()
        for t in threads:
            t.join()
        settled = time.monotonic()
        while scrape(url)["kokoro_active_requests"] > 0 and time.monotonic() - settled < 60:
            time.sleep(0.2)
        final = scrape(url)
        sample()
    jobs = final.get("kokoro_jobs_total", 0.0)
    mean_job = final.get("kokoro_synthesis_seconds_total", 0.0) / jobs if jobs else float("nan")
    buckets = final["release_buckets"]
    release = {q: bucket_quantile(buckets, q) for q in (0.5, 0.99, 1.0)}
    mode = (", windowed" if args.windowed else "") + (f", {args.workers} workers" if args.workers != 1 else "")
    table = Table(title=f"disconnect soak: {args.artifact}{mode}, {args.clients} clients, {args.minutes:g} min")
    columns = ("minute", "requests", "disconnects", "completed", "errors", "retried_429", "rss_mb", "peak_rss_mb")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for s in samples:
        table.add_row(*(f"{s[c]:.1f}" if c == "minute" else f"{s[c]:.0f}" for c in columns))
    print_table(console, table)
    cancelled = final.get("kokoro_cancelled_total", 0.0)
    console.print(f"{counts.requests} requests, {counts.disconnects} disconnects, {counts.completed} complete, "
                  f"{counts.refused} bombs refused (413), {counts.retried} 429s retried, {len(counts.errors)} errors; "
                  f"server: {cancelled:.0f} cancelled, {jobs:.0f} jobs, mean job {1000 * mean_job:.0f} ms; "
                  f"cancel to worker free: p50 <= {1000 * release[0.5]:.0f} ms, p99 <= {1000 * release[0.99]:.0f} ms, "
                  f"max <= {1000 * release[1.0]:.0f} ms (bucket bounds)")  # fmt: skip
    if counts.errors:
        console.print("errors:", counts.errors[:5])
    after = [s["rss_mb"] for s in samples if s["minute"] >= 2]
    if len(after) >= 2:
        console.print(f"RSS from minute 2 on: {min(after):.0f}-{max(after):.0f} MB")
    peak = samples[-1]["peak_rss_mb"]
    console.print(f"peak RSS {peak:.0f} MB: {peak - bound:+.0f} MB ({100 * (peak / bound - 1):+.1f}%) against the "
                  f"{bound:.0f} MB peak of the plain load")  # fmt: skip
    if args.json:
        report = {"samples": samples, "errors": counts.errors, "release_buckets": buckets, "mean_job_s": mean_job,
                  "warm_peak_mb": warm, "bound_mb": bound}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
