"""`kokoro-opt bench-serve`: drive a running server (or one it starts) through scenarios of concurrent clients over
loopback (serve/scenario.py measures one), short phrases alone, or a capacity probe, and report them as tables.
Non-streaming requests (`stream: false`) run side by side so the TTFA gain can be read off directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from kokoro_opt.errors import UserError
from kokoro_opt.serve import capacity
from kokoro_opt.serve.scenario import UNDERRUN_TOLERANCE, Scenario, run_scenario
from kokoro_opt.serve.spawn import spawned_server
from kokoro_opt.tables import print_table

PARAGRAPH = (
    "The old lighthouse keeper climbed the stairs every evening at dusk. "
    "He lit the great lamp, and its beam swept across the dark water. "
    "Ships far out at sea saw the light and steered safely past the rocks. "
    "In the morning, he would climb down again, tired but content."
)
# The screen-reader case: one-to-three-word utterances, spoken thousands of times an hour
PHRASES = ("button", "checkbox checked", "link, Settings", "Close dialog", "Heading level 2", "menu, 5 items")


def _server_info(url: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, timeout=10.0, headers=headers) as client:
        try:
            ready = client.get("/ready")
            if ready.status_code == 404:
                raise UserError(f"{url} has no /ready: it is not a kokoro-opt server's address", "pass its base URL, without /v1")
            if ready.status_code != 200:
                raise UserError(f"the server at {url} is not ready ({ready.status_code})", "wait for /ready, or check its log")
            models = client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise UserError(f"cannot reach a server at {url}: {exc}", "start one with kokoro-opt serve, or omit --url") from None
        if models.status_code != 200:
            raise UserError(f"GET /v1/models answered {models.status_code}", "pass --api-key if the server needs one")
        return dict(models.json()["data"][0])


def bench(
    url: str,
    clients: list[int],
    requests: int = 3,
    text: str = PARAGRAPH,
    voice: str = "alloy",
    response_format: str = "pcm",
    full: bool = True,
    api_key: str | None = None,
    sample_rate: int = 24_000,
) -> list[Scenario]:
    """Non-streaming with one client (the baseline), then streaming with each client count."""
    check_format(response_format)
    payload = {"model": "tts-1", "input": text, "voice": voice, "response_format": response_format}
    plan = ([("full", 1)] if full else []) + [("stream", c) for c in clients]

    async def run_all() -> list[Scenario]:
        await run_scenario(url, "stream", 1, 1, payload, sample_rate, api_key)  # caches warm; not counted
        return [await run_scenario(url, m, c, requests, payload, sample_rate, api_key) for m, c in plan]

    return asyncio.run(run_all())


def bench_phrases(
    url: str, phrases: tuple[str, ...], requests: int, voice: str, api_key: str | None, sample_rate: int = 24_000
) -> list[Scenario]:
    """Each short phrase alone, one client: streaming pcm (first bytes = when playback can start),
    non-streaming wav (when the whole utterance is there), and the pcm stream repeated (the audio cache)."""

    async def run_all() -> list[Scenario]:
        found = []
        for phrase in phrases:
            for mode, fmt in (("stream", "pcm"), ("full", "wav"), ("repeat", "pcm")):
                payload = {"model": "tts-1", "input": phrase, "voice": voice, "response_format": fmt}
                scenario = await run_scenario(url, mode, 1, requests, payload, sample_rate, api_key)
                scenario.text = phrase
                found.append(scenario)
        return found

    return asyncio.run(run_all())


_TIMES = ("ttfa_p50", "ttfa_p95", "total_p50", "total_p95", "rtf_p50", "audio_s", "max_gap", "worst_lag")


def render(scenarios: list[Scenario], console: Console, title: str) -> None:
    """Times in seconds; 'lag' is the worst shortfall behind real-time playback, 'underruns' the streams with one."""
    table = Table(title=title, caption="seconds; full = whole response; lag = worst shortfall behind real-time playback")
    columns = ("mode", "clients", "ok", "429", "err", "TTFA p50", "TTFA p95", "full p50", "full p95",
               "RTF p50", "audio", "gap", "lag", "underruns", "RSS MB")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
    paragraph = [x for x in scenarios if not x.text]
    for scenario in paragraph:
        s = scenario.summary()
        table.add_row(
            s["mode"], str(s["clients"]), f"{s['ok']}/{s['requests']}", str(s["rejected_429"]), str(s["errors"]),
            *(f"{s[k]:.2f}" for k in _TIMES),
            str(s["underruns"]), f"{s['peak_rss_mb']:.0f}",
        )  # fmt: skip
    print_table(console, table)
    if any(x.text for x in scenarios):
        render_phrases([x for x in scenarios if x.text], console)
    summaries = {(x.mode, x.clients): x.summary() for x in paragraph}
    full, single = summaries.get(("full", 1)), summaries.get(("stream", 1))
    if full and single:
        ratio = single["ttfa_p50"] / full["total_p50"]
        console.print(
            f"streaming TTFA p50 {single['ttfa_p50']:.3f} s vs non-streaming full response p50 {full['total_p50']:.3f} s: "
            f"ratio {ratio:.2f} (target <= 0.25); single-stream underruns: {single['underruns']}"
        )
    if (late := max((x.client_delay for x in scenarios), default=0.0)) > UNDERRUN_TOLERANCE:
        console.print(
            f"this client's event loop woke up to {1000 * late:.0f} ms late (a busy machine): times and lags "
            f"within that are the client's, and lags over {1000 * UNDERRUN_TOLERANCE:.0f} ms count as underruns"
        )
    for s in summaries.values():
        for message in s["error_messages"]:
            console.print(f"{s['mode']} x{s['clients']}: {message}", markup=False)  # not "[...]": rich would read a tag


def render_phrases(scenarios: list[Scenario], console: Console) -> None:
    """One row per phrase: streaming first bytes and complete non-streaming wav, in milliseconds."""
    table = Table(title="short phrases, one client (the screen-reader case)", caption="milliseconds, p50 / p95")
    # every header says what it is on its own: a screen reader reads a column's header, not its place
    for column in ("phrase", "first bytes p50", "first bytes p95", "complete wav p50", "complete wav p95", "repeat p50",
                   "audio s", "ok"):  # fmt: skip
        table.add_column(column, justify="left" if column == "phrase" else "right", no_wrap=True)
    by_text: dict[str, dict[str, dict[str, Any]]] = {}
    for x in scenarios:
        by_text.setdefault(x.text, {})[x.mode] = x.summary()
    for text, modes in by_text.items():
        stream, full, repeat = modes.get("stream", {}), modes.get("full", {}), modes.get("repeat", {})
        cells = ((stream, "ttfa_p50"), (stream, "ttfa_p95"), (full, "total_p50"), (full, "total_p95"), (repeat, "total_p50"))
        ms = [1000 * v.get(k, math.nan) for v, k in cells]
        ok = f"{sum(m.get('ok', 0) for m in modes.values())}/{sum(m.get('requests', 0) for m in modes.values())}"
        table.add_row(text, *(f"{v:.0f}" for v in ms), f"{full.get('audio_s', math.nan):.2f}", ok)
    print_table(console, table)
    first = [m["stream"]["ttfa_p50"] for m in by_text.values() if "stream" in m]
    done = [m["full"]["total_p50"] for m in by_text.values() if "full" in m]
    again = [m["repeat"]["total_p50"] for m in by_text.values() if "repeat" in m]
    console.print(
        f"short phrases: first bytes p50 {1000 * float(np.median(first)):.0f} ms (target <= 50), "
        f"complete p50 {1000 * float(np.median(done)):.0f} ms (target <= 100), median over {len(by_text)} phrases; "
        f"synthesized, not from the audio cache. Repeated: complete in {1000 * float(np.median(again)):.0f} ms"
    )


def to_json(scenarios: list[Scenario]) -> list[dict[str, Any]]:
    return [{**x.summary(), "wall_s": x.wall, "samples": [asdict(s) for s in x.samples]} for x in scenarios]


def failures(scenarios: list[Scenario], probe: bool = False) -> str | None:
    """What failed, when any request did (other than a 429, which a full queue answers): a run with failures
    measured something else than the server's speed. A capacity probe looks for the counts the server cannot carry,
    where requests may time out: there only a lone listener's failures say something is wrong."""
    summaries = [x.summary() for x in scenarios if not probe or x.clients == 1]
    failed = sum(s["errors"] for s in summaries)
    if not failed:
        return None
    first = next((m for s in summaries for m in s["error_messages"] if not m.startswith("HTTP 429")), "see the table")
    return f"{failed} of {sum(s['requests'] for s in summaries)} requests failed (first: {first})"


def check_format(response_format: str) -> None:
    if response_format not in ("pcm", "wav"):
        raise UserError("bench-serve measures playback on pcm or wav", "use --format pcm or --format wav")


def client_counts(spec: str) -> list[int]:
    """`--clients 1,4,8` as counts; anything else is one UserError."""
    counts = [part.strip() for part in spec.split(",") if part.strip()]
    if not counts or not all(c.isdigit() and 1 <= int(c) <= 256 for c in counts):
        raise UserError(f"--clients {spec!r} is not a list of client counts", "use counts from 1 to 256, e.g. --clients 1,4,8")
    return [int(c) for c in counts]


def server_flags(cap_edges: bool, windowed: bool | None, workers: int, tracking_uri: str | None = None) -> list[str]:
    """The `kokoro-opt serve` flags that set up the server a benchmark starts."""
    mode = [] if windowed is None else ["--windowed" if windowed else "--no-windowed"]
    tracking = [] if tracking_uri is None else ["--tracking-uri", tracking_uri]
    return ["--cap-edges"] * cap_edges + mode + ["--workers", str(workers)] * (workers != 1) + tracking


def serve_args(
    url: str | None, artifact: str, artifacts: Path, max_queue: int, flags: list[str], probe: bool = False
) -> list[str]:
    """`kokoro-opt serve` options for the server the benchmark starts (none apply to a running `url`).
    A capacity probe admits as many requests as it will try at once."""
    if flags and url:
        raise UserError(f"{' '.join(flags)} set up a server that bench-serve starts", f"start yours with serve {' '.join(flags)}")
    queue = max(capacity.COUNTS) if probe else max_queue
    return ["--artifact", artifact, "--artifacts", str(artifacts), "--max-queue", str(queue), *flags]


def capacity_conflicts(**given: Any) -> None:
    """Refuse options a capacity probe would pass over: it picks its client counts, streams the default paragraph only
    (what serve's queue limit is measured for) and admits every count it tries."""
    flag = {name: f"--{'no-' * (value is False)}{name.replace('_', '-')}" for name, value in given.items()}
    if asked := [flag[name] for name, value in given.items() if value is not None]:
        raise UserError(f"--capacity picks its own client counts and text; {', '.join(asked)} would change nothing or "
                        "measure another load than serve's default queue limit is for", f"drop {', '.join(asked)}")  # fmt: skip


def probed_store(artifact: str, artifacts: Path, tracking_uri: str | None) -> Path:
    """The store whose capacity.json `serve` reads for the artifact a probe's server will serve."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.store import store_of

    return store_of(resolve_artifact(artifact, artifacts, tracking_uri, runs_here=False).artifact).root


def keep_probe_result(scenarios: list[Scenario], served: dict[str, Any], root: Path) -> tuple[capacity.Capacity, Path]:
    """Keep what a capacity probe found for the served artifact, mode and scheduling, where `serve` reads its default."""
    streams, limit = capacity.sustained([s.summary() for s in scenarios])
    mode, workers, threads = served.get("mode", "whole"), served.get("workers", 1), served.get("threads", 0)
    kept = capacity.record_capacity(root, served["id"], mode, workers, streams, limit, threads, served.get("scheduling", ""))
    return kept, root / capacity.CAPACITY_FILE


def probe_capacity(
    url: str, requests: int, text: str, voice: str, response_format: str, api_key: str | None, sample_rate: int = 24_000
) -> list[Scenario]:
    """Streams started together, in the client counts capacity.next_count picks (1, 2, 4, ... up to the first not
    sustained in capacity.RUNS_PER_COUNT runs, then the counts between)."""
    payload = {"model": "tts-1", "input": text, "voice": voice, "response_format": response_format}

    async def run_all() -> list[Scenario]:
        await run_scenario(url, "stream", 1, 1, payload, sample_rate, api_key)  # caches warm; not counted
        found: list[Scenario] = []
        results: dict[int, bool] = {}
        while (clients := capacity.next_count(results)) is not None:
            results[clients] = False
            for _ in range(capacity.RUNS_PER_COUNT):
                found.append(await run_scenario(url, "stream", clients, requests, payload, sample_rate, api_key))
                if capacity.sustains(found[-1].summary(), capacity.ttfa_limit(found[0].summary())):
                    results[clients] = True
                    break
        return found

    return asyncio.run(run_all())


def run(
    url: str | None,
    server_args: list[str],
    clients: list[int],
    requests: int,
    text: str,
    voice: str,
    response_format: str,
    full: bool,
    api_key: str | None,
    console: Console,
    phrases: tuple[str, ...] = (),
    probe: bool = False,
) -> tuple[list[Scenario], dict[str, Any]]:
    """Bench the server at `url`, or start one with `server_args` for the duration; then each of
    `phrases` alone. With `probe`, the client counts are those capacity.next_count picks.
    Returns the scenarios and the served model's entry (id, mode, workers)."""
    with contextlib.ExitStack() as stack:
        if url is None:
            console.print(f"starting: kokoro-opt serve {' '.join(server_args)}")
            url = stack.enter_context(spawned_server(server_args))
        url = url.rstrip("/")
        info = _server_info(url, api_key)
        title = f"bench-serve {url}: artifact {info['id']} ({info.get('name', '?')}), {len(text)} chars, {response_format}"
        console.print(f"serving {info['id']}: {info.get('reason', '')}")
        if probe:
            scenarios = probe_capacity(url, requests, text, voice, response_format, api_key)
        else:
            scenarios = bench(url, clients, requests, text, voice, response_format, full, api_key)
        if phrases:
            scenarios += bench_phrases(url, phrases, requests, voice, api_key)
        render(scenarios, console, title)
        return scenarios, info
