"""INT8/FP16 mixed precision (`fallback_precision: fp16`) and the stock-op duration alignment, on the tiny model."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.evaluate.ep_support import coreml_partitioning
from kokoro_opt.onnx_graph import GraphIndex
from kokoro_opt.passes.fp16_islands import FP32_SCOPES, cast_target, convert_with_fp32_islands, fp32_exceptions
from kokoro_opt.recipe import parse_recipe
from kokoro_opt.runtime.synth import Synthesizer
from tests.test_passes import TINY_MIXED, TOKENS, build_with

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

SINE_PHASE = next(iter(FP32_SCOPES))


def _float_type(model: onnx.ModelProto, tensor: str) -> int | None:
    inferred = onnx.shape_inference.infer_shapes(model).graph
    for value in (*inferred.value_info, *inferred.input, *inferred.output):
        if value.name == tensor:
            return value.type.tensor_type.elem_type
    return None


def _initializer_types(model: onnx.ModelProto, node: onnx.NodeProto) -> set[int]:
    initializers = {i.name: i.data_type for i in model.graph.initializer}
    return {initializers[name] for name in node.input if name in initializers}


@pytest.fixture(scope="module")
def int8_fp16(tiny_recipe, artifacts_root):
    stage = {**TINY_MIXED, "op_types": ["Conv", "MatMul"], "min_block_time_share": 0.15, "fallback_precision": "fp16"}
    return build_with(tiny_recipe, artifacts_root, "t-int8-fp16", [{"kind": "simplify", "ort_level": "basic"}, stage]).artifact


def test_fp16_fallback_ships_fp16_blocks_beside_int8_ones(int8_fp16) -> None:
    precision = json.loads((int8_fp16.path / "precision_map.json").read_text())
    counts = Counter(precision["nodes"].values())
    assert set(counts) <= {"int8", "fp16", "fp32"} and counts["int8"] and counts["fp16"]
    exceptions = precision["fp32_exceptions"]
    assert all(exceptions[n] for n, p in precision["nodes"].items() if p == "fp32"), "an FP32 node without its reason"
    model = onnx.load(str(int8_fp16.model_file))
    nodes = {n.name: n for n in model.graph.node}
    index = GraphIndex(model)
    half_weights = 0
    for name, precision_of in precision["nodes"].items():
        node = nodes[name]
        if precision_of == "fp16":  # the block really is FP16: its weights are (attention's MatMuls have none)
            assert _initializer_types(model, node) <= {onnx.TensorProto.FLOAT16}, name
            half_weights += bool(_initializer_types(model, node))
        elif precision_of == "int8":  # fed by DequantizeLinear of an int8 weight
            assert index.producer[node.input[1]].op_type == "DequantizeLinear", name
    assert half_weights
    # graph inputs and outputs keep their types; the audio is finite and the durations are the fp32 model's
    assert model.graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    out = Synthesizer(int8_fp16).run_tokens(TOKENS, "tiny_0")
    assert np.all(np.isfinite(out.audio)) and len(out.durations) == len(TOKENS) + 2


def test_sine_phase_stays_fp32_without_round_trips(tiny_artifact) -> None:
    """SineGen's tensors stay FP32 from node to node: its running phase reaches ~1e4 rad, where FP16's
    spacing is 8 rad. The converter's FP32 -> FP16 -> FP32 round trips between kept nodes are gone."""
    model = onnx.load(str(tiny_artifact.model_file))
    kept = fp32_exceptions(model)
    phase_sum = next(n for n in model.graph.node if n.name.startswith(SINE_PHASE) and n.op_type == "CumSum")
    assert kept.get(phase_sum.name)
    half, _ = convert_with_fp32_islands(model, set(kept))
    index = GraphIndex(half)
    cumsum = next(n for n in half.graph.node if n.name == phase_sum.name)
    assert _float_type(half, cumsum.input[0]) == onnx.TensorProto.FLOAT
    assert index.producer[cumsum.input[0]].name in kept  # straight from the SineGen node before it

    for node in half.graph.node:
        first = index.producer.get(node.input[0]) if cast_target(node) == onnx.TensorProto.FLOAT else None
        if cast_target(first) == onnx.TensorProto.FLOAT16:
            assert getattr(index.producer.get(first.input[0]), "name", None) not in kept, f"round trip at {node.name}"


def test_fp16_fallback_needs_mixed_mode_and_no_snake_polynomial(tiny_recipe) -> None:
    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name="t-bad", stages=[{"kind": "quantize", "mode": "static", "fallback_precision": "fp16"}])
    with pytest.raises(UserError, match="fallback_precision 'fp16' needs mode 'mixed'"):
        parse_recipe(data)
    data.update(stages=[{"kind": "snake"}, {"kind": "quantize", "mode": "mixed", "fallback_precision": "fp16"}])
    with pytest.raises(UserError, match="cannot follow stage 'snake'"):
        parse_recipe(data)


def test_stock_alignment_exports_no_loop_same_output_fewer_coreml_partitions(tiny_recipe, artifacts_root, tiny_artifact) -> None:
    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name="t-stock", export={**data["export"], "alignment": "stock"})
    from kokoro_opt.build import build

    stock = build(parse_recipe(data), artifacts_root).artifact
    ops = Counter(n.op_type for n in onnx.load(str(stock.model_file)).graph.node)
    assert not {"Loop", "SplitToSequence", "SequenceAt"} & set(ops) and ops["CumSum"]
    for tokens in (TOKENS, TOKENS[:2], TOKENS * 6):
        a = Synthesizer(stock).run_tokens(tokens, "tiny_0")
        b = Synthesizer(tiny_artifact).run_tokens(tokens, "tiny_0")
        np.testing.assert_array_equal(a.durations, b.durations)
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5 * max(1.0, float(np.abs(b.audio).max())))
    loop_parts, stock_parts = (coreml_partitioning(x.model_file)[0] for x in (tiny_artifact, stock))
    assert stock_parts.partitions < loop_parts.partitions and stock_parts.node_share > loop_parts.node_share
