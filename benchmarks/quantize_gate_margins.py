"""Margins of the quantize stage's quality gate on a built mixed-precision artifact.

    python benchmarks/quantize_gate_margins.py [--artifact artifacts/int8-mixed] [--perturb 5]

Scores the artifact's quantized model against its quantize stage's input on the held-out
sensitivity sentences, exactly as the gate does when a lock is applied, with ONNX Runtime at 1, 2
and 4 threads, and prints each gated figure beside its budget.

Threads run the same bytes. Another machine quantizes a slightly different model (the export's
weights and the calibration ranges carry float noise), so `--perturb N` also re-quantizes the
artifact's INT8 choice N times from its calibration ranges moved by a relative 1e-6 (a fresh normal
draw per range) and scores each: the spread of those rows is the noise a gate must stand clear of.
"""

from __future__ import annotations

import argparse
from pathlib import Path

THREADS = (1, 2, 4)
NOISE = 1e-6


def perturbed_ranges(folder: Path, seed: int) -> None:
    """Every calibration range in `folder` (qdq.CalibrationFiles) times 1 + NOISE * N(0, 1), in place."""
    import json

    import numpy as np

    from kokoro_opt.passes.qdq import CalibrationFiles

    rng, files = np.random.default_rng(seed), CalibrationFiles(folder)

    def moved(values: list[float]) -> list[float]:
        return (np.asarray(values) * (1 + NOISE * rng.standard_normal(len(values)))).tolist()

    def moved_value(value: float | dict) -> float | dict:  # ORT writes some as {"data": x, "CLS": "numpy.array"}
        return {**value, "data": moved_value(value["data"])} if isinstance(value, dict) else moved([value])[0]

    ranges = json.loads(files.ranges.read_text(encoding="utf-8"))
    for entry in ranges["data"].values():
        entry["lowest"], entry["highest"] = moved_value(entry["lowest"]), moved_value(entry["highest"])
    files.ranges.write_text(json.dumps(ranges), encoding="utf-8")
    outputs = json.loads(files.output_ranges.read_text(encoding="utf-8"))
    files.output_ranges.write_text(json.dumps({t: [moved(lo), moved(hi)] for t, (lo, hi) in outputs.items()}), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/int8-mixed"))
    parser.add_argument("--perturb", type=int, default=0, help="re-quantize from N perturbed calibrations")
    args = parser.parse_args()

    import contextlib
    import shutil
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.errors import UserError
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.passes.qdq import CalibrationFiles, read_corpus
    from kokoro_opt.passes.sensitivity import LOCK_PESQ_TOLERANCE, SENSITIVITY_CORPUS, AudioScorer, run_mixed
    from kokoro_opt.recipe import QuantizeStage
    from kokoro_opt.store import stage_chain, store_of

    artifact = open_artifact(args.artifact)
    store, chain = store_of(artifact), stage_chain(artifact)
    at = next(i for i, entry in enumerate(chain) if entry.kind == "quantize")
    source, quantized = store.stage(chain[at - 1].kind, chain[at - 1].key), store.stage("quantize", chain[at].key)
    assert source is not None and quantized is not None, "the artifact's stage cache is incomplete: rebuild it"
    cfg = QuantizeStage(**quantized.build.stages[-1]["config"])
    sentences = read_corpus(SENSITIVITY_CORPUS)[: cfg.sensitivity_sentences]

    console = Console(width=160)
    console.print(describe(fingerprint()), highlight=False)
    table = Table(title=f"quantize gate of {artifact.name} {artifact.id[:8]} on {len(sentences)} held-out sentences")
    for column in ("model", "PESQ mean", "PESQ min", "4-12 kHz dB", "durations =", "budget", "locked gate"):
        table.add_column(column)

    def add_row(label: str, quality: object) -> None:
        table.add_row(
            label, f"{quality.mean_pesq:.3f}", f"{quality.min_pesq:.3f}", f"{quality.max_high_band_db:+.3f}",
            f"{quality.durations_equal:.0%}", "pass" if quality.passes(cfg) else "FAIL",
            "pass" if quality.passes(cfg, LOCK_PESQ_TOLERANCE) else "FAIL",
        )  # fmt: skip

    for threads in THREADS:
        add_row(f"as built, {threads} ORT threads", AudioScorer(source, sentences, threads)(quantized.model_file))
    scorer = AudioScorer(source, sentences)
    decisions = {"int8_units": quantized.build.stages[-1]["decisions"]["int8_units"]} if args.perturb else {}
    for seed in range(args.perturb):
        with tempfile.TemporaryDirectory(prefix="kokoro-opt-perturb-") as tmp:
            folder = Path(tmp)
            for name in quantized.manifest.files:
                if name.endswith(".json"):
                    shutil.copy2(quantized.path / name, folder / name)
            perturbed_ranges(folder, seed)
            with contextlib.suppress(UserError):  # the locked gate failed: the row below says by how much
                run_mixed(source, cfg, folder, lambda f=folder: CalibrationFiles(f), decisions)
            add_row(f"ranges x (1 + {NOISE:g} N), draw {seed}", scorer(folder / "model.onnx"))
    table.add_row(
        "budget", f">= {cfg.quality_budget_pesq}", f">= {cfg.min_sentence_pesq}", f"<= {cfg.max_high_band_db}",
        f">= {cfg.min_durations_equal:.0%}", "", f"PESQ budgets - {LOCK_PESQ_TOLERANCE}",
    )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
