"""The windowed generator's job-invariant part, computed once per job instead of once per window.

Within one job the generator's style vector and its normalization statistics are fixed, so everything
computed from them alone is the same in every window: the AdaIN gains and shifts, the Snake
constants folded into them, the per-channel lookup tables of kokoro_opt/passes/int8_lookup.py. In one graph
ONNX Runtime recomputes all of it for every window (about 800 of the ~1,700 nodes a window runs).
`hoist` cuts the generator in two:

- `constants`: (the style, the statistics) -> those tensors, run when a job starts;
- `window`: the window's features, F0 and phase plus those tensors -> audio.

The same nodes compute the same values; only where they run changes (tests/test_windows.py checks the
audio against the uncut generator). Nodes that read weights alone (a weight's DequantizeLinear) stay
with their readers, so ONNX Runtime still fuses them into its INT8 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kokoro_opt.onnx_graph import cut, dependent_tensors, node_reads


@dataclass(frozen=True)
class Hoisted:
    constants: Any  # ModelProto: the job inputs -> `names`
    window: Any  # ModelProto: the moving inputs, the job inputs it reads directly, `names` -> its outputs
    names: tuple[str, ...]  # the job's constants, in the order `constants` outputs them


def hoist(model: Any, moving: list[str], job: list[str]) -> Hoisted:
    """Cut `model` into the part computed from the `job` inputs alone and the rest (see the module docstring)."""
    import onnx

    varies = dependent_tensors(model, moving)
    per_job = dependent_tensors(model, job) - varies
    window_reads = {t for node in model.graph.node if set(node.output) & varies for t in node_reads(node)}
    names = [out for node in model.graph.node for out in node.output if out in per_job and out in window_reads]
    if not names:
        raise KeyError(f"nothing in the graph is computed from {job} alone")
    constants = cut(model, job, names, names)
    typed = onnx.shape_inference.infer_shapes(constants)
    types = {v.name: v.type for v in [*typed.graph.output, *typed.graph.value_info]}
    unknown = [n for n in names if n not in types or not types[n].tensor_type.elem_type]
    if unknown:  # e.g. after an op that ONNX's shape inference does not know
        raise KeyError(f"the element type of {unknown[0]}")
    direct = [name for name in job if name in window_reads]
    outputs = [o.name for o in model.graph.output]
    window = cut(model, [*moving, *direct, *names], outputs, outputs)
    for value in window.graph.input:
        if value.name in types:
            value.type.CopyFrom(types[value.name])
    merge_shared_gemms(constants)
    return Hoisted(constants, window, tuple(names))


def merge_shared_gemms(model: Any) -> None:
    """Gemms reading the same input, each with constant weights and bias, as one Gemm over the weights side by
    side and a Split: the per-job part's 48 AdaIN projections of one style vector. Each output is the same dot
    product over the same input, and one node runs in place of dozens (ONNX Runtime folds the concatenated
    weights at load)."""
    import onnx
    from onnx import helper, numpy_helper

    from kokoro_opt.onnx_graph import sort_topologically

    g = model.graph
    biases = {init.name: init for init in g.initializer if len(init.dims) == 1}
    varying = dependent_tensors(model, [i.name for i in g.input])  # a weight must be made of constants alone
    typed = onnx.shape_inference.infer_shapes(model).graph.value_info
    rows = {v.name: v.type.tensor_type.shape.dim[0].dim_value for v in typed if len(v.type.tensor_type.shape.dim) == 2}
    rows |= {init.name: init.dims[0] for init in g.initializer if len(init.dims) == 2}
    groups: dict[str, list[Any]] = {}
    for node in g.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
        if node.op_type != "Gemm" or len(node.input) != 3 or not plain or attrs.get("transB") != 1:
            continue
        weight, bias = node.input[1], biases.get(node.input[2])
        if bias is not None and weight not in varying and rows.get(weight) == bias.dims[0]:  # a bias per output row
            groups.setdefault(node.input[0], []).append(node)
    merged = {node.output[0] for nodes in groups.values() if len(nodes) > 1 for node in nodes}
    added = []
    for source, nodes in groups.items():
        if len(nodes) < 2:
            continue
        p = f"{source}/merged_gemm/"
        g.initializer.append(
            numpy_helper.from_array(np.array([biases[n.input[2]].dims[0] for n in nodes], dtype=np.int64), p + "sizes")
        )
        added += [
            helper.make_node("Concat", [n.input[1] for n in nodes], [p + "weight"], name=p + "weight", axis=0),
            helper.make_node("Concat", [n.input[2] for n in nodes], [p + "bias"], name=p + "bias", axis=0),
            helper.make_node("Gemm", [source, p + "weight", p + "bias"], [p + "out"], name=p + "gemm", transB=1),
            helper.make_node("Split", [p + "out", p + "sizes"], [n.output[0] for n in nodes], name=p + "split", axis=1),
        ]
    if added:
        kept = [node for node in g.node if node.op_type != "Gemm" or node.output[0] not in merged]
        del g.node[:]
        g.node.extend(kept + added)
        sort_topologically(g)
