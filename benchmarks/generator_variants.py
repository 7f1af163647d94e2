"""The windowed generator three ways, side by side at 1, 2 and 4 threads: its INT8 chains computed
per window ("chains"), as lookup tables ("tables", kokoro_opt/passes/int8_lookup.py), and with the tables and
everything else computed from the style and statistics alone run once per job ("hoisted", the default,
kokoro_opt/passes/hoisting.py).

    python benchmarks/generator_variants.py [--artifact artifacts/int8-mixed] [--runs 24]

Decodes the same windows with each, alternating run by run so that all see the same machine, and
prints the median time per window, the ratios, the per-job part's own time (paid once per job by
"hoisted") and the largest difference from the "chains" audio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

THREADS = (1, 2, 4)
STEPS = (12, 40, 80, 160)  # a first window, the smallest a heard listener gets, a later one, a phrase's
TEXT = (
    "The old lighthouse keeper climbed the stairs every evening at dusk. "
    "He lit the great lamp, and its beam swept across the dark water."
)
VARIANTS = {"chains": {"lookup_tables": False, "hoisting": False}, "tables": {"hoisting": False}, "hoisted": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/int8-mixed"))
    parser.add_argument("--runs", type=int, default=24, help="runs per window size and variant")
    args = parser.parse_args()

    import numpy as np
    import onnx
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.chunking import chunk_text
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.passes.windows_split import window_graphs
    from kokoro_opt.runtime.session import SessionSettings
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.runtime.windowed import WindowedDecoder

    artifact = open_artifact(args.artifact)
    table = Table(title=f"windowed generator, {artifact.name} {artifact.id} ({describe(fingerprint())})")
    for column in (
        "threads",
        "window steps",
        "chains ms",
        "tables ms",
        "hoisted ms",
        "tables / chains",
        "hoisted / tables",
        "per-job part ms",
        "max |diff|",
    ):
        table.add_column(column, justify="right")
    for threads in THREADS:
        synth = Synthesizer(artifact, SessionSettings(intra_op_num_threads=threads), load=False)
        served = WindowedDecoder.of_artifact(synth)  # "hoisted": the graphs the artifact stores
        model = onnx.load(str(synth.model_file))
        decoders = {
            name: WindowedDecoder(synth, window_graphs(model, **flags)[0], served.statistics, served.settings)
            for name, flags in VARIANTS.items()
            if flags
        }
        decoders["hoisted"] = served
        del model
        tokens = [t for c in chunk_text(TEXT, synth.vocab, first_chunk_tokens=400, chunk_tokens=400) for t in c.token_ids]
        job = decoders["hoisted"].start(tokens, synth.packs[synth.voices[0]])
        start = job.speech[0]
        for steps in STEPS:
            per_job: list[float] = []
            seconds: dict[str, list[float]] = {name: [] for name in decoders}
            audio = {}
            for run in range(args.runs + 2):
                for name in sorted(decoders, reverse=run % 2 == 1):  # alternate who goes first
                    began = time.perf_counter()
                    audio[name] = decoders[name].window(
                        job.front, start, start + steps, job.stats, constants=job.constants if name == "hoisted" else None
                    )
                    if run >= 2:  # the first runs of a shape allocate
                        seconds[name].append(time.perf_counter() - began)
                began = time.perf_counter()
                decoders["hoisted"].job_constants(job.front, job.stats)
                if run >= 2:
                    per_job.append(time.perf_counter() - began)
            ms = {name: 1000 * float(np.median(values)) for name, values in seconds.items()}
            diff = max(float(np.abs(audio[name] - audio["chains"]).max()) for name in decoders)
            table.add_row(
                str(threads),
                str(steps),
                *(f"{ms[n]:.1f}" for n in VARIANTS),
                f"{ms['tables'] / ms['chains']:.2f}",
                f"{ms['hoisted'] / ms['tables']:.2f}",
                f"{1000 * float(np.median(per_job)):.1f}",
                f"{diff:.1e}",
            )
        del decoders, job  # before the next thread count's three are loaded
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
