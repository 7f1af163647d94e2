"""The compress stage: 8-bit storage of FP32 weights, exact on 8-bit grids, expanded by ORT at load."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from kokoro_opt.passes.compress import (
    compress_model,
    exact_codes,
    grid_codes,
    half_grid_codes,
    round_per_channel,
    sensitive_nodes,
)
from kokoro_opt.recipe import CompressStage
from kokoro_opt.runtime.synth import Synthesizer
from tests.test_passes import TOKENS, build_with


def on_grid(shape: tuple[int, ...], scale: float, low: int, high: int, seed: int = 0) -> np.ndarray:
    """What an INT8 release's weights look like after dequantization: (q - zp) * s in float32."""
    codes = np.random.default_rng(seed).integers(low, high + 1, size=shape)
    return (codes.astype(np.float64) * np.float64(np.float32(scale))).astype(np.float32)


@pytest.mark.parametrize(("low", "high"), [(-127, 127), (-64, 64), (-140, 115)])  # int8, 7-bit, asymmetric uint8
def test_grid_codes_reproduce_every_bit(low: int, high: int) -> None:
    weight = on_grid((64, 32, 3), 0.0123, low, high)
    codes, scale = grid_codes(weight)  # type: ignore[misc]
    assert codes.max() - codes.min() <= 255
    assert np.array_equal((codes * np.float64(scale)).astype(np.float32), weight)


@pytest.mark.parametrize(("low", "high", "scale"), [(-127, 127, 0.0123), (-140, 115, 0.031), (-127, 127, 3.1e-5), (-64, 64, 0.5)])
def test_an_fp16_rounded_grid_is_recovered_bit_for_bit(low: int, high: int, scale: float) -> None:
    """What the float16 converter makes of an INT8 release's weights: the FP32 grid rounded to FP16.
    Products near an FP16 rounding boundary (41 * 0.031 = 1.271) only round back with the exact scale."""
    weight = on_grid((64, 32, 3), scale, low, high).astype(np.float16)
    codes, found = half_grid_codes(weight)  # type: ignore[misc]
    assert codes.max() - codes.min() <= 255
    assert np.array_equal((codes * np.float64(found)).astype(np.float32).astype(np.float16), weight)
    assert half_grid_codes(np.random.default_rng(1).standard_normal((64, 64)).astype(np.float16)) is None


def test_floats_off_a_grid_are_not_taken_for_one() -> None:
    assert grid_codes(np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)) is None
    few = np.array([0.1, 0.25, 0.7071, -0.3333], np.float32)  # few values, but no common step
    assert grid_codes(few) is None


def test_each_lstm_direction_may_have_its_own_grid() -> None:
    weight = np.stack([on_grid((16, 8), 0.007, -64, 64, seed=2), on_grid((16, 8), 0.0091, -64, 64, seed=3)])
    assert grid_codes(weight) is None
    codes, scales = exact_codes(weight, (0, 1))  # type: ignore[misc]
    assert scales.shape == (2, 1, 1)
    assert np.array_equal((codes * scales.astype(np.float64)).astype(np.float32), weight)


def test_slices_on_grids_too_far_apart_for_one_8bit_window_are_not_exact() -> None:
    weight = np.stack([on_grid((16, 8), 0.01, -127, 127, seed=2), on_grid((16, 8), 0.01, 10, 250, seed=3)])
    assert exact_codes(weight, (0, 1)) is None


def test_rounding_is_per_output_channel() -> None:
    weight = np.random.default_rng(4).standard_normal((8, 4, 3)).astype(np.float32)
    weight[3] *= 1000  # one loud channel must not coarsen the others
    codes, scale = round_per_channel(weight, (0,))
    assert scale.shape == (8, 1, 1) and np.abs(codes).max() <= 127
    relative = np.abs(codes * scale - weight).max(axis=(1, 2)) / np.abs(weight).max(axis=(1, 2))
    assert relative.max() <= 0.5 / 127 + 1e-6


def _two_layer_model(w1: np.ndarray, w2: np.ndarray) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="/a/MatMul"),
            helper.make_node("MatMul", ["h", "w2"], ["y"], name="/b/MatMul"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, w1.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray, optimized: str | None = None) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if optimized:
        options.optimized_model_filepath = optimized
    return ort.InferenceSession(model.SerializeToString(), options).run(None, {"x": x})[0]


def test_compressed_model_is_exact_on_grids_smaller_and_folded_back_at_load(tmp_path) -> None:
    w1 = on_grid((256, 128), 0.01, -127, 127)  # exact
    w2 = np.random.default_rng(5).standard_normal((128, 256)).astype(np.float32)  # rounded
    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float32)
    model = _two_layer_model(w1, w2)
    before = model.ByteSize()
    reference = _run(model, x)
    stats = compress_model(model, CompressStage(kind="compress", min_elements=1000))
    assert (stats["exact"], stats["rounded"]) == (1, 1)
    assert model.ByteSize() < before / 3
    optimized = str(tmp_path / "folded.onnx")
    out = _run(model, x, optimized)
    # ONNX Runtime's constant folding turns the Cast/Mul chains back into FP32 initializers
    assert [n.op_type for n in onnx.load(optimized).graph.node] == ["MatMul", "MatMul"]
    np.testing.assert_allclose(out, reference, rtol=0.05, atol=0.05 * np.abs(reference).max())

    exact_only = _two_layer_model(w1, w2)
    stats = compress_model(exact_only, CompressStage(kind="compress", min_elements=1000, round_op_types=[]))
    assert (stats["exact"], stats["rounded"], stats["skipped_off_grid"]) == (1, 0, 1)
    assert np.array_equal(_run(exact_only, x), reference)


def test_fp16_weights_on_a_grid_are_stored_in_8_bits_and_folded_back_exactly(tmp_path) -> None:
    from onnx import TensorProto, helper

    weight = on_grid((256, 128), 0.0123, -127, 127).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="/a/MatMul")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float16)
    reference = _run(model, x)
    before = model.ByteSize()
    stats = compress_model(model, CompressStage(kind="compress", min_elements=1000))
    assert stats["exact"] == 1 and model.ByteSize() < before * 0.55
    optimized = str(tmp_path / "folded.onnx")
    assert np.array_equal(_run(model, x, optimized), reference)
    folded = onnx.load(optimized)  # the CPU provider computes FP16 MatMul in FP32: it adds casts of its own
    assert "Mul" not in {n.op_type for n in folded.graph.node}
    stored = numpy_helper.to_array(next(i for i in folded.graph.initializer if list(i.dims) == [256, 128]))
    assert np.array_equal(stored.astype(np.float16), weight) and np.array_equal(stored, weight.astype(stored.dtype))


def test_weights_of_sensitive_blocks_are_never_rounded() -> None:
    precision_map = {
        "nodes": {"/a/MatMul": "fp32", "/b/MatMul": "fp32"},
        "blocks": {"a": {"int8": False, "mean_pesq": 2.1}, "b": {"int8": False, "skipped": "below min_block_time_share"}},
    }
    protected = sensitive_nodes(precision_map)
    assert protected == {"/a/MatMul"}
    rng = np.random.default_rng(7)
    w1, w2 = (rng.standard_normal(shape).astype(np.float32) for shape in ((256, 128), (128, 256)))
    model = _two_layer_model(w1, w2)
    stats = compress_model(model, CompressStage(kind="compress", min_elements=1000), protected)
    assert (stats["rounded"], stats["skipped_off_grid"]) == (1, 1)
    assert "w1" in {i.name for i in model.graph.initializer}  # /a/MatMul keeps its FP32 weight


def test_compress_stage_on_the_tiny_kokoro(tiny_recipe, artifacts_root, tiny_artifact) -> None:
    result = build_with(tiny_recipe, artifacts_root, "t-compress", [{"kind": "compress", "min_elements": 4096}])
    record = result.artifact.build.stages[-1]
    assert record["weights"]["rounded"] > 0 and record["weights"]["mb_after"] < record["weights"]["mb_before"] / 3
    assert result.artifact.model_file.stat().st_size < tiny_artifact.model_file.stat().st_size
    test = Synthesizer(result.artifact).run_tokens(TOKENS, "tiny_0")
    reference = Synthesizer(tiny_artifact).run_tokens(TOKENS, "tiny_0")
    assert np.all(np.isfinite(test.audio)) and test.audio.shape == reference.audio.shape
    assert json.dumps(record["config"]) == json.dumps(
        {"kind": "compress", "min_elements": 4096, "round_op_types": ["Conv", "MatMul", "Gemm", "LSTM"]}
    )
