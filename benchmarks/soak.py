"""Memory over a long soak: a server under four concurrent clients for `--minutes`, its resident
memory sampled from /metrics, printed as a table (and optionally written as JSON).

    .venv/bin/python benchmarks/soak.py --artifact artifacts/int8-mixed/<id> --minutes 30 [--windowed [--workers 2]]

The four clients loop over a mix a real deployment sees: the bench paragraph streamed as pcm, short
phrases as wav, mp3 and opus, a voice blend, SSE, and an empty input (the error path). A flat
curve after the first minutes (warm-up fills ONNX Runtime's arena to the largest job) is the aim;
growth that keeps going is a leak.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kokoro_opt.errors import UserError
from kokoro_opt.serve import ServeConfig
from kokoro_opt.serve.bench import PARAGRAPH, PHRASES
from kokoro_opt.serve.spawn import spawned_server
from kokoro_opt.tables import print_table

MIX = [
    {"input": PARAGRAPH, "response_format": "pcm", "stream": True},
    {"input": PHRASES[0], "response_format": "wav", "stream": False},
    {"input": PHRASES[1], "response_format": "mp3", "stream": True},
    {"input": PHRASES[2], "response_format": "opus", "stream": True, "voice": "jf_alpha(1)+jf_nezumi(1)"},
    {"input": PHRASES[3], "response_format": "pcm", "stream": True, "stream_format": "sse"},
    {"input": "", "response_format": "pcm", "stream": True},  # 400: the error path
]


def rss_mb(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("kokoro_process_rss_bytes", "kokoro_process_peak_rss_bytes"):
            found[name] = float(value) / 1e6
    return found.get("kokoro_process_rss_bytes", float("nan")), found.get("kokoro_process_peak_rss_bytes", float("nan"))


def soak_parser(doc: str | None, minutes: float) -> argparse.ArgumentParser:
    """The options every soak shares: the artifact and how it is served, how long, how many clients."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--artifact", default="best")
    parser.add_argument("--artifacts", default="artifacts")
    parser.add_argument("--minutes", type=float, default=minutes)
    parser.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--windowed", action="store_true", help="serve with --windowed (an artifact with the windows stage)")
    parser.add_argument("--workers", type=int, default=1, help="serve with --workers (2 needs --windowed)")
    return parser


def soak_args(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The parsed options, checked by the server's own rules before one is started, and its `serve` options."""
    args = parser.parse_args()
    try:
        ServeConfig(windowed=args.windowed, workers=args.workers)
    except UserError as exc:
        parser.error(str(exc))
    serve = ["--artifact", args.artifact, "--artifacts", args.artifacts, "--max-queue", str(args.clients)]
    serve += ["--windowed"] * args.windowed + ["--workers", str(args.workers)] * (args.workers != 1)
    return args, serve


def main() -> None:
    args, serve = soak_args(soak_parser(__doc__, minutes=30.0))
    console = Console(width=120)
    counts = {"requests": 0, "ok": 0, "rejected": 0, "unexpected": 0}
    lock, stop = threading.Lock(), threading.Event()

    def client(url: str, offset: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            i = offset
            while not stop.is_set():
                kind = MIX[i % len(MIX)]
                i += 1
                # the paragraph is always synthesized; repeated phrases come from the audio cache, as they would
                fresh = {"Cache-Control": "no-cache"} if kind["input"] == PARAGRAPH else {}
                body = {"model": "tts-1", "voice": "alloy", **kind}
                status = c.post("/v1/audio/speech", json=body, headers=fresh).status_code
                expected = 400 if not kind["input"] else 200
                with lock:
                    counts["requests"] += 1
                    counts["ok"] += status == expected
                    counts["rejected"] += status == 429
                    counts["unexpected"] += status not in (expected, 429)

    samples: list[dict[str, float]] = []
    with spawned_server(serve) as url:
        started = time.monotonic()
        rss, peak = rss_mb(url)
        samples.append({"minute": 0.0, "rss_mb": rss, "peak_rss_mb": peak, "requests": 0})
        console.print(f"warm server: RSS {rss:.0f} MB; soaking {args.minutes:g} min with {args.clients} clients")
        workers = [threading.Thread(target=client, args=(url, k), daemon=True) for k in range(args.clients)]
        for w in workers:
            w.start()
        while time.monotonic() - started < 60 * args.minutes:
            time.sleep(min(args.every, max(0.0, 60 * args.minutes - (time.monotonic() - started))))
            rss, peak = rss_mb(url)
            minute = (time.monotonic() - started) / 60
            samples.append({"minute": round(minute, 1), "rss_mb": rss, "peak_rss_mb": peak, "requests": counts["requests"]})
            console.print(f"{minute:5.1f} min  RSS {rss:.0f} MB  peak {peak:.0f} MB  {counts['requests']} requests")
        stop.set()
        for w in workers:
            w.join()
    mode = (", windowed" if args.windowed else "") + (f", {args.workers} workers" if args.workers != 1 else "")
    table = Table(title=f"soak: {args.artifact}{mode}, {args.clients} clients, {args.minutes:g} min")
    for column in ("minute", "RSS MB", "peak MB", "requests"):
        table.add_column(column, justify="right")
    for s in samples:
        table.add_row(f"{s['minute']:.1f}", f"{s['rss_mb']:.0f}", f"{s['peak_rss_mb']:.0f}", str(s["requests"]))
    print_table(console, table)
    after_warm = [s["rss_mb"] for s in samples if s["minute"] >= 5]
    if after_warm:
        console.print(f"RSS from minute 5 on: {min(after_warm):.0f}-{max(after_warm):.0f} MB "
                      f"(growth {100 * (after_warm[-1] / after_warm[0] - 1):+.1f}%); requests {counts}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "counts": counts}, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
