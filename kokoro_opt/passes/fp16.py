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
from kokoro_opt.passes.common import copy_runtime, stage_record
from kokoro_opt.recipe import Fp16Stage


def _restore_float_scales(model: Any) -> None:
    """The converter turns Constant nodes to FP16 even when their consumer is blocked; Resize's
    `scales` must stay float32 or the model does not load."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Resize" or len(node.input) < 3 or not node.input[2]:
            continue
        name = node.input[2]
        if name in initializers and initializers[name].data_type == onnx.TensorProto.FLOAT16:
            array = numpy_helper.to_array(initializers[name]).astype(np.float32)
            initializers[name].CopyFrom(numpy_helper.from_array(array, name))
        producer = producers.get(name)
        if producer is not None and producer.op_type == "Constant":
            for attr in producer.attribute:
                if attr.name == "value" and attr.t.data_type == onnx.TensorProto.FLOAT16:
                    attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32)))


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
    _restore_float_scales(model)
    onnx.save(model, str(out / "model.onnx"))
    return stage_record("fp16", cfg, out, started)
