"""Deliberately broken exports: the proof that the export gate (validation.py) catches real breakage.

Each mutation takes a correct exported graph and returns a copy with one fault of the kind an
exporter or a hand edit can introduce. Tests and `benchmarks/export_margins.py` run the gate on
each and require it to fail; the margins doc reports how far each lands from the threshold.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper, numpy_helper


def _replace_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node reading `old` (subgraphs included: Loop bodies read outer names) reads `new`."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _replace_uses(attr.g, old, new)


def swap_style_halves(model: onnx.ModelProto) -> onnx.ModelProto:
    """style = [decoder half | predictor half]: swapped, as a wrong slice in an export wrapper would."""
    import numpy as np

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    _replace_uses(graph, "style", "style_swapped")
    graph.initializer.append(numpy_helper.from_array(np.array([128, 128], dtype=np.int64), "mut_split"))
    graph.node.insert(0, helper.make_node("Concat", ["style_b", "style_a"], ["style_swapped"], axis=1, name="mut_concat"))
    graph.node.insert(0, helper.make_node("Split", ["style", "mut_split"], ["style_a", "style_b"], axis=1, name="mut_split"))
    return out


def ignore_speed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`speed` replaced by a constant 1.0: the graph runs but every speed sounds the same."""
    import numpy as np

    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.initializer.append(numpy_helper.from_array(np.array([1.0], dtype=np.float32), "mut_speed_one"))
    _replace_uses(out.graph, "speed", "mut_speed_one")
    return out


def drop_one_adain_norm(model: onnx.ModelProto) -> onnx.ModelProto:
    """The first decoder InstanceNormalization bypassed: one AdaIN stops normalising."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    norm = next(n for n in graph.node if n.op_type == "InstanceNormalization" and "decoder" in n.name)
    _replace_uses(graph, norm.output[0], norm.input[0])
    graph.node.remove(norm)
    return out


def softmax_wrong_axis(model: onnx.ModelProto) -> onnx.ModelProto:
    """Attention softmax over the wrong axis: the opset-11 vs opset-13 meaning of Softmax's `axis`
    (coerce-to-2D vs one axis) mixed up, a classic opset-dependent export fault."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    softmaxes = [n for n in out.graph.node if n.op_type == "Softmax"]
    if not softmaxes:
        raise ValueError("the graph has no Softmax node")
    for node in softmaxes:
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("axis", 1))
    return out


MUTATIONS: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "style halves swapped": swap_style_halves,
    "speed ignored": ignore_speed,
    "one AdaIN norm dropped": drop_one_adain_norm,
    "softmax on the wrong axis": softmax_wrong_axis,
}
