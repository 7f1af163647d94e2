"""fp16 stage: a whole-model FP16 copy for targets that run FP16 natively (CoreML/GPU EPs).

ORT's own converter (onnxruntime.transformers.float16) is used: onnxconverter_common's breaks
Kokoro's Loop subgraph (Cast type mismatch). Phase-sensitive ops (Sin/Cos/CumSum of SineGen, the
Loop, Range) stay FP32 through the block list; inputs/outputs keep their types.
On a CPU without native FP16 this artifact is slower than fp32: it is built for other targets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
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


def _subgraphs(node: Any) -> Iterator[Any]:
    import onnx

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _outer_names(graph: Any) -> set[str]:
    """Names a subgraph reads from the scopes around it (not its inputs, initializers or node outputs)."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(name for name in node.input if name)
        for sub in _subgraphs(node):
            used |= _outer_names(sub)
        defined.update(node.output)
    return used - defined


def _rename_input(graph: Any, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for sub in _subgraphs(node):
            _rename_input(sub, old, new)


def _pin_blocked_subgraphs(model: Any, blocked: set[str]) -> list[str]:
    """Keep the FP32 subgraphs of blocked If/Loop nodes consistent with the FP16 graph around them.

    The converter leaves a blocked node's subgraph FP32 but only casts the node's *inputs*: a tensor the
    subgraph reads from the outer scope (Kokoro's If around the F0/N projections reads the Conv outputs)
    turns FP16 under it, and an output without value_info gets no cast back to FP16, so the model does
    not load unless onnxsim folded those Ifs first. Each such float tensor gets an explicit Cast to FP32
    (returned: the converter must block those Casts too, or it rewrites them to FP16) and the node's
    float outputs get their value_info, so the converter casts them to FP16 for their consumers.
    """
    import onnx
    from onnx import helper

    graph = model.graph
    reads = {
        i: set().union(*map(_outer_names, subs))
        for i, n in enumerate(graph.node)
        if n.op_type in blocked and (subs := list(_subgraphs(n)))
    }
    if not any(reads.values()):
        return []
    inferred = onnx.shape_inference.infer_shapes(model).graph
    float_values = [v for v in (*inferred.value_info, *inferred.output) if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    floats = {v.name for v in float_values} | {
        i.name for i in inferred.initializer if i.data_type == onnx.TensorProto.FLOAT
    }  # graph inputs stay FP32 (keep_io_types): nothing to pin
    typed = {v.name for v in graph.value_info}
    casts: dict[str, Any] = {}
    before: dict[int, list[Any]] = {}
    for i, node in enumerate(graph.node):
        pinned = sorted(reads.get(i, set()) & floats)
        for name in pinned:
            if name not in casts:  # one Cast per tensor, before its first reader
                cast_name = f"{name}_fp32_for_subgraph"
                casts[name] = helper.make_node("Cast", [name], [cast_name], to=onnx.TensorProto.FLOAT, name=cast_name)
                before.setdefault(i, []).append(casts[name])
            for sub in _subgraphs(node):
                _rename_input(sub, name, casts[name].output[0])
        if pinned:
            graph.value_info.extend(v for v in float_values if v.name in node.output and v.name not in typed)
    if not casts:  # e.g. a Loop reading only sequences: the converter handles it, leave the graph as it was
        return []
    nodes = [new for i, node in enumerate(graph.node) for new in (*before.get(i, []), node)]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return [cast.name for cast in casts.values()]


def run_fp16(source: Artifact, cfg: Fp16Stage, out: Path) -> dict[str, Any]:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    started = time.perf_counter()
    copy_runtime(source, out)
    model = onnx.load(str(source.model_file))
    pinned = _pin_blocked_subgraphs(model, set(cfg.op_block_list))
    model = convert_float_to_float16(
        model,
        keep_io_types=True,
        op_block_list=list(cfg.op_block_list),
        node_block_list=pinned,
        disable_shape_infer=True,
    )
    _restore_float_scales(model)
    onnx.save(model, str(out / "model.onnx"))
    return stage_record("fp16", cfg, out, started)


PASS = Pass("fp16", Fp16Stage, run_fp16, version="2", libraries=("onnx", "onnxruntime"))
