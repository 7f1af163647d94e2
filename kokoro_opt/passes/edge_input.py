"""The graph side of edge capping: the `edge_keep` input the `edges` stage adds (kokoro_opt/runtime/edges.py
feeds it). With it the decoder's frame inputs are cut to a few frames of the edge silence; unfed, its default
keeps every frame."""

from __future__ import annotations

from typing import Any

import numpy as np

from kokoro_opt.onnx_graph import sort_topologically
from kokoro_opt.runtime.edges import EDGE_INPUT, KEEP_ALL

PREFIX = "/edges/"

# The decoder's frame-rate inputs, found by the names torch's exporter gives them (kept by every stage).
ASR_CONSUMER = "/decoder/asr_res/asr_res.0/Conv"  # input 0: the aligned text features
FRAME_PRODUCERS = ("/decoder/F0_conv/Conv", "/decoder/N_conv/Conv")  # output 0: F0 and energy at frame rate
SOURCE_CONSUMER = "/decoder/generator/noise_convs.0/Conv"  # input 0: the harmonic source's STFT
DURATIONS = "durations"


def has_edge_input(model: Any) -> bool:
    return any(init.name == EDGE_INPUT for init in model.graph.initializer)


def float_source(tensor: str, producers: dict[str, Any]) -> str:
    """Through a QuantizeLinear -> DequantizeLinear pair (an INT8 consumer) back to the float tensor."""
    node = producers.get(tensor)
    if node is not None and node.op_type == "DequantizeLinear":
        quant = producers.get(node.input[0])
        if quant is not None and quant.op_type == "QuantizeLinear":
            return str(quant.input[0])
    return tensor


def anchors(model: Any) -> dict[str, str]:
    """{'asr', 'f0', 'energy', 'source'} -> tensor name; a KeyError names the node that is missing."""
    by_name = {node.name: node for node in model.graph.node}
    producers = {out: node for node in model.graph.node for out in node.output}
    missing = [n for n in (ASR_CONSUMER, *FRAME_PRODUCERS, SOURCE_CONSUMER) if n not in by_name]
    if missing or DURATIONS not in producers:
        raise KeyError(", ".join(missing) or DURATIONS)
    return {
        "asr": float_source(by_name[ASR_CONSUMER].input[0], producers),
        "f0": by_name[FRAME_PRODUCERS[0]].output[0],
        "energy": by_name[FRAME_PRODUCERS[1]].output[0],
        "source": float_source(by_name[SOURCE_CONSUMER].input[0], producers),
    }


def _int64(name: str, values: list[int]) -> Any:
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def add_edge_input(model: Any) -> dict[str, str]:
    """Add `edge_keep` and the slicing it drives to `model` in place; returns the sliced tensors."""
    from onnx import TensorProto, helper

    found = anchors(model)
    g = model.graph
    p = PREFIX

    def n(op: str, inputs: list[str], name: str, **attrs: Any) -> Any:
        return helper.make_node(op, inputs, [p + name], name=p + name, **attrs)

    constants = [
        _int64(p + "zero", [0]),
        _int64(p + "one", [1]),
        _int64(p + "two", [2]),
        _int64(p + "big", [KEEP_ALL]),
        _int64(p + "axis", [2]),
        _int64(EDGE_INPUT, [KEEP_ALL, KEEP_ALL, 1]),
    ]
    nodes = [
        # removed_lead = max(durations[0] - lead, 0)
        n("Gather", [DURATIONS, p + "zero"], "first"),
        n("Gather", [EDGE_INPUT, p + "zero"], "lead"),
        n("Sub", [p + "first", p + "lead"], "lead_excess"),
        n("Max", [p + "lead_excess", p + "zero"], "removed_lead"),
        # removed_trail = max(sum(durations[-trail_tokens:]) - trail, 0), leaving at least one frame
        n("Gather", [EDGE_INPUT, p + "one"], "trail"),
        n("Gather", [EDGE_INPUT, p + "two"], "trail_tokens"),
        n("Neg", [p + "trail_tokens"], "trail_start"),
        n("Slice", [DURATIONS, p + "trail_start", p + "big", p + "zero"], "last_durations"),
        n("ReduceSum", [p + "last_durations", p + "zero"], "last_frames", keepdims=1),
        n("Sub", [p + "last_frames", p + "trail"], "trail_excess"),
        n("Max", [p + "trail_excess", p + "zero"], "trail_wanted"),
        n("ReduceSum", [DURATIONS, p + "zero"], "frames", keepdims=1),
        n("Sub", [p + "frames", p + "removed_lead"], "after_lead"),
        n("Sub", [p + "after_lead", p + "one"], "trail_room"),
        n("Min", [p + "trail_wanted", p + "trail_room"], "removed_trail"),
        # the harmonic source has `rate` STFT frames per decoder frame, plus one (centred STFT)
        n("Shape", [found["source"]], "rate_shape"),
        n("Gather", [p + "rate_shape", p + "two"], "rate_frames"),
        n("Sub", [p + "rate_frames", p + "one"], "rate_span"),
        n("Div", [p + "rate_span", p + "frames"], "rate"),
    ]
    sliced = {}
    for key, tensor in found.items():
        lead, trail = p + "removed_lead", p + "removed_trail"
        if key == "source":
            nodes += [n("Mul", [lead, p + "rate"], "source_lead"), n("Mul", [trail, p + "rate"], "source_trail")]
            lead, trail = p + "source_lead", p + "source_trail"
        nodes += [
            n("Shape", [tensor], f"{key}_shape"),
            n("Gather", [p + f"{key}_shape", p + "two"], f"{key}_length"),
            n("Sub", [p + f"{key}_length", trail], f"{key}_end"),
            n("Slice", [tensor, lead, p + f"{key}_end", p + "axis"], f"{key}_kept"),
        ]
        sliced[tensor] = p + f"{key}_kept"
    for node in g.node:
        for i, name in enumerate(node.input):
            if name in sliced:
                node.input[i] = sliced[name]
    g.node.extend(nodes)
    g.initializer.extend(constants)
    g.input.append(helper.make_tensor_value_info(EDGE_INPUT, TensorProto.INT64, [3]))
    sort_topologically(g)
    return sliced
