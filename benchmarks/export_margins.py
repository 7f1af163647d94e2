"""Margins of the export gate: every kernel path of a correct export against every broken one.

    python benchmarks/export_margins.py [--artifact artifacts/fp32] [--recipe recipes/fp32.yaml]

Runs the gate (kokoro_opt/validation.py) on the artifact's model.onnx against PyTorch with torch's
kernels forced to AVX512, AVX2 and the portable default (ATEN_CPU_CAPABILITY, one process each)
and ONNX Runtime at 1, 2 and 4 threads; then on each deliberately broken graph of
kokoro_opt/mutations.py. Prints both tables and the machine. A gate is sound when the worst
correct row sits far inside its threshold and the best broken row far outside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CAPABILITIES = ("avx512", "avx2", "default")
THREADS = (1, 2, 4)


def worker(artifact_dir: Path, recipe_file: Path, mutations: bool) -> None:
    import onnx

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.mutations import MUTATIONS
    from kokoro_opt.recipe import load_recipe
    from kokoro_opt.validation import onnx_synthesize, torch_synthesizer, validate, validation_cases
    from kokoro_opt.voices import SAMPLE_RATE
    from kokoro_opt.weights.sources import exported_kmodel

    artifact = open_artifact(artifact_dir)
    model = exported_kmodel(artifact.kokoro["weights"])
    cfg = load_recipe(recipe_file).export.validation
    cases = validation_cases(cfg, artifact.kokoro["vocab"], artifact.voice_packs())
    reference = torch_synthesizer(model)
    rows = []
    for threads in THREADS:
        report = validate(reference, onnx_synthesize(artifact.model_file, threads), cases, cfg, SAMPLE_RATE)
        rows.append({"variant": "correct export", "threads": threads, **_figures(report)})
    if mutations:
        graph = onnx.load(str(artifact.model_file))
        for name, mutate in MUTATIONS.items():
            broken = mutate(graph).SerializeToString()
            report = validate(reference, onnx_synthesize(broken, 2), cases, cfg, SAMPLE_RATE)
            rows.append({"variant": name, "threads": 2, **_figures(report)})
    print(json.dumps({"capability": os.environ.get("ATEN_CPU_CAPABILITY", ""), "rows": rows, "threshold": cfg.max_mel_db}))


def _figures(report: dict) -> dict:
    keys = ("passed", "durations_equal", "length_equal", "max_mel_db", "min_snr_db", "min_correlation")
    return {k: report[k] for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/fp32"))
    parser.add_argument("--recipe", type=Path, default=Path("recipes/fp32.yaml"))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mutations", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.artifact, args.recipe, args.mutations)
        return

    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.machine import describe, fingerprint

    console = Console(width=200)
    results = []
    for i, capability in enumerate(CAPABILITIES):
        command = [sys.executable, __file__, "--worker", "--artifact", str(args.artifact), "--recipe", str(args.recipe)]
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run([*command, *(["--mutations"] if i == 0 else [])], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"worker for {capability} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    console.print(describe(fingerprint()), highlight=False)
    threshold = results[0]["threshold"]
    table = Table(title=f"export gate: durations and length identical, max log-mel distance <= {threshold} dB")
    columns = ("torch kernels", "ORT threads", "variant", "durations =", "length =", "max mel dB", "margin", "SNR dB*", "corr*")
    for column in (*columns, "gate"):
        table.add_column(column)
    for result in results:
        for row in result["rows"]:
            table.add_row(
                result["capability"], str(row["threads"]), row["variant"], str(row["durations_equal"]), str(row["length_equal"]),
                f"{row['max_mel_db']:.3f}", f"{threshold / row['max_mel_db']:.1f}x" if row["max_mel_db"] > 0 else "inf",
                f"{row['min_snr_db']:.1f}", f"{row['min_correlation']:.4f}", "pass" if row["passed"] else "FAIL",
            )  # fmt: skip
    console.print(table)
    console.print("margin = threshold / measured (> 1: inside the gate); * recorded, not gated: SineGen's phase drift moves it")


if __name__ == "__main__":
    main()
