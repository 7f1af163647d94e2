"""What a lone listener hears windowed, scored against model.onnx's whole decoding of the same text.

    python benchmarks/windowed_vs_model.py [ARTIFACT ...]   (default: artifacts/int8-mixed)

The windows stage's gate scores windowed speech against the whole generator run over the job's front. This
scores the same utterances (the stage's sentences and short phrases) against the whole model instead, as a
user comparing `serve` with `serve --no-windowed` would, and the finish alone (front + whole generator, no
window) against it too: identical audio when the artifact's graphs carry the model's shapes
(docs/measurements/2026-12-05-front-shapes.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="*", type=Path, default=[Path("artifacts/int8-mixed")])
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.passes.speech_gate import GATE_COLUMNS, gate_cells, gate_utterances, score, summarise
    from kokoro_opt.recipe import WindowsStage
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.runtime.windowed import STEP_SAMPLES, WindowedDecoder

    table = Table(title=f"against model.onnx's whole decoding ({describe(fingerprint())})")
    for column in ("artifact", "scored", *GATE_COLUMNS):
        table.add_column(column, justify="left" if column in ("artifact", "scored") else "right")
    for path in args.artifacts:
        artifact = open_artifact(path)
        cfg = WindowsStage(**artifact.build.stage("windows")["config"])
        synth = Synthesizer(artifact)
        decoder = WindowedDecoder.of_artifact(synth)
        served, finished = [], []
        for utterance, tokens in gate_utterances(cfg, synth.voices, synth.vocab):
            windowed, job = decoder.speak(tokens, synth.packs[utterance.voice])
            span = slice(job.speech[0] * STEP_SAMPLES, job.speech[1] * STEP_SAMPLES)
            model = synth.run_tokens(tokens, utterance.voice).audio[span]
            served.append(score(utterance, model, windowed, synth.sample_rate, tokens=len(tokens), windows=job.windows))
            whole = decoder.whole_audio(job.front)[span]
            finished.append(score(utterance, model, whole, synth.sample_rate, tokens=len(tokens), windows=1))
        for label, rows in (("windowed, as served", served), ("front + whole generator", finished)):
            table.add_row(f"{artifact.name} {artifact.id}", label, *gate_cells(summarise(rows)))
    Console().print(table)


if __name__ == "__main__":
    main()
