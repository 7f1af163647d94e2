"""The fused generator against the whole generator it replaces, side by side (the `fuse` stage).

    python benchmarks/fused_generator.py [ARTIFACT] [--runs 9]   (default: artifacts/int8-mixed)

Runs one phrase, one short sentence and one long sentence through the artifact's front, then through
`windows/whole_generator.onnx` in ONNX Runtime and through `fused/` (ONNX Runtime segments and the native
chains), alternated in one process, and prints each one's median time, the time in the native chains, the
speed-up and PESQ-WB of the fused audio against the whole generator's (docs/measurements/2026-12-05-fused-
generator.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

TEXTS = (
    "Checkbox checked.",
    "The birch canoe slid on the smooth planks.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.",
)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.evaluate.metrics import pesq_wb
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.runtime.fused import FUSED_DIR, FusedGenerator
    from kokoro_opt.runtime.session import make_session
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.runtime.windowed import WindowedDecoder
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.tables import print_table
    from kokoro_opt.text import utterance_tokens
    from kokoro_opt.voices import style_for

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="artifacts/int8-mixed")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()

    artifact = resolve_artifact(args.artifact).artifact
    synth = Synthesizer(artifact, load=False)
    decoder = WindowedDecoder.of_artifact(synth)
    fused = FusedGenerator(artifact.path / FUSED_DIR, synth.settings)
    whole = make_session(artifact.path / "windows" / "whole_generator.onnx", synth.settings, spinning="in_run")
    pack = synth.packs[synth.voices[0]]

    table = Table(title=f"whole vs fused generator, {args.runs} runs each, alternated ({describe(fingerprint())})")
    for column in ("utterance", "steps", "whole ms", "fused ms", "of it native chains ms", "speed-up", "PESQ-WB vs whole"):
        table.add_column(column, justify="left" if column == "utterance" else "right")
    for text in TEXTS:
        tokens = utterance_tokens(text, synth.vocab)
        front = decoder.front(tokens, style_for(pack, len(tokens)))
        feeds = front.generator_feeds()
        reference, made = whole.run(None, feeds)[0].reshape(-1), fused.run(feeds).reshape(-1)
        times: dict[str, list[float]] = {"whole": [], "fused": []}
        fused.chain_seconds = 0.0
        for _ in range(args.runs):
            for name in ("whole", "fused"):
                began = time.perf_counter()
                whole.run(None, feeds) if name == "whole" else fused.run(feeds)
                times[name].append(time.perf_counter() - began)
        a, b = (statistics.median(times[k]) * 1e3 for k in ("whole", "fused"))
        chains = fused.chain_seconds / args.runs * 1e3
        pesq = pesq_wb(reference, made, synth.sample_rate)
        table.add_row(text[:40], str(front.steps), f"{a:.1f}", f"{b:.1f}", f"{chains:.1f}", f"{a / b:.2f}x", f"{pesq:.3f}")
    print_table(Console(), table)


if __name__ == "__main__":
    main()
