"""ort stage: ONNX -> ORT format (.ort) with `onnxruntime.tools.convert_onnx_models_to_ort`.

.ort loads faster and is what ORT's mobile/minimal builds run; `required_operators.config` lists
the kernels a reduced build must keep. `Fixed` bakes the optimisations in for this build's
kernels; `Runtime` defers layout optimisations to load time (portable across EPs).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.passes.common import copy_runtime
from kokoro_opt.recipe import OrtFormatStage


def run_ort_format(source: Artifact, cfg: OrtFormatStage, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    copy_runtime(source, out)
    work = out / "convert"
    work.mkdir()
    shutil.copy2(source.model_file, work / "model.onnx")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxruntime.tools.convert_onnx_models_to_ort",
            str(work),
            "--optimization_style",
            cfg.optimization_style,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise UserError(
            f"ORT format conversion failed: {result.stderr.strip().splitlines()[-1:]}", "try optimization_style: Runtime"
        )
    produced = sorted(work.rglob("*.ort"))
    if not produced:
        raise UserError("ORT format conversion wrote no .ort file", "check the onnxruntime version")
    produced[0].rename(out / "model.ort")
    for config in work.rglob("required_operators*.config"):
        config.rename(out / config.name)
    shutil.rmtree(work)
    return {
        "stage": "ort",
        "config": cfg.model_dump(mode="json"),
        "size_mb": round((out / "model.ort").stat().st_size / 1e6, 2),
        "seconds": {"ort": round(time.perf_counter() - started, 2)},
    }


PASS = Pass("ort", OrtFormatStage, run_ort_format, version="1", libraries=("onnxruntime",))
