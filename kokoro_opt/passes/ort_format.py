"""ort stage: ONNX -> ORT format (.ort) with `onnxruntime.tools.convert_onnx_models_to_ort`.

.ort loads faster and is what ORT's mobile/minimal builds run; `required_operators.config` lists
the kernels a reduced build must keep. `Fixed` bakes the optimisations in for this build's
kernels; `Runtime` defers layout optimisations to load time (portable across EPs). The windowed
graphs of a `windows` stage before it are converted too, so the artifact still streams windowed.
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
from kokoro_opt.recipe import OrtFormatStage
from kokoro_opt.runtime.fused import FUSED_DIR
from kokoro_opt.runtime.windowed import WINDOWS_DIR


def convert(models: list[Path], work: Path, cfg: OrtFormatStage) -> dict[str, Path]:
    """Each ONNX file in `models` (distinct names) converted in `work`: its stem -> its .ort file."""
    work.mkdir()
    for model in models:
        shutil.copy2(model, work / model.name)
    result = subprocess.run(
        [
            sys.executable,
            "-P",  # the current folder off the import path: a file of the user's named like a module would shadow it
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
    produced = {p.name.split(".")[0]: p for p in work.rglob("*.ort")}  # "model.ort", "model.with_runtime_opt.ort"
    missing = [m.name for m in models if m.stem not in produced]
    if missing:
        raise UserError(f"ORT format conversion wrote no .ort file for {missing[0]}", "check the onnxruntime version")
    return produced


def run_ort_format(source: Artifact, cfg: OrtFormatStage, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    work = out / "convert"
    convert([source.model_file], work, cfg)["model"].rename(out / "model.ort")
    for config in work.rglob("required_operators*.config"):
        config.rename(out / config.name)
    shutil.rmtree(work)
    windows = source.path / WINDOWS_DIR
    if windows.is_dir():  # the windowed graphs, converted alike; the rest of the folder as it is
        graphs = sorted(windows.glob("*.onnx"))
        (out / WINDOWS_DIR).mkdir()
        for stem, converted in convert(graphs, work, cfg).items():
            converted.rename(out / WINDOWS_DIR / f"{stem}.ort")
        shutil.rmtree(work)
        for other in windows.iterdir():
            if other.suffix != ".onnx":
                shutil.copy2(other, out / WINDOWS_DIR / other.name)
    return {
        "stage": "ort",
        "config": cfg.model_dump(mode="json"),
        "size_mb": round((out / "model.ort").stat().st_size / 1e6, 2),
        "seconds": {"ort": round(time.perf_counter() - started, 2)},
    }


PASS = Pass(
    "ort",
    OrtFormatStage,
    run_ort_format,
    libraries=("onnxruntime",),
    produces=("required_operators*.config", WINDOWS_DIR),
    consumes=(WINDOWS_DIR,),
    # the fused generator's segments stay ONNX: its native kernels need a full ONNX Runtime build anyway
    carries=(FUSED_DIR,),
    keeps=("edges", "windowed", "fused"),  # the same graphs in another format: inputs, windows and fused alike
)
