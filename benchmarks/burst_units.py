"""Listeners who start in the same instant: every unit the server runs for them, in order, with its times.

    python benchmarks/burst_units.py [ARTIFACT] [--clients 8] [--units 24]   (default: artifacts/int8-mixed)

Starts the server in this process on a free loopback port (as `serve --artifact` would serve the artifact) and
the clients in another, one HTTP connection each, which send the default paragraph of `bench-serve` all at once,
streaming. Prints the first units the engine ran (a job's front with its per-job part, a window, a finish),
when each began and ended, and when each client's first audio arrived: where the last listener's first audio
goes (docs/measurements/2026-11-29-capacity.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from typing import Any

STEP_SAMPLES = 300


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.runtime.windowed import WindowedDecoder
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve.config import ServeConfig
    from kokoro_opt.serve.server import running
    from kokoro_opt.tables import print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="artifacts/int8-mixed")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--units", type=int, default=24)
    args = parser.parse_args()

    units: list[tuple[float, float, str, str]] = []
    began = [0.0]

    def traced(name: str, describe_unit: Any) -> None:
        run = getattr(WindowedDecoder, name)

        def wrapper(self: Any, subject: Any, *rest: Any, **options: Any) -> Any:
            started = time.monotonic()
            made = run(self, subject, *rest, **options)
            units.append((started - began[0], time.monotonic() - began[0], name, describe_unit(subject, made)))
            return made

        setattr(WindowedDecoder, name, wrapper)

    traced("start", lambda tokens, job: f"{len(tokens)} tokens, {job.front.steps} steps")
    traced("next_window", lambda job, audio: f"{len(audio) // STEP_SAMPLES} steps, to step {job.cursor}")
    traced("finish", lambda job, audio: f"{len(audio) // STEP_SAMPLES} steps")

    selection = resolve_artifact(args.artifact)
    config = ServeConfig.for_selection(selection, max_queue=max(args.clients, 1))
    spawn = multiprocessing.get_context("spawn")
    ready, go, heard = spawn.Barrier(2), spawn.Event(), spawn.Queue()
    with running(selection, config) as url:
        listeners = spawn.Process(target=_listeners, args=(url, args.clients, ready, go, heard))
        listeners.start()
        ready.wait()  # connections open
        units.clear()
        began[0] = time.monotonic()
        go.set()
        first_audio = heard.get(timeout=600)
        listeners.join()

    table = Table(title=f"{args.clients} listeners at once, {config.mode_name} ({describe(fingerprint())})")
    for column in ("began ms", "ended ms", "unit", "what"):
        table.add_column(column, justify="right" if column.endswith("ms") else "left")
    for start, end, name, what in sorted(units)[: args.units]:
        table.add_row(f"{start * 1e3:.1f}", f"{end * 1e3:.1f}", name, what)
    console = Console()
    print_table(console, table)
    console.print("first audio per listener, ms: " + ", ".join(f"{(t - began[0]) * 1e3:.0f}" for t in sorted(first_audio)))


def _listeners(url: str, count: int, ready: Any, go: Any, heard: Any) -> None:
    """`count` streaming clients in their own process (in the server's, their threads would take its cores): each
    sends the paragraph when `go` is set; puts every client's first-audio time (time.monotonic) on `heard`."""
    import httpx

    from kokoro_opt.serve.bench import PARAGRAPH

    clients = [httpx.Client(base_url=url, timeout=300) for _ in range(count)]
    for client in clients:
        client.get("/health")
    body = {"model": "tts-1", "input": PARAGRAPH, "voice": "alloy", "response_format": "pcm", "stream": True}
    first: list[float] = []

    def listen(client: Any) -> None:
        go.wait()
        with client.stream("POST", "/v1/audio/speech", json=body, headers={"Cache-Control": "no-cache"}) as reply:
            heard_yet = False
            for _ in reply.iter_raw():
                if not heard_yet:
                    first.append(time.monotonic())
                    heard_yet = True

    threads = [threading.Thread(target=listen, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    ready.wait()
    for thread in threads:
        thread.join()
    heard.put(first)


if __name__ == "__main__":
    main()
