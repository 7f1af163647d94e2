"""Per-channel lookup tables for the elementwise chains between two INT8 convolutions.

In the windowed generator (kokoro_opt/passes/windows_split.py) every AdaIN normalizes with fed statistics.
So between a resblock's two INT8 convolutions the whole chain

    DequantizeLinear -> the norm (Mul, Add) -> the Snake polynomial (8 passes) -> QuantizeLinear

is, within one run, a fixed function of each channel's input level: 256 levels in, 256 out. `tabulate`
runs that very chain on a [1, C, 256] tensor of every level, which makes the table, and
replaces the ~12 passes over the activations with a Cast and a GatherElements. Nothing is
approximated: each output is what the chain gives its input level (tests/test_int8_lookup.py).
Measured on the windowed int8-mixed: an 80-step window in 0.85-0.89x the time at 1, 2 and 4 threads
(`benchmarks/generator_variants.py`, docs/serving.md). The tables depend on the job's style and
statistics alone, so kokoro_opt/passes/hoisting.py computes them once per job.

In the whole model the norms compute their statistics from the activations themselves, so the chain
is not a fixed function there and nothing is rewritten.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kokoro_opt.onnx_graph import GraphIndex, dependent_tensors, replace_nodes

ELEMENTWISE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Neg",
    "Abs",
    "Sin",
    "Cos",
    "Floor",
    "Round",
    "Clip",
    "LeakyRelu",
    "Relu",
    "Tanh",
    "Sigmoid",
}
LEVELS = 256


def chain_from(index: GraphIndex, dq: Any, moving: set[str]) -> tuple[list[Any], Any] | None:
    """(elementwise nodes in graph order, the QuantizeLinear they end in) after the DequantizeLinear `dq`,
    if its output reaches exactly one QuantizeLinear through elementwise nodes alone, each reading
    nothing else that moves with time (per-channel vectors like a norm's gain are fine)."""
    region: dict[int, Any] = {}
    ends: dict[int, Any] = {}
    inside = {dq.output[0]}
    frontier = [dq.output[0]]
    while frontier:
        for node in index.consumers.get(frontier.pop(), []):
            if id(node) in region or id(node) in ends:
                continue
            if node.op_type == "QuantizeLinear" and node.input[0] in inside:
                ends[id(node)] = node
            elif node.op_type in ELEMENTWISE:
                region[id(node)] = node
                inside.update(node.output)
                frontier.extend(node.output)
            else:
                return None
    if len(ends) != 1 or not region:
        return None
    (end,) = ends.values()
    if any(x in moving for node in [*region.values(), end] for x in node.input if x and x not in inside):
        return None
    if any(out.name in inside for out in index.graph.output):
        return None
    order = {id(n): i for i, n in enumerate(index.graph.node)}
    return sorted(region.values(), key=lambda n: order[id(n)]), end


def _copy(node: Any, inputs: list[str], outputs: list[str], name: str) -> Any:
    from onnx import helper

    return helper.make_node(
        node.op_type,
        inputs,
        outputs,
        name=name,
        domain=node.domain,
        **{a.name: helper.get_attribute_value(a) for a in node.attribute},
    )


def conv_channels(index: GraphIndex, q: str) -> int | None:
    """Channels of `q` when it is a quantized convolution's output (QuantizeLinear <- Conv <- a weight,
    possibly through its DequantizeLinear): known from the weight, without running anything."""
    quantize = index.producer.get(q)
    conv = index.producer.get(quantize.input[0]) if quantize is not None and quantize.op_type == "QuantizeLinear" else None
    if conv is None or conv.op_type != "Conv" or len(conv.input) < 2:
        return None
    weight = index.producer.get(conv.input[1])
    name = weight.input[0] if weight is not None and weight.op_type == "DequantizeLinear" else conv.input[1]
    init = index.initializers.get(name)
    return int(init.dims[0]) if init is not None and len(init.dims) >= 1 else None


def _table_nodes(
    dq: Any, chain: list[Any], end: Any, prefix: str, dtype: np.dtype, channels: int | None
) -> tuple[list[Any], list[Any]]:
    """(nodes, initializers) that run the chain on every level of each channel and look the input up.
    With `channels` known the grid is a constant, so the table depends on the job's inputs alone and
    kokoro_opt/passes/hoisting.py computes it once per job; otherwise it takes the channel count from the input."""
    from onnx import TensorProto, helper, numpy_helper

    levels = np.arange(LEVELS, dtype=np.uint8).view(dtype).reshape(1, 1, LEVELS)  # entry i: the level i reads as
    q = dq.input[0]
    if channels is not None:
        inits = [numpy_helper.from_array(np.repeat(levels, channels, axis=1), prefix + "grid")]
        nodes = []
    else:
        inits = [
            numpy_helper.from_array(levels, prefix + "levels"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), prefix + "one"),
            numpy_helper.from_array(np.array([LEVELS], dtype=np.int64), prefix + "width"),
        ]
        nodes = [  # every level, for each of q's channels
            helper.make_node("Shape", [q], [prefix + "channels"], name=prefix + "channels", start=1, end=2),
            helper.make_node(
                "Concat",
                [prefix + "one", prefix + "channels", prefix + "width"],
                [prefix + "shape"],
                name=prefix + "shape",
                axis=0,
            ),
            helper.make_node("Expand", [prefix + "levels", prefix + "shape"], [prefix + "grid"], name=prefix + "grid"),
        ]
    renamed = {q: prefix + "grid"}
    for node in [dq, *chain, end]:  # the chain itself, on the grid: the table
        renamed.update({out: prefix + out for out in node.output})
        nodes.append(
            _copy(
                node,
                [renamed.get(x, x) for x in node.input],
                [renamed[out] for out in node.output],
                prefix + (node.name or node.output[0]),
            )
        )
    nodes += [
        helper.make_node("Cast", [q], [prefix + "index"], name=prefix + "index", to=TensorProto.INT32),
        helper.make_node(
            "GatherElements", [renamed[end.output[0]], prefix + "index"], [end.output[0]], name=prefix + "lookup", axis=2
        ),
    ]
    return nodes, inits


def tabulate(model: Any, activations: list[str]) -> int:
    """Replace each DequantizeLinear -> elementwise -> QuantizeLinear chain with a per-channel table
    computed in the run (see the module's docstring), in place; `activations` are the graph inputs with
    a time axis. Returns how many chains were replaced."""
    from onnx import numpy_helper

    index = GraphIndex(model)
    moving = dependent_tensors(model, activations)
    replaced: dict[str, list[Any]] = {}
    new_inits: list[Any] = []
    for dq in list(model.graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] in index.initializers:
            continue
        zero_point = index.initializers.get(dq.input[2]) if len(dq.input) > 2 else None
        if zero_point is None:
            continue
        dtype = numpy_helper.to_array(zero_point).dtype
        found = chain_from(index, dq, moving) if dtype in (np.uint8, np.int8) else None
        if found is None:
            continue
        chain, end = found
        nodes, inits = _table_nodes(dq, chain, end, f"{dq.name or dq.output[0]}/table/", dtype, conv_channels(index, dq.input[0]))
        new_inits += inits
        replaced[dq.output[0]] = []
        replaced.update({node.output[0]: [] for node in chain})
        replaced[end.output[0]] = nodes  # where the chain ended: everything it reads is computed by then
    model.graph.initializer.extend(new_inits)
    # every initializer is still read, by the tables: dropping none avoids copying all the weights
    # (+34 MB at a windowed server's start)
    replace_nodes(model, replaced, drop_unused=False)
    return sum(1 for nodes in replaced.values() if nodes)
