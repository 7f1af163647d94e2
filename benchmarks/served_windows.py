"""What a lone listener hears from `serve` on this machine, scored like the windows gate.

    python benchmarks/served_windows.py [ARTIFACT]   (default: artifacts/int8-mixed)
    KOKORO_OPT_THREADS=1 python benchmarks/served_windows.py   (runs slower: a slower machine's choices)

The windows gate scores a fixed plan: a first window, then the finish (or windows to the end). A server
chooses its units from its own timings: a bridge window between the first window and the finish when the
finish would not end before the first window's audio does, longer on a slower machine. This serves each of
the gate's utterances to one listener through the engine, logs the units it chose, decodes those units again
and scores them against the whole generator's audio (model.onnx's), as the gate does
(docs/measurements/2026-11-29-capacity.md).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any


def served_units(engine: Any, tokens: list[int], pack: Any) -> list[tuple[str, int, int | None]]:
    """The units (kind, steps, context) the engine's worker decoded for one streamed request of `tokens`."""
    from kokoro_opt.serve.encoders import make_encoder

    decoder, units = engine.mode.decoder, []
    next_window, finish = type(decoder).next_window, type(decoder).finish

    def logged_window(job: Any, steps: int | None = None, run_options: Any = None, overlap: int | None = None) -> Any:
        start = job.cursor
        audio = next_window(decoder, job, steps, run_options, overlap)
        units.append(("window", job.cursor - start, overlap))
        return audio

    def logged_finish(job: Any, run_options: Any = None) -> Any:
        units.append(("finish", job.speech[1] - job.cursor, None))
        return finish(decoder, job, run_options)

    async def listen() -> None:
        stream = engine.submit([tokens], pack, 1.0, make_encoder("pcm", engine.sample_rate, True), True)
        while (item := await stream.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item

    decoder.next_window, decoder.finish = logged_window, logged_finish
    try:
        asyncio.run(listen())
    finally:
        del decoder.next_window, decoder.finish
    return units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", nargs="?", type=Path, default=Path("artifacts/int8-mixed"))
    args = parser.parse_args()

    import numpy as np
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
    from kokoro_opt.serve.engine import Engine

    engine = Engine(resolve_artifact(str(args.artifact)), ServeConfig(windowed=True))
    engine.start()
    if not engine.ready.wait(300):
        raise SystemExit(f"the engine did not start: {engine.error}")
    synth, decoder = engine.synth, engine.mode.decoder
    cfg = WindowsStage(**synth.artifact.build.stages[-1]["config"])
    plans = []
    for utterance, tokens in gate_utterances(cfg, synth.voices, synth.vocab):
        plans.append((utterance, tokens, served_units(engine, tokens, synth.packs[utterance.voice])))
        time.sleep(0.2)  # each listener alone
    engine.stop()

    rows, bridges = [], {True: [], False: []}
    for utterance, tokens, units in plans:
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
    table = Table(title=f"served to a lone listener vs whole decoding ({describe(fingerprint())}, ORT threads: {threads})")
    for column in ("artifact", "bridges: phrases", "sentences", *GATE_COLUMNS):
        table.add_column(column, justify="left" if column == "artifact" else "right")
    artifact = synth.artifact
    table.add_row(f"{artifact.name} {artifact.id}", spread(bridges[True]), spread(bridges[False]), *gate_cells(summarise(rows)))
    Console().print(table)


if __name__ == "__main__":
    main()
