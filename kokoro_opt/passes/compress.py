"""compress stage: store the large FP32 (or FP16) weights as 8-bit integers, expanded at load.

Only the file shrinks. A weight `w` becomes `Cast(int8 codes) [-> Add(offset)] -> Mul(scale)`,
producing a tensor named `w` again, so its consumers do not change. ONNX Runtime's constant folding
(every optimisation level from `basic` up) turns that chain back into an FP32 initializer when the
session is created, so compute, weight prepacking and speed stay those of FP32. By contrast,
`DequantizeLinear` on a weight is not folded and would run on every inference.

A weight that already sits on an 8-bit grid (weights rebuilt from an INT8 release do) is stored
exactly: the expansion reproduces every float bit. Other weights of the ops in `round_op_types`
are rounded to a symmetric per-output-channel int8 grid; the final evaluation scores the result
against fp32. The default leaves ConvTranspose out: rounding the generator's upsamplers alone
costs ~0.2 PESQ, while rounding text-side weights is inaudible.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.onnx_graph import GraphIndex
from kokoro_opt.passes.common import stage_record
from kokoro_opt.recipe import CompressStage

# Which input of each op is a weight, and along which axes its output channels run (scales vary there).
WEIGHT_INPUTS: dict[str, dict[int, tuple[int, ...]]] = {
    "Conv": {1: (0,)},
    "ConvTranspose": {1: (1,)},
    "MatMul": {1: (-1,)},
    "Gemm": {1: (-1,)},  # transB=1 turns this into axis 0, see _channel_axes
    "LSTM": {1: (0, 1), 2: (0, 1)},
    "GRU": {1: (0, 1), 2: (0, 1)},
}


def grid_codes(values: np.ndarray) -> tuple[np.ndarray, np.float32] | None:
    """Integer codes k and a float32 scale s with float32(k * s) == values bit for bit, k spanning at
    most 256 consecutive integers; None when the values are not on such a grid."""
    unique = np.unique(values)
    if unique.size > 256:
        return None
    nonzero = unique[unique != 0]
    if nonzero.size == 0:
        return np.zeros(values.shape, np.int32), np.float32(1.0)
    gaps = np.diff(unique)
    smallest = np.float64(gaps.min()) if gaps.size else np.float64(np.abs(nonzero).min())
    codes = np.rint(unique.astype(np.float64) / smallest)
    if codes.max() - codes.min() > 255:
        return None
    anchor = int(np.argmax(np.abs(codes)))
    estimate = np.float32(unique[anchor] / codes[anchor])
    for step in range(-4, 5):  # the stored scale is within a few ulps of the estimate
        scale = np.float32(estimate + step * np.spacing(estimate))
        if np.array_equal((codes * np.float64(scale)).astype(np.float32), unique):
            return np.rint(values.astype(np.float64) / np.float64(scale)).astype(np.int32), scale
    return None


def half_grid_codes(values: np.ndarray) -> tuple[np.ndarray, np.float32] | None:
    """For FP16 `values` that are an 8-bit grid rounded to FP16 (an FP32 grid the float16 converter
    rounded): codes k and a float32 scale s with float16(float32(k * s)) == values bit for bit.

    The step is read where FP16 is finest, between the values nearest zero; that fixes every value's
    code, and each code then bounds the scale: k * s must round to that FP16 value. The scale is the
    middle of what all codes allow."""
    exact = values.astype(np.float64)
    unique = np.unique(exact)
    nonzero = np.sort(np.abs(unique[unique != 0]))
    if unique.size > 256 or nonzero.size == 0:
        return grid_codes(values.astype(np.float32)) if nonzero.size == 0 else None
    near_zero = np.unique(np.concatenate([-nonzero[:8], nonzero[:8]]))
    step = float(np.diff(near_zero).min()) if near_zero.size > 1 else float(nonzero[0])
    codes = np.rint(unique / float(np.sum(np.rint(unique / step) * unique) / np.sum(np.rint(unique / step) ** 2)))
    half = unique.astype(np.float16)
    below = (unique + np.nextafter(half, np.float16(-np.inf)).astype(np.float64)) / 2  # what rounds to `half`
    above = (unique + np.nextafter(half, np.float16(np.inf)).astype(np.float64)) / 2
    used = codes != 0
    bounds = np.sort(np.stack([below[used] / codes[used], above[used] / codes[used]]), axis=0)
    low, high = float(bounds[0].max()), float(bounds[1].min())
    if low > high:
        return None
    scale = np.float32((low + high) / 2)
    codes = np.rint(exact / np.float64(scale))
    if codes.max() - codes.min() > 255:
        return None
    if not np.array_equal((codes * np.float64(scale)).astype(np.float32).astype(np.float16), values):
        return None
    return codes.astype(np.int32), scale


def exact_codes(
    weight: np.ndarray, axes: tuple[int, ...], grid: Callable[[np.ndarray], Any] = grid_codes
) -> tuple[np.ndarray, np.ndarray] | None:
    """`grid` (grid_codes, or half_grid_codes for FP16) for the whole tensor, else one grid per slice
    along each channel axis in turn (an LSTM stores each direction on its own grid); scales come back
    broadcastable to `weight`."""
    whole = grid(weight)
    if whole is not None:
        return whole[0], np.asarray(whole[1], np.float32)
    for axis in (a % weight.ndim for a in axes):
        slices = [grid(np.take(weight, i, axis=axis)) for i in range(weight.shape[axis])]
        if any(found is None for found in slices):
            continue
        codes = np.stack([found[0] for found in slices], axis=axis)  # type: ignore[index]
        shape = [1] * weight.ndim
        shape[axis] = weight.shape[axis]
        scales = np.array([found[1] for found in slices], np.float32).reshape(shape)  # type: ignore[index]
        if codes.max() - codes.min() <= 255:  # one 8-bit window for all slices, or not exact
            return codes, scales
    return None


def _channel_axes(node: Any, index: int) -> tuple[int, ...]:
    axes = WEIGHT_INPUTS[node.op_type][index]
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i == 1 for a in node.attribute):
        return (0,)
    return axes


def round_per_channel(weight: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes and float32 scales (broadcastable to `weight`), one scale per output channel."""
    keep = {a % weight.ndim for a in axes}
    reduce = tuple(i for i in range(weight.ndim) if i not in keep)
    peak = np.abs(weight).max(axis=reduce, keepdims=True).astype(np.float32)
    scale = np.where(peak > 0, peak / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint(weight / scale), -127, 127).astype(np.int32)
    return codes, scale


def _expansion(name: str, codes: np.ndarray, scale: np.ndarray, half: bool = False) -> tuple[list[Any], list[Any]]:
    """Nodes and initializers that rebuild float32 `name` (float16 with `half`) from 8-bit codes."""
    from onnx import TensorProto, helper, numpy_helper

    if half:  # the float32 product, then the same rounding to FP16 the float16 converter made
        nodes, inits = _expansion(f"{name}_f32", codes, scale)
        return [*nodes, helper.make_node("Cast", [f"{name}_f32"], [name], to=TensorProto.FLOAT16, name=f"{name}_q8_half")], inits
    low, high = int(codes.min()), int(codes.max())
    nodes, inits = [], []
    if high - low > 255:  # per-slice grids that do not share one 256-code window
        raise ValueError(f"{name}: codes span {low}..{high}")
    if low >= -128 and high <= 127:
        inits.append(numpy_helper.from_array(codes.astype(np.int8), f"{name}_q8"))
        nodes.append(helper.make_node("Cast", [f"{name}_q8"], [f"{name}_q8f"], to=TensorProto.FLOAT, name=f"{name}_q8_cast"))
        scaled_input = f"{name}_q8f"
    else:  # an asymmetric grid: uint8 codes plus an offset, still exact
        inits.append(numpy_helper.from_array((codes - low).astype(np.uint8), f"{name}_q8"))
        inits.append(numpy_helper.from_array(np.array(low, np.float32), f"{name}_q8_offset"))
        nodes.append(helper.make_node("Cast", [f"{name}_q8"], [f"{name}_q8c"], to=TensorProto.FLOAT, name=f"{name}_q8_cast"))
        nodes.append(helper.make_node("Add", [f"{name}_q8c", f"{name}_q8_offset"], [f"{name}_q8f"], name=f"{name}_q8_add"))
        scaled_input = f"{name}_q8f"
    inits.append(numpy_helper.from_array(np.asarray(scale, np.float32), f"{name}_q8_scale"))
    nodes.append(helper.make_node("Mul", [scaled_input, f"{name}_q8_scale"], [name], name=f"{name}_q8_mul"))
    return nodes, inits


def sensitive_nodes(precision_map: dict[str, Any]) -> set[str]:
    """Nodes of blocks the sensitivity analysis measured and kept at higher precision: their
    weights are only ever stored exactly, never rounded."""
    from kokoro_opt.passes.sensitivity import block_of

    failed = {b for b, row in precision_map.get("blocks", {}).items() if not row.get("int8") and "skipped" not in row}
    return {n for n in precision_map.get("nodes", {}) if block_of(n) in failed}


def compress_model(model: Any, cfg: CompressStage, protected: Collection[str] = ()) -> dict[str, Any]:
    """Rewrite `model` in place; returns what was stored how (counts and megabytes).
    Weights used by a `protected` node are stored exactly or left FP32, never rounded."""
    from onnx import TensorProto, numpy_helper

    index = GraphIndex(model)
    graph_inputs = {i.name for i in model.graph.input}
    new_nodes: list[Any] = []
    kept, new_inits = [], []
    stats = {"exact": 0, "rounded": 0, "skipped_off_grid": 0, "mb_before": 0.0, "mb_after": 0.0, "max_relative_error": 0.0}
    for init in model.graph.initializer:
        uses = index.uses(init.name)
        half = init.data_type == TensorProto.FLOAT16
        weight_use = (
            init.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
            and init.name not in graph_inputs
            and uses
            and all(n.op_type in WEIGHT_INPUTS and i in WEIGHT_INPUTS[n.op_type] for n, i in uses)
        )
        size = int(np.prod(init.dims)) if init.dims else 1
        if not weight_use or size < cfg.min_elements:
            kept.append(init)
            continue
        weight = numpy_helper.to_array(init)
        axes = _channel_axes(*uses[0])
        found = exact_codes(weight, axes, half_grid_codes if half else grid_codes)
        if found is not None:
            codes, scale = found
            stats["exact"] += 1
        elif uses[0][0].op_type in cfg.round_op_types and not any(n.name in protected for n, _ in uses):
            codes, scale = round_per_channel(weight.astype(np.float32), axes)
            error = np.abs(codes * scale - weight).max() / max(float(np.abs(weight).max()), 1e-12)
            stats["max_relative_error"] = max(stats["max_relative_error"], float(error))
            stats["rounded"] += 1
        else:
            stats["skipped_off_grid"] += 1
            kept.append(init)
            continue
        nodes, inits = _expansion(init.name, codes, scale, half)
        new_nodes.extend(nodes)
        new_inits.extend(inits)
        stats["mb_before"] += size * (2 if half else 4) / 1e6
        stats["mb_after"] += sum(len(i.raw_data) for i in inits) / 1e6
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes + nodes)  # producers first: the graph stays topologically sorted
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()}


# The quantize stage's record of what it chose travels on with the compressed model.
CARRIED = ("precision_map.json", "calibration.json")


def run_compress(source: Artifact, cfg: CompressStage, out: Path) -> dict[str, Any]:
    import onnx

    started = time.perf_counter()
    protected: set[str] = set()
    if (source.path / "precision_map.json").exists():
        protected = sensitive_nodes(json.loads((source.path / "precision_map.json").read_text(encoding="utf-8")))
    model = onnx.load(str(source.model_file))
    stats = compress_model(model, cfg, protected)
    onnx.save(model, str(out / "model.onnx"))
    return stage_record("compress", cfg, out, started, weights=stats)


PASS = Pass(
    "compress",
    CompressStage,
    run_compress,
    libraries=("onnx",),
    consumes=("precision_map.json",),  # its FP32 nodes are the ones whose weights may be rounded
    carries=CARRIED,  # node names and precisions stay: only how weights are stored changes
    keeps=("edges",),
)
