"""An FP16 graph with FP32 islands: the fp16 stage, and the quantize stage's `fallback_precision: fp16`.

The INT8 nodes and the ops that must stay FP32 are kept out of ONNX Runtime's float16 converter;
everything else turns FP16. Three things make that work on Kokoro (measured, docs/stages.md):

- Convert *before* quantizing. Converting a QDQ graph puts FP16 round trips inside DequantizeLinear
  -> Conv -> QuantizeLinear, which breaks the QDQ fusion and overflows FP16 on equalized Conv outputs.
- Type the tensors of the kept nodes. The converter inserts casts only around tensors it has a type
  for; an untyped one silently stays FP16 and the island is not FP32.
- Remove the converter's FP32 -> FP16 -> FP32 round trips between two kept nodes. SineGen's running
  phase reaches ~1e4 rad, where FP16's spacing is 8 rad: through a round trip the voice is gone.

The kept nodes read and write renamed tensors afterwards (`x_cast_to_fp32`, `y_cast_to_fp16`), so
the calibration ranges measured on the FP32 model are copied under the new names (`renamed_calibration`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kokoro_opt.onnx_graph import GraphIndex, outer_names, read_names, subgraphs
from kokoro_opt.passes.qdq import CalibrationFiles, quantize_static_qdq
from kokoro_opt.recipe import QuantizeStage

# Kept FP32 in an INT8/FP16 model, with the reason the precision map records.
FP32_SCOPES = {
    "/decoder/generator/m_source/": "SineGen's running phase (~1e4 rad) needs FP32 spacing",
}
FP32_OPS = {
    "Range": "index arithmetic",
    "Loop": "duration alignment (index arithmetic)",
    "If": "shape-dependent control flow",
    "Resize": "its scales input must stay float32",
    "CumSum": "running sums lose FP16 precision",
}


def restore_float_scales(model: Any) -> None:
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


def _rename_input(graph: Any, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for sub in subgraphs(node):
            _rename_input(sub, old, new)


def pin_blocked_subgraphs(model: Any, blocked: set[str], inferred: Any) -> list[str]:
    """Keep the FP32 subgraphs of blocked If/Loop nodes consistent with the FP16 graph around them.

    The converter leaves a blocked node's subgraph FP32 but only casts the node's *inputs*: a tensor the
    subgraph reads from the outer scope (Kokoro's If around the F0/N projections reads the Conv outputs)
    turns FP16 under it, and an output without value_info gets no cast back to FP16, so the model does
    not load unless onnxsim folded those Ifs first. Each such float tensor gets an explicit Cast to FP32
    (returned: the converter must block those Casts too, or it rewrites them to FP16) and the node's
    float outputs get their value_info, so the converter casts them to FP16 for their consumers.
    `inferred`: the model's graph after ONNX shape inference.
    """
    import onnx
    from onnx import helper

    graph = model.graph
    reads = {
        i: set().union(*map(outer_names, subs))
        for i, n in enumerate(graph.node)
        if n.op_type in blocked and (subs := list(subgraphs(n)))
    }
    if not any(reads.values()):
        return []
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
            for sub in subgraphs(node):
                _rename_input(sub, name, casts[name].output[0])
        if pinned:
            graph.value_info.extend(v for v in float_values if v.name in node.output and v.name not in typed)
    if not casts:  # e.g. a Loop reading only sequences: the converter handles it, leave the graph as it was
        return []
    nodes = [new for i, node in enumerate(graph.node) for new in (*before.get(i, []), node)]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return [cast.name for cast in casts.values()]


def fp32_exceptions(model: Any) -> dict[str, str]:
    """Node name -> why it stays FP32, for the nodes of FP32_SCOPES and FP32_OPS."""
    kept = {}
    for node in model.graph.node:
        scope = next((reason for prefix, reason in FP32_SCOPES.items() if node.name.startswith(prefix)), None)
        reason = scope or FP32_OPS.get(node.op_type)
        if reason and node.name:
            kept[node.name] = reason
    return kept


def _type_tensors(model: Any, nodes: set[str], inferred: Any) -> None:
    """value_info for every float tensor a kept node reads or writes, so the converter casts around it
    (`inferred`: the model's graph after ONNX shape inference)."""
    import onnx

    known = {v.name: v for v in (*inferred.value_info, *inferred.output)}
    typed = {v.name for v in model.graph.value_info}
    wanted = {t for n in model.graph.node if n.name in nodes for t in (*n.input, *n.output) if t}
    model.graph.value_info.extend(
        known[t] for t in sorted(wanted - typed) if t in known and known[t].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    )


def cast_target(node: Any) -> int | None:
    """The element type a Cast node casts to; None for any other node (or no node)."""
    if node is None or node.op_type != "Cast":
        return None
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _drop_round_trips(model: Any, fp32_nodes: set[str]) -> int:
    """Cast(FP32->FP16) -> Cast(FP16->FP32) pairs behind a kept node (whose float outputs are FP32):
    the second cast's readers read the kept node's output instead."""
    import onnx

    index = GraphIndex(model)
    dropped, emptied = set(), {}
    for node in model.graph.node:
        first = index.producer.get(node.input[0]) if cast_target(node) == onnx.TensorProto.FLOAT else None
        if first is None or cast_target(first) != onnx.TensorProto.FLOAT16:
            continue
        if getattr(index.producer.get(first.input[0]), "name", None) not in fp32_nodes:
            continue
        for reader, position in index.uses(node.output[0]):
            reader.input[position] = first.input[0]
        dropped.add(id(node))
        emptied[first.output[0]] = id(first)
    kept = [n for n in model.graph.node if id(n) not in dropped]
    read = read_names(kept, model.graph.output)
    dropped |= {node_id for tensor, node_id in emptied.items() if tensor not in read}  # FP16 copies nobody reads now
    kept = [n for n in model.graph.node if id(n) not in dropped]
    removed = len(model.graph.node) - len(kept)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return removed


def convert_with_fp32_islands(model: Any, fp32_nodes: set[str]) -> tuple[Any, dict[str, str]]:
    """(the FP16 model with `fp32_nodes` kept FP32, original tensor name -> the name a kept node now
    reads or writes instead). Graph inputs and outputs keep their types."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    before = {n.name: (list(n.input), list(n.output)) for n in model.graph.node if n.name in fp32_nodes}
    inferred = onnx.shape_inference.infer_shapes(model).graph  # one inference for both uses below
    _type_tensors(model, fp32_nodes, inferred)
    blocked_ops = {n.op_type for n in model.graph.node if n.name in fp32_nodes}
    pinned = pin_blocked_subgraphs(model, blocked_ops & {"If", "Loop"}, inferred)
    model = convert_float_to_float16(
        model, keep_io_types=True, op_block_list=[], node_block_list=sorted(fp32_nodes | set(pinned)), disable_shape_infer=True
    )
    restore_float_scales(model)
    _drop_round_trips(model, fp32_nodes | set(pinned))
    renames = {}
    for node in model.graph.node:
        if node.name in before:
            inputs, outputs = before[node.name]
            now = [*node.input, *node.output]
            renames.update({old: new for old, new in zip([*inputs, *outputs], now, strict=True) if old != new})
    return model, renames


def renamed_calibration(calibration: CalibrationFiles, renames: dict[str, str], folder: Path) -> CalibrationFiles:
    """The calibration side files copied into `folder` with every renamed tensor's entry also under its new name."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = CalibrationFiles(folder)
    for source, target in (
        (calibration.ranges, copy.ranges),
        (calibration.output_ranges, copy.output_ranges),
        (calibration.input_ranges, copy.input_ranges),
    ):
        if not source.exists():
            continue
        content = json.loads(source.read_text(encoding="utf-8"))
        table = content["data"] if source == calibration.ranges else content
        table.update({new: table[old] for old, new in renames.items() if old in table})
        target.write_text(json.dumps(content), encoding="utf-8")
    return copy


def quantize_in_fp16(
    source: Path,
    target: Path,
    cfg: QuantizeStage,
    calibration: CalibrationFiles,
    int8_nodes: list[str],
    clips: dict[str, float],
) -> dict[str, str]:
    """`target`: `source` in FP16 with `int8_nodes` quantized (static QDQ) and the FP32 exceptions kept;
    returns the exceptions (node -> reason). The calibration stays in the FP32 model's names."""
    import onnx

    model = onnx.load(str(source))
    exceptions = fp32_exceptions(model)
    half, renames = convert_with_fp32_islands(model, set(int8_nodes) | set(exceptions))
    if not int8_nodes:
        onnx.save(half, str(target))
        return exceptions
    scratch = target.parent / f".{target.stem}-fp16"
    scratch.mkdir(exist_ok=True)
    try:
        onnx.save(half, str(scratch / "model.onnx"))
        del half, model
        renamed = renamed_calibration(calibration, renames, scratch)
        quantize_static_qdq(
            scratch / "model.onnx",
            target,
            cfg,
            renamed,
            None,
            nodes_to_quantize=int8_nodes,
            clips={renames.get(t, t): p for t, p in clips.items()},
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return exceptions
