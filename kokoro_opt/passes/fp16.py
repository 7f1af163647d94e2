"""fp16 stage: a whole-model FP16 copy for targets that run FP16 natively (CoreML/GPU EPs).

ORT's own converter (onnxruntime.transformers.float16) is used: onnxconverter_common's breaks
Kokoro's Loop subgraph (Cast type mismatch). SineGen's phase and the index arithmetic stay FP32 as
islands (passes.fp16_islands, the same conversion as quantize's `fallback_precision: fp16`), listed
with the reason in precision_map.json; inputs/outputs keep their types.
On a CPU without native FP16 this artifact is slower than fp32: it is built for other targets.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.passes.common import stage_record
from kokoro_opt.passes.fp16_islands import convert_with_fp32_islands, fp32_exceptions
from kokoro_opt.recipe import Fp16Stage


def run_fp16(source: Artifact, cfg: Fp16Stage, out: Path) -> dict[str, Any]:
    import onnx

    started = time.perf_counter()
    model = onnx.load(str(source.model_file))
    kept = fp32_exceptions(model)
    listed = {n.name: f"op_block_list: {n.op_type}" for n in model.graph.node if n.op_type in cfg.op_block_list}
    kept.update({name: reason for name, reason in listed.items() if name})
    model, _ = convert_with_fp32_islands(model, set(kept))
    onnx.save(model, str(out / "model.onnx"))
    (out / "precision_map.json").write_text(json.dumps({"fp32_exceptions": kept}, indent=1), encoding="utf-8")
    return stage_record("fp16", cfg, out, started, fp32_nodes=len(kept))


PASS = Pass("fp16", Fp16Stage, run_fp16, libraries=("onnx", "onnxruntime"), produces=("precision_map.json",))
