"""Margins of the windows stage's gate on a built artifact, at 1, 2 and 4 ONNX Runtime threads.

    python benchmarks/windows_gate_margins.py [--artifact artifacts/int8-mixed] [--noise 1e-6] [--draws 1]
                                              [--threads 1,2,4]

Scores windowed vs whole decoding of the same front exactly as the gate does (the stage's own settings,
statistics predictor and finishing) with ONNX Runtime at 1, 2 and 4 threads, and prints each gated figure
beside the stage's budget and the default budget (what `serve` needs to stream windowed by default).
Another machine's front, or a predictor fitted there (`build --reanalyze`), gives slightly different
statistics (float noise in every run), so `--noise` also scores each job's statistics moved by that
relative amount (a normal draw per value), `--draws` times. The worst utterance is a one-word phrase and
moves most: a margin needs several draws.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

THREADS = (1, 2, 4)


class Noisy:
    """Statistics moved by `noise` relative, a normal draw per value and job."""

    def __init__(self, statistics: Any, noise: float, rng: Any) -> None:
        self.statistics, self.noise, self.rng = statistics, noise, rng

    def for_job(self, front: Any, pack: Any, packs: Any) -> Any:
        stats = self.statistics.for_job(front, pack, packs)
        return (stats * (1 + self.noise * self.rng.standard_normal(stats.shape))).astype(stats.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/int8-mixed"))
    parser.add_argument("--noise", type=float, default=1e-6, help="relative noise on the table (0: skip)")
    parser.add_argument("--draws", type=int, default=1, help="noise draws (seeds 0, 1, ...)")
    parser.add_argument("--threads", default=",".join(map(str, THREADS)), help="ONNX Runtime thread counts to score")
    args = parser.parse_args()

    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.passes.speech_gate import GATE_COLUMNS, gate_cells
    from kokoro_opt.passes.windows import measure
    from kokoro_opt.recipe import WindowsStage
    from kokoro_opt.runtime.session import SessionSettings
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.runtime.windowed import WindowedDecoder

    artifact = open_artifact(args.artifact)
    cfg = WindowsStage(**artifact.build.stage("windows")["config"])
    table = Table(title=f"windows gate, {artifact.name} {artifact.id} ({describe(fingerprint())})")
    for column in ("run", *GATE_COLUMNS):
        table.add_column(column, justify="right" if column != "run" else "left")
    for label, budget in (("budget", cfg), ("default budget", cfg.default_budget)):
        bars = (f">= {budget.min_pesq}", "", f">= {budget.min_sentence_pesq}", f">= {budget.min_phrase_pesq}")
        table.add_row(label, *bars, f"<= {budget.max_high_band_db}")
    runs = [(f"{t} threads", int(t), 0.0, 0) for t in args.threads.split(",")]
    if args.noise:
        runs += [(f"statistics x (1 + {args.noise:g} N), draw {seed}", 2, args.noise, seed) for seed in range(args.draws)]
    for label, threads, noise, seed in runs:
        decoder = WindowedDecoder.of_artifact(Synthesizer(artifact, SessionSettings(intra_op_num_threads=threads)))
        if noise:
            decoder.statistics = Noisy(decoder.statistics, noise, np.random.default_rng(seed))
        table.add_row(label, *gate_cells(measure(decoder, cfg)))
    Console().print(table)


if __name__ == "__main__":
    main()
