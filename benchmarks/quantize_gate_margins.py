"""Margins of the quantize stage's quality gate on a built mixed-precision artifact.

    python benchmarks/quantize_gate_margins.py [--artifact artifacts/int8-mixed]

Scores the artifact's quantized model against its quantize stage's input on the held-out
sensitivity sentences, exactly as the gate does when a lock is applied, with ONNX Runtime at 1, 2
and 4 threads, and prints each gated figure beside its budget. The gate is sound on this machine
when the spread over thread counts is far smaller than the distance to the budget.
"""

from __future__ import annotations

import argparse
from pathlib import Path

THREADS = (1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/int8-mixed"))
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.passes.qdq import read_corpus
    from kokoro_opt.passes.sensitivity import SENSITIVITY_CORPUS, AudioScorer
    from kokoro_opt.recipe import QuantizeStage
    from kokoro_opt.store import stage_chain, store_of

    artifact = open_artifact(args.artifact)
    store, chain = store_of(artifact), stage_chain(artifact)
    at = next(i for i, entry in enumerate(chain) if entry.kind == "quantize")
    source, quantized = store.stage(chain[at - 1].kind, chain[at - 1].key), store.stage("quantize", chain[at].key)
    assert source is not None and quantized is not None, "the artifact's stage cache is incomplete: rebuild it"
    cfg = QuantizeStage(**quantized.manifest["stage"]["config"])
    sentences = read_corpus(SENSITIVITY_CORPUS)[: cfg.sensitivity_sentences]

    console = Console(width=160)
    console.print(describe(fingerprint()), highlight=False)
    table = Table(title=f"quantize gate of {artifact.name} {artifact.id[:8]} on {len(sentences)} held-out sentences")
    for column in ("ORT threads", "PESQ mean", "PESQ min", "4-12 kHz dB", "durations =", "gate"):
        table.add_column(column)
    for threads in THREADS:
        quality = AudioScorer(source, sentences, threads)(quantized.model_file)
        table.add_row(
            str(threads), f"{quality.mean_pesq:.3f}", f"{quality.min_pesq:.3f}", f"{quality.max_high_band_db:+.3f}",
            f"{quality.durations_equal:.0%}", "pass" if quality.passes(cfg) else "FAIL",
        )  # fmt: skip
    table.add_row(
        "budget", f">= {cfg.quality_budget_pesq}", f">= {cfg.min_sentence_pesq}", f"<= {cfg.max_high_band_db}",
        f">= {cfg.min_durations_equal:.0%}", "",
    )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
