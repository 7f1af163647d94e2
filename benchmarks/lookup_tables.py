"""The windowed generator with and without its INT8 lookup tables, side by side, at 1, 2 and 4 threads.

    python benchmarks/lookup_tables.py [--artifact artifacts/int8-mixed-windowed] [--runs 24]

Loads the artifact's generator twice (kokoro_opt/int8_lookup.py: tables, and the chains they replace),
decodes the same windows with each, alternating run by run so that both see the same machine, and
prints the median time per window and the ratio. Also checks that both give the same audio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

THREADS = (1, 2, 4)
STEPS = (24, 80, 160)  # the first window, a later one, a non-streaming request's
TEXT = ("The old lighthouse keeper climbed the stairs every evening at dusk. "
        "He lit the great lamp, and its beam swept across the dark water.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/int8-mixed-windowed"))
    parser.add_argument("--runs", type=int, default=24, help="runs per window size and variant")
    args = parser.parse_args()

    import numpy as np
    import onnx
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.decoder_windows import split
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.synth import SessionSettings, Synthesizer, make_session
    from kokoro_opt.text import chunk_text
    from kokoro_opt.windowed import WindowedDecoder

    artifact = open_artifact(args.artifact)
    table = Table(title=f"windowed generator, {artifact.name} {artifact.id} ({describe(fingerprint())})")
    for column in ("threads", "window steps", "chains ms", "tables ms", "tables / chains", "max |diff|"):
        table.add_column(column, justify="right")
    for threads in THREADS:
        settings = SessionSettings(intra_op_num_threads=threads)
        decoder = WindowedDecoder.of_artifact(Synthesizer(artifact, settings, load=False))
        chains = split(onnx.load(str(artifact.path / "model.onnx")), lookup_tables=False)[1]
        sessions = {"tables": decoder.generator_session,
                    "chains": make_session(chains.SerializeToString(), settings, spinning=False, shared_arena=True)}
        synth = decoder.synth
        tokens = [t for c in chunk_text(TEXT, synth.vocab, first_chunk_tokens=400, chunk_tokens=400) for t in c.token_ids]
        job = decoder.start(tokens, synth.packs[synth.voices[0]])
        start = job.speech[0]
        for steps in STEPS:
            seconds: dict[str, list[float]] = {name: [] for name in sessions}
            audio = {}
            for run in range(args.runs + 2):
                for name in sorted(sessions, reverse=run % 2 == 1):  # alternate who goes first
                    decoder.generator_session = sessions[name]
                    began = time.perf_counter()
                    audio[name] = decoder.window(job.front, start, start + steps, job.stats)
                    if run >= 2:  # the first runs of a shape allocate
                        seconds[name].append(time.perf_counter() - began)
            chain_ms, table_ms = (1000 * float(np.median(seconds[n])) for n in ("chains", "tables"))
            table.add_row(str(threads), str(steps), f"{chain_ms:.1f}", f"{table_ms:.1f}", f"{table_ms / chain_ms:.2f}",
                          f"{float(np.abs(audio['tables'] - audio['chains']).max()):.1e}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
