"""What a model's run costs right after another model's, as an interleaved evaluation runs them.

    python benchmarks/spinning_between_models.py [ARTIFACT] [REFERENCE] [--rounds 6]
    (defaults: artifacts/int8-mixed, artifacts/fp32)

ONNX Runtime's default keeps a session's thread pool spinning for a while after its run returns. The reference
(the fp32 export) runs as a whole graph, once with its pool spinning as ONNX Runtime leaves it (`always`), once
within its runs only (`in_run`, what `Synthesizer` does), and the artifact is timed right after it and after a
pause, alternated in one process over one phrase and two sentences. Prints both models' totals and the speed-up
as the evaluation would see it and as each model alone gives it (docs/measurements/2026-12-05-three-times-fp32.md).
"""

from __future__ import annotations

import argparse
import time

TEXTS = (
    "Button.",
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods.",
    "In the late afternoon the market square filled with people carrying baskets of apples, loaves of bread and jars of honey.",
)
PAUSE = 0.1  # seconds: long enough for a spinning pool to go idle


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.runtime.session import make_session
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.tables import print_table
    from kokoro_opt.text import utterance_tokens
    from kokoro_opt.voices import style_for

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="artifacts/int8-mixed")
    parser.add_argument("reference", nargs="?", default="artifacts/fp32")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    artifact = Synthesizer(resolve_artifact(args.artifact).artifact)
    reference = Synthesizer(resolve_artifact(args.reference).artifact, load=False)
    sessions = {mode: make_session(reference.model_file, reference.settings, spinning=mode) for mode in ("always", "in_run")}
    voice = artifact.voices[0]
    jobs = []
    for text in TEXTS:
        tokens = utterance_tokens(text, artifact.vocab)
        feeds = reference.feeds(tokens, style_for(reference.packs[voice], len(tokens)), 1.0)
        jobs.append((tokens, feeds))

    def timed(run) -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    totals = {(mode, key): 0.0 for mode in sessions for key in ("reference", "after", "paused")}
    for round_ in range(args.rounds + 1):  # round 0 warms every session up
        for mode in sessions if round_ % 2 else reversed(sessions):
            for tokens, feeds in jobs:
                took = {"reference": timed(lambda f=feeds, m=mode: sessions[m].run(None, f))}
                took["after"] = timed(lambda t=tokens: artifact.run_tokens(t, voice))
                sessions[mode].run(None, feeds)
                time.sleep(PAUSE)
                took["paused"] = timed(lambda t=tokens: artifact.run_tokens(t, voice))
                for key, seconds in took.items():
                    totals[mode, key] += seconds if round_ else 0.0

    title = f"{args.artifact} after {args.reference}, {args.rounds} rounds x {len(TEXTS)} ({describe(fingerprint())})"
    table = Table(title=title)
    columns = ("reference's pool", "reference ms", "artifact right after ms", "after a pause ms", "speed-up seen", "alone")
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for mode in sessions:
        ref, after, paused = (totals[mode, key] * 1e3 for key in ("reference", "after", "paused"))
        table.add_row(mode, f"{ref:,.0f}", f"{after:,.0f}", f"{paused:,.0f}", f"{ref / after:.2f}x", f"{ref / paused:.2f}x")
    print_table(Console(), table)


if __name__ == "__main__":
    main()
