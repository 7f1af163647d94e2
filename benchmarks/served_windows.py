"""What a lone listener hears from `serve` on this machine, scored like the windows gate.

    python benchmarks/served_windows.py [ARTIFACT]   (default: artifacts/int8-mixed)
    KOKORO_OPT_THREADS=1 python benchmarks/served_windows.py   (runs slower: a slower machine's choices)
    python benchmarks/served_windows.py --listeners 4   (each utterance served beside 3 paragraph streams)

The windows gate scores a fixed plan: a first window, then the finish (or windows to the end). A server
chooses its units from its own timings: a bridge window between the first window and the finish when the
finish would not end before the first window's audio does, longer on a slower machine. This serves each of
the gate's utterances to one listener through the engine, logs the units it chose, decodes those units again
and scores them against the whole generator's audio (model.onnx's), as the gate does
(docs/measurements/2026-11-29-capacity.md). With `--listeners N`, N-1 other listeners stream `bench-serve`'s
paragraph through the same engine the whole time: a busy server finishes fewer jobs whole and decodes more of
them in windows, with predicted statistics, so this is what a listener hears under load.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any


def served_units(
    engine: Any,
    tokens: list[int],
    pack: Any,
    others: list[Any] | None = None,  # pieces (Engine.plan) or token lists
    listeners: int = 1,
    chunks: list[tuple[float, int]] | None = None,
) -> list[tuple[str, int, int | None]]:
    """The units (kind, steps, context) the engine's worker decoded for one streamed request of `tokens`,
    beside `listeners - 1` streams of the pieces `others` started with it and restarted until it ends;
    `chunks` collects when each of the request's pcm chunks arrived and its bytes."""
    from kokoro_opt.serve.encoders import make_encoder

    decoder, units, ours = engine.mode.decoder, [], set()
    start, next_window, finish = type(decoder).start, type(decoder).next_window, type(decoder).finish

    def tagged_start(token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        job = start(decoder, token_ids, *args, **kwargs)
        if list(token_ids) == list(tokens):
            ours.add(id(job))
        return job

    def logged_window(job: Any, steps: int | None = None, run_options: Any = None, overlap: int | None = None) -> Any:
        begin = job.cursor
        audio = next_window(decoder, job, steps, run_options, overlap)
        if id(job) in ours:
            units.append(("window", job.cursor - begin, overlap))
        return audio

    def logged_finish(job: Any, run_options: Any = None) -> Any:
        if id(job) in ours:
            units.append(("finish", job.speech[1] - job.cursor, None))
        return finish(decoder, job, run_options)

    async def drain(stream: Any, arrivals: list[tuple[float, int]] | None = None) -> None:
        while (item := await stream.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            if arrivals is not None and item:
                arrivals.append((time.monotonic(), len(item)))

    def submit(pieces: list[Any]) -> Any:
        return engine.submit(pieces, pack, 1.0, make_encoder("pcm", engine.sample_rate, True), True)

    async def load(playing: list[Any]) -> None:
        while True:
            playing.append(submit(list(others or [])))
            await drain(playing[-1])

    async def listen() -> None:
        playing: list[Any] = []
        background = [asyncio.create_task(load(playing)) for _ in range(listeners - 1)]
        await drain(submit([tokens]), chunks)
        for task in background:
            task.cancel()
        for stream in playing:
            engine.cancel(stream)

    decoder.start, decoder.next_window, decoder.finish = tagged_start, logged_window, logged_finish
    try:
        asyncio.run(listen())
    finally:
        del decoder.start, decoder.next_window, decoder.finish
    return units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", nargs="?", type=Path, default=Path("artifacts/int8-mixed"))
    parser.add_argument("--listeners", type=int, default=1, help="listeners at once: the others stream a paragraph")
    args = parser.parse_args()

    import numpy as np
    from burst_units import dry_spells  # this folder's: a listener's playback, paused whenever it catches up
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.evaluate.corpus import PHRASE
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.passes.speech_gate import GATE_COLUMNS, gate_cells, gate_utterances, score, summarise
    from kokoro_opt.recipe import WindowsStage
    from kokoro_opt.runtime.session import default_threads
    from kokoro_opt.runtime.windowed import STEP_SAMPLES
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.bench import PARAGRAPH, UNDERRUN_TOLERANCE
    from kokoro_opt.serve.engine import Engine

    engine = Engine(resolve_artifact(str(args.artifact)), ServeConfig(windowed=True, max_queue=max(4, args.listeners)))
    engine.start()
    if not engine.ready.wait(300):
        raise SystemExit(f"the engine did not start: {engine.error}")
    synth, decoder = engine.synth, engine.mode.decoder
    cfg = WindowsStage(**synth.artifact.build.stage("windows")["config"])
    paragraph = engine.plan(PARAGRAPH)
    plans, waits = [], []
    for utterance, tokens in gate_utterances(cfg, synth.voices, synth.vocab):
        chunks: list[tuple[float, int]] = []
        units = served_units(engine, tokens, synth.packs[utterance.voice], paragraph, args.listeners, chunks)
        plans.append((utterance, tokens, units))
        waits.append(sum(waited for _, _, waited in dry_spells(chunks) if waited > UNDERRUN_TOLERANCE))
        time.sleep(0.2)  # each utterance's listeners alone
    engine.stop()

    rows, bridges, finished = [], {True: [], False: []}, 0
    for utterance, tokens, units in plans:
        finished += any(kind == "finish" for kind, _, _ in units)
        job = decoder.start(tokens, synth.packs[utterance.voice])
        parts = [
            decoder.finish(job) if kind == "finish" else decoder.next_window(job, steps, None, context)
            for kind, steps, context in units
        ]
        span = slice(job.speech[0] * STEP_SAMPLES, job.speech[1] * STEP_SAMPLES)
        rows.append(score(utterance, decoder.whole_audio(job.front)[span], np.concatenate(parts), synth.sample_rate))
        bridges[utterance.sentence.kind == PHRASE] += [steps for _, steps, context in units if context is not None]

    def spread(values: list[int]) -> str:
        return f"{len(values)}: {min(values)}-{max(values)} steps" if values else "none"

    threads = default_threads() or "every core"
    who = "a lone listener" if args.listeners == 1 else f"one of {args.listeners} listeners"
    table = Table(title=f"served to {who} vs whole decoding ({describe(fingerprint())}, ORT threads: {threads})")
    for column in ("artifact", "bridges: phrases", "sentences", "finished whole", "ran dry", *GATE_COLUMNS):
        table.add_column(column, justify="left" if column == "artifact" else "right")
    artifact = synth.artifact
    table.add_row(
        f"{artifact.name} {artifact.id}",
        spread(bridges[True]),
        spread(bridges[False]),
        f"{finished} of {len(plans)}",
        f"{sum(w > 0 for w in waits)} ({1000 * max(waits):.0f} ms)",
        *gate_cells(summarise(rows)),
    )
    Console().print(table)


if __name__ == "__main__":
    main()
