"""simplify stage: onnxsim or onnxslim (optional), then ORT's offline graph optimisation saved to disk.

Measured on Kokoro-82M's fp32 export (4,783 nodes, 325 MB; docs/stages.md): onnxsim 0.8 -> 2,214
nodes, 325 MB in 6 s; onnxslim -> 2,154 nodes but 568 MB (it duplicates ALBERT's shared layer
weights across the 12 unrolled layers) in 40 s. Neither changed inference speed: ORT applies the
same folding at session load. The recipes therefore use ORT `basic` only (exact, 1 s); the tools
stay selectable. ORT's `all` level is not offered: its layout transforms are tied to this CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.passes.common import graph_summary
from kokoro_opt.recipe import SimplifyStage
from kokoro_opt.runtime.session import GRAPH_LEVELS


def ort_optimize(source: Path, target: Path, level: str) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_LEVELS[level])
    options.optimized_model_filepath = str(target)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])


# A wrong constant target breaks the audio (or the run); float noise between the two graphs is ~1e-6
STATIC_RESHAPE_MAX_DRIFT = 1e-3


def _static_reshapes(source: Artifact, model_file: Path) -> dict[str, Any]:
    """Constant Reshape targets in `model_file`, checked against the graph before on real sentences."""
    import onnx

    from kokoro_opt.passes.qdq import calibration_feeds
    from kokoro_opt.passes.static_shapes import output_drift, static_reshapes

    model = onnx.load(str(model_file))
    done: dict[str, Any] = static_reshapes(model)
    checked = model_file.with_name("static.onnx")
    onnx.save(model, str(checked))
    done["drift"] = output_drift(model_file, checked, calibration_feeds(source, 2))
    if not done["drift"] <= STATIC_RESHAPE_MAX_DRIFT:
        checked.unlink()
        raise UserError(
            f"static_reshapes changed the model's output (relative drift {done['drift']:.2g})",
            "set static_reshapes: false in the simplify stage",
        )
    checked.replace(model_file)
    return done


def run_simplify(source: Artifact, cfg: SimplifyStage, out: Path) -> dict[str, Any]:
    import onnx

    started = time.perf_counter()
    before = graph_summary(source.model_file)
    current = source.model_file
    if cfg.tool == "onnxslim":
        import onnxslim

        onnx.save(onnxslim.slim(onnx.load(str(current))), str(out / "slim.onnx"))
        current = out / "slim.onnx"
    elif cfg.tool == "onnxsim":
        from onnxsim import simplify

        simplified, ok = simplify(onnx.load(str(current)))
        if not ok:
            raise UserError("onnxsim could not validate the simplified graph", "use simplify.tool: none")
        onnx.save(simplified, str(out / "slim.onnx"))
        current = out / "slim.onnx"
    if cfg.ort_level != "disabled":
        ort_optimize(current, out / "model.onnx", cfg.ort_level)
        if current != source.model_file:
            current.unlink()
    elif current == source.model_file:
        onnx.save(onnx.load(str(current)), str(out / "model.onnx"))
    else:
        current.rename(out / "model.onnx")
    static: dict[str, int] = {}
    if cfg.static_reshapes:
        static = _static_reshapes(source, out / "model.onnx")
    return {
        "stage": "simplify",
        "config": cfg.model_dump(mode="json"),
        **({"static_reshapes": static} if static else {}),
        "before": {"nodes": before["nodes"], "size_mb": before["size_mb"]},
        "graph": graph_summary(out / "model.onnx"),
        "seconds": {"simplify": round(time.perf_counter() - started, 2)},
    }


PASS = Pass("simplify", SimplifyStage, run_simplify, libraries=("onnx", "onnxruntime", "onnxsim", "onnxslim"))
