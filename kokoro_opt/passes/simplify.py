"""simplify stage: onnxslim, then ONNX Runtime's offline graph optimisation saved to disk.

onnxslim is used rather than onnxsim: onnxsim's full constant folding/shape inference has to
reason through Kokoro's data-dependent duration expansion and the LSTM's Loop/If subgraphs, while
onnxslim folds what it can and leaves dynamic parts alone (see docs/stages.md for measurements).
ORT's level is `basic` or `extended` for a portable file: `all` adds layout transforms tied to this CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.passes.common import copy_runtime, graph_summary
from kokoro_opt.recipe import SimplifyStage

_LEVELS = {"disabled": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def ort_optimize(source: Path, target: Path, level: str) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
    options.optimized_model_filepath = str(target)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])


def run_simplify(source: Artifact, cfg: SimplifyStage, out: Path) -> dict[str, Any]:
    import onnx

    copy_runtime(source, out)
    started = time.perf_counter()
    before = graph_summary(source.model_file)
    current = source.model_file
    if cfg.tool == "onnxslim":
        import onnxslim

        slimmed = onnxslim.slim(onnx.load(str(current)))
        onnx.save(slimmed, str(out / "slim.onnx"))
        current = out / "slim.onnx"
    if cfg.ort_level != "disabled":
        ort_optimize(current, out / "model.onnx", cfg.ort_level)
        if current != source.model_file:
            current.unlink()
    elif current == source.model_file:
        onnx.save(onnx.load(str(current)), str(out / "model.onnx"))
    else:
        current.rename(out / "model.onnx")
    return {
        "stage": "simplify",
        "config": cfg.model_dump(mode="json"),
        "before": {"nodes": before["nodes"], "size_mb": before["size_mb"]},
        "graph": graph_summary(out / "model.onnx"),
        "seconds": {"simplify": round(time.perf_counter() - started, 2)},
    }
