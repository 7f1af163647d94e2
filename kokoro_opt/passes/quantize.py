"""quantize stage: dynamic INT8 (the kokoro-onnx peer), static per-channel QDQ INT8, and `mixed`.

All three go through `onnxruntime.quantization`; the static machinery and its calibration side
files are in passes.qdq, the measured choice of INT8 blocks in passes.sensitivity.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.passes.common import graph_summary
from kokoro_opt.passes.qdq import CALIBRATION_CORPUS, calibrate, private_input, quantize_static_qdq
from kokoro_opt.passes.sensitivity import SENSITIVITY_CORPUS, MixedDecisions, run_mixed
from kokoro_opt.recipe import QuantizeStage


def run_quantize(source: Artifact, cfg: QuantizeStage, out: Path, decisions: dict[str, Any] | None = None) -> dict[str, Any]:
    """`decisions`: mixed mode's locked choice of INT8 units and their ranges (locks.py), applied
    instead of measured."""
    started = time.perf_counter()
    record: dict[str, Any] = {"stage": "quantize", "config": cfg.model_dump(mode="json")}
    timings: dict[str, float] = {}
    if cfg.mode == "dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # kokoro-onnx's recipe: per-tensor uint8 weights for Conv/MatMul/LSTM/Gather, ranges at run time.
        with private_input(source.model_file, out / "model.onnx") as model_input:
            quantize_dynamic(
                str(model_input),
                str(out / "model.onnx"),
                weight_type=QuantType.QUInt8,
                per_channel=False,
                nodes_to_exclude=list(cfg.exclude_nodes) or None,
            )
    elif cfg.mode == "static":
        quantize_static_qdq(source.model_file, out / "model.onnx", cfg, calibrate(source, cfg, out, seconds=timings), None)
    else:
        mixed = run_mixed(source, cfg, out, lambda: calibrate(source, cfg, out, seconds=timings), decisions)
        calibration = mixed.pop("calibration")
        record["mixed"] = {**mixed, "calibration_from": "measured" if timings else "lock"}
        record["decisions"] = {"int8_units": mixed["int8_blocks"], "calibration": calibration}
        record["decision_scores"] = {"final_quality": record["mixed"]["final_quality"], "alone": record["mixed"]["alone_scores"]}
    record["graph"] = graph_summary(out / "model.onnx")
    record["seconds"] = {"quantize": round(time.perf_counter() - started, 2), "calibration": timings}
    return record


PASS = Pass(
    "quantize",
    QuantizeStage,
    run_quantize,
    reads=(CALIBRATION_CORPUS, SENSITIVITY_CORPUS),
    libraries=("onnx", "onnxruntime", "phonemizer-fork", "espeakng-loader"),
    decides=True,
    decisions_model=MixedDecisions,
    produces=("calibration.json", "output_ranges.json", "input_ranges.json", "precision_map.json"),
)
