"""Margins of the test tolerances that compare two graphs' audio (tests/test_passes.py, test_snake.py).

    python benchmarks/tolerance_margins.py

Builds the tiny model's stage variants the tests compare (in a temporary artifact root), runs each
pair with ONNX Runtime at 1, 2 and 4 threads, and prints how much of the test's allclose tolerance
the difference uses: max |a - b| / (atol + rtol |b|). Below 1 passes; the margin is its inverse.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

THREADS = (1, 2, 4)
SIMPLIFY, SMOOTH = {"kind": "simplify"}, {"kind": "smooth", "calibration_sentences": 1}
# (test, variant stages, reference stages, rtol, atol): as the tests write them
SNAKE, SNAKE_FOLD_ONLY = {"kind": "snake"}, {"kind": "snake", "polynomial_degree": None}
PAIRS = [
    ("test_simplify_with_onnxsim_then_ort_basic", [{"kind": "simplify", "tool": "onnxsim"}], [], 1e-7, 1e-3),
    ("test_smooth_keeps_the_output_and_moves_ranges_into_the_weights", [SIMPLIFY, SMOOTH], [SIMPLIFY], 1e-3, 1e-4),
    ("test_snake_stage_keeps_the_output_and_drops_the_generator_sin", [SIMPLIFY, SMOOTH, SNAKE], [SIMPLIFY, SMOOTH], 1e-3, 1e-4),
    ("test_folding_adain_alone_changes_only_float_rounding", [SIMPLIFY, SNAKE_FOLD_ONLY], [SIMPLIFY], 0.0, 1e-4),
]
TOKENS = list(range(40, 80))


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.build import build
    from kokoro_opt.hashing import content_key
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.recipe import load_recipe, parse_recipe
    from kokoro_opt.runtime.session import SessionSettings
    from kokoro_opt.runtime.synth import Synthesizer

    console = Console(width=180)
    base = load_recipe(Path(__file__).parent.parent / "recipes" / "tiny.yaml").model_dump(mode="json", by_alias=True)
    root = Path(tempfile.mkdtemp(prefix="kokoro-opt-tolerances-"))

    def artifact(stages: list[dict]):
        recipe = parse_recipe({**base, "name": f"t-{content_key(stages)}", "stages": stages})
        return build(recipe, root, console=Console(quiet=True)).artifact

    table = Table(title="tiny-model test tolerances: share of the allclose tolerance used (margin = 1 / share)")
    for column in ("test", *(f"{t} thr" for t in THREADS), "worst margin"):
        table.add_column(column)
    for test, variant_stages, reference_stages, rtol, atol in PAIRS:
        variant, reference = artifact(variant_stages), artifact(reference_stages)
        shares = []
        for threads in THREADS:
            settings = SessionSettings(intra_op_num_threads=threads)
            a = Synthesizer(variant, settings).run_tokens(TOKENS, "tiny_0").audio
            b = Synthesizer(reference, settings).run_tokens(TOKENS, "tiny_0").audio
            shares.append(float(np.max(np.abs(a - b) / (atol + rtol * np.abs(b)))))
        table.add_row(test, *(f"{s:.3f}" for s in shares), f"{1 / max(shares):.1f}x" if max(shares) > 0 else "inf")
    console.print(describe(fingerprint()), highlight=False)
    console.print(table)


if __name__ == "__main__":
    main()
