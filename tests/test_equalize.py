"""Conv output equalization: quiet output channels survive the per-tensor output requantization."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kokoro_opt.passes.equalize import channel_ranges
from kokoro_opt.passes.qdq import CalibrationFiles, quantize_static_qdq
from kokoro_opt.recipe import QuantizeStage
from tests.test_passes import build_with, runs

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

GAINS = np.array([100.0, 30.0, 1.0, 0.3, 0.1, 0.03, 1.0, 10.0], np.float32)  # output channel loudness


def conv_then_residual(path: Path) -> Path:
    """x -> Conv (8 channels, loudness spread 3000x) -> + x: a resblock's convs2 in miniature."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((8, 8, 3)) * GAINS[:, None, None] / 8).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1], name="/block/convs2.0/Conv"),
            helper.make_node("Add", ["x", "y"], ["out"], name="/block/Add"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, "T"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array((GAINS * 0.01).astype(np.float32), "b")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def quantize(source: Path, out: Path, equalize: bool, feeds: list[dict[str, np.ndarray]], activation: str) -> Path:
    cfg = QuantizeStage(kind="quantize", mode="static", op_types=["Conv"], equalize_outputs=equalize, activation_type=activation)
    files = CalibrationFiles(out.parent / f"calibration-{equalize}")
    files.folder.mkdir(exist_ok=True)
    if equalize:
        channel_ranges(source, feeds, files.output_ranges)
    quantize_static_qdq(source, out, cfg, files, feeds)
    return out


def run(model: Path, x: np.ndarray, optimized: Path | None = None) -> np.ndarray:
    options = ort.SessionOptions()
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("activation", ["uint8", "int8"])
def test_equalized_outputs_keep_quiet_channels_and_still_fuse(tmp_path: Path, activation: str) -> None:
    source = conv_then_residual(tmp_path / "fp32.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": (rng.standard_normal((1, 8, 400)) * 0.01).astype(np.float32)} for _ in range(4)]
    plain = quantize(source, tmp_path / "plain.onnx", False, feeds, activation)
    equalized = quantize(source, tmp_path / "equalized.onnx", True, feeds, activation)

    # Inside the calibrated ranges: equalization trades every channel's headroom for resolution, so
    # values beyond a channel's calibrated range clip (the real model's score includes that).
    x = feeds[0]["x"]
    reference = run(source, x) - x  # the conv's own contribution, per channel
    error = {name: np.abs(run(model, x) - x - reference).max(axis=(0, 2)) for name, model in
             (("plain", plain), ("equalized", equalized))}  # fmt: skip
    quiet = GAINS < 0.5
    assert error["equalized"][quiet].max() < error["plain"][quiet].max() / 10
    assert error["equalized"].max() <= error["plain"].max() * 1.5  # the loud channels lose nothing much

    dequant = [n for n in onnx.load(str(equalized)).graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("y")]
    assert [a.i for n in dequant for a in n.attribute if a.name == "axis"] == [1]
    zero_points = [i for i in onnx.load(str(equalized)).graph.initializer if i.name.endswith("_eq_zero_point")]
    assert [z.data_type for z in zero_points] == [TensorProto.UINT8 if activation == "uint8" else TensorProto.INT8]

    def fused(model: Path) -> bool:
        run(model, x, optimized=tmp_path / "optimized.onnx")
        return "QLinearConv" in {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}

    # ORT fuses uint8 x int8 everywhere (int8 x int8 only where its kernels allow): equalized as plain
    assert fused(equalized) == fused(plain) and (fused(equalized) or activation == "int8")


def test_equalize_on_the_tiny_kokoro(tiny_recipe, artifacts_root) -> None:
    stage = {"kind": "quantize", "mode": "static", "calibration_sentences": 2, "equalize_outputs": True,
             "exclude_nodes": ["/decoder/generator/conv_post/Conv"]}  # fmt: skip
    result = build_with(tiny_recipe, artifacts_root, "t-equalize", [stage])
    assert (result.artifact.path / "output_ranges.json").is_file()
    model = onnx.load(str(result.artifact.model_file))
    per_channel = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[1].endswith("_eq_channel_scale")]
    assert len(per_channel) > 10
    runs(result.artifact)
