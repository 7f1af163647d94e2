"""Optimisation stages after export: each a config class (in recipe.py) and one function.

Every runner has the signature `run(input_artifact, stage_config, output_folder) -> stage record`
and writes a self-contained artifact folder (model + voices.npz + kokoro.json).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.passes.compress import run_compress
from kokoro_opt.passes.fp16 import run_fp16
from kokoro_opt.passes.ort_format import run_ort_format
from kokoro_opt.passes.quantize import run_quantize
from kokoro_opt.passes.simplify import run_simplify
from kokoro_opt.passes.smooth import run_smooth
from kokoro_opt.passes.snake import run_snake


def _run_coreml(source: Artifact, cfg: Any, out: Path) -> dict[str, Any]:
    from kokoro_opt.passes.coreml import run_coreml  # coremltools is an optional, slow import

    return run_coreml(source, cfg, out)


RUNNERS: dict[str, Callable[[Artifact, Any, Path], dict[str, Any]]] = {
    "simplify": run_simplify,
    "smooth": run_smooth,
    "snake": run_snake,
    "quantize": run_quantize,
    "compress": run_compress,
    "fp16": run_fp16,
    "ort": run_ort_format,
    "coreml": _run_coreml,
}
