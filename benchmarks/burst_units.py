"""Listeners who start in the same instant: every unit the server runs for them, in order, with its times.

    python benchmarks/burst_units.py [ARTIFACT] [--clients 8] [--units 24] [--rounds 1]   (default: artifacts/int8-mixed)

Starts the server in this process on a free loopback port (as `serve --artifact` would serve the artifact) and
the clients in another, one HTTP connection each, which send the default paragraph of `bench-serve` all at once,
streaming. Prints the first units the engine ran (a job's front with its per-job part, a window, a finish; the job each
belongs to), when each began and ended, when each client's first audio arrived, and every moment a listener's
playback caught up with its bytes (ran dry), with the units around it: where the last listener's first audio
goes, and which unit came late (docs/measurements/2026-11-29-capacity.md). With `--rounds N` the clients send N
bursts in turn, and the server's own count of audio it sent after its listener's deadline (first audio plus the
seconds sent before) is printed for all of them: what the capacity log's in-process comparisons count.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from typing import Any

STEP_SAMPLES = 300
PCM_BYTES_PER_SECOND = 48_000  # 24 kHz, 16-bit mono


def dry_spells(chunks: list[tuple[float, int]]) -> list[tuple[float, float, float]]:
    """(when playback ran dry, seconds of audio played by then, how long it waited) for one stream's chunks
    (arrival time, bytes), playback starting with the first chunk and pausing whenever it catches up."""
    spells, waited, audio = [], 0.0, 0.0
    for arrived, size in chunks:
        played = arrived - chunks[0][0] - waited
        if played > audio + 1e-3:
            spells.append((chunks[0][0] + waited + audio, audio, played - audio))
            waited += played - audio
        audio += size / PCM_BYTES_PER_SECOND
    return spells


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.runtime.windowed import WindowedDecoder
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve.config import ServeConfig
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.server import running
    from kokoro_opt.tables import print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="artifacts/int8-mixed")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--units", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=1, help="bursts sent in turn (the table shows the first)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

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

    def job(made: Any) -> str:
        return f"job {id(made) % 10_000:04d}"

    traced("start", lambda tokens, made: f"{job(made)}: {len(tokens)} tokens, {made.front.steps} steps")
    traced("next_window", lambda made, audio: f"{job(made)}: {len(audio) // STEP_SAMPLES} steps, to step {made.cursor}")
    traced("finish", lambda made, audio: f"{job(made)}: {len(audio) // STEP_SAMPLES} steps")
    late: list[float] = []  # seconds past its listener's deadline, for each audio sent after it
    emit = Engine.emit

    def counted(engine: Any, stream: Any, out: Any, last: bool) -> None:
        if stream.first_out is not None and (behind := time.monotonic() - stream.deadline()) > 0:
            late.append(behind)
        emit(engine, stream, out, last)

    Engine.emit = counted  # type: ignore[method-assign]

    selection = resolve_artifact(args.artifact)
    config = ServeConfig.for_selection(selection, max_queue=max(args.clients, 1))
    spawn = multiprocessing.get_context("spawn")
    ready, go, heard = spawn.Barrier(2), spawn.Event(), spawn.Queue()
    with running(selection, config) as url:
        listeners = spawn.Process(target=_listeners, args=(url, args.clients, ready, go, heard, args.rounds))
        listeners.start()
        ready.wait()  # connections open
        units.clear()
        began[0] = time.monotonic()
        go.set()
        arrivals = heard.get(timeout=600)
        listeners.join()

    table = Table(title=f"{args.clients} listeners at once, {config.mode_name} ({describe(fingerprint())})")
    for column in ("began ms", "ended ms", "unit", "what"):
        table.add_column(column, justify="right" if column.endswith("ms") else "left")
    for start, end, name, what in sorted(units)[: args.units]:
        table.add_row(f"{start * 1e3:.1f}", f"{end * 1e3:.1f}", name, what)
    console = Console()
    print_table(console, table)
    first = sorted(chunks[0][0] for chunks in arrivals if chunks)
    console.print("first audio per listener, ms: " + ", ".join(f"{(t - began[0]) * 1e3:.0f}" for t in first))
    spells = sorted(
        (when - began[0], who, audio, wait) for who, chunks in enumerate(arrivals) for when, audio, wait in dry_spells(chunks)
    )
    console.print(f"ran dry: {len(spells)} time(s)" + ("" if spells else " (every listener was fed)"))
    console.print(f"audio sent after its listener's deadline, {args.rounds} burst(s): {len(late)} time(s)"
                  + (f", up to {max(late) * 1e3:.0f} ms" if late else ""))  # fmt: skip
    for when, who, audio, wait in spells:
        console.print(
            f"  listener {who} at {when * 1e3:.0f} ms, {audio:.2f} s into its audio, waited {wait * 1e3:.0f} ms; units then:"
        )
        for start, end, name, what in sorted(units):
            if end >= when - 0.3 and start <= when + wait:
                console.print(f"    {start * 1e3:8.1f} {end * 1e3:8.1f}  {name:<11} {what}", highlight=False)


def _listeners(url: str, count: int, ready: Any, go: Any, heard: Any, rounds: int = 1) -> None:
    """`count` streaming clients in their own process (in the server's, their threads would take its cores): each
    sends the paragraph when `go` is set, `rounds` times in turn; puts every client's chunks of the first round
    (time.monotonic, bytes) on `heard` once all are done."""
    import httpx

    from kokoro_opt.serve.bench import PARAGRAPH

    clients = [httpx.Client(base_url=url, timeout=300) for _ in range(count)]
    for client in clients:
        client.get("/health")
    body = {"model": "tts-1", "input": PARAGRAPH, "voice": "alloy", "response_format": "pcm", "stream": True}
    chunks: list[list[tuple[float, int]]] = [[] for _ in clients]

    def listen(who: int, client: Any, first: bool) -> None:
        go.wait()
        with client.stream("POST", "/v1/audio/speech", json=body, headers={"Cache-Control": "no-cache"}) as reply:
            for part in reply.iter_raw():
                if first:
                    chunks[who].append((time.monotonic(), len(part)))

    for burst in range(rounds):
        threads = [threading.Thread(target=listen, args=(who, client, burst == 0)) for who, client in enumerate(clients)]
        for thread in threads:
            thread.start()
        if burst == 0:
            ready.wait()
        for thread in threads:
            thread.join()
    heard.put(chunks)


if __name__ == "__main__":
    main()
