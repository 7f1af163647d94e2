"""fp16 stage: a whole-model FP16 copy for targets that run FP16 natively (CoreML/GPU EPs).

ORT's own converter (onnxruntime.transformers.float16) is used: onnxconverter_common's breaks
Kokoro's Loop subgraph (Cast type mismatch). Phase-sensitive ops (Sin/Cos/CumSum of SineGen, the
Loop, Range) stay FP32 through the block list; inputs/outputs keep their types.
On a CPU without native FP16 this artifact is slower than fp32: it is built for other targets.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.passes.common import copy_runtime, graph_summary
from kokoro_opt.recipe import Fp16Stage


def run_fp16(source: Artifact, cfg: Fp16Stage, out: Path) -> dict[str, Any]:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    started = time.perf_counter()
    copy_runtime(source, out)
    model = convert_float_to_float16(
        onnx.load(str(source.model_file)),
        keep_io_types=True,
        op_block_list=list(cfg.op_block_list),
        disable_shape_infer=True,
    )
    onnx.save(model, str(out / "model.onnx"))
    return {
        "stage": "fp16",
        "config": cfg.model_dump(mode="json"),
        "graph": graph_summary(out / "model.onnx"),
        "seconds": {"fp16": round(time.perf_counter() - started, 2)},
    }
