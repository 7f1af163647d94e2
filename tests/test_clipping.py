"""Input clipping: a tighter range for a Conv input whose rare peaks would cost everything else resolution."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from kokoro_opt.passes.clipping import input_ranges
from kokoro_opt.passes.qdq import CalibrationFiles, quantize_static_qdq
from kokoro_opt.recipe import QuantizeStage
from tests.test_equalize import conv_then_residual


def peaky_feeds(count: int) -> list[dict[str, np.ndarray]]:
    """Unit-scale signal with one sample in 10,000 at 50x: the resblocks.5 Snake output in miniature."""
    rng = np.random.default_rng(2)
    feeds = []
    for _ in range(count):
        x = rng.standard_normal((1, 8, 4000)).astype(np.float32)
        peaks = rng.random(x.shape) < 1e-4
        x[peaks] = 50.0 * np.sign(x[peaks])
        feeds.append({"x": x})
    return feeds


def input_scale(model: Path) -> float:
    graph = onnx.load(str(model)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    q = next(n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    return float(inits[q.input[1]])


def test_clipped_input_range_trades_the_peaks_for_resolution(tmp_path: Path) -> None:
    source = conv_then_residual(tmp_path / "fp32.onnx")
    feeds = peaky_feeds(3)
    cfg = QuantizeStage(kind="quantize", mode="mixed", op_types=["Conv"], calibrate_method="MinMax")
    files = CalibrationFiles(tmp_path)
    quantize_static_qdq(source, tmp_path / "plain.onnx", cfg, files, feeds)
    input_ranges(source, ["/block/convs2.0/Conv"], feeds, [99.9], files.input_ranges)
    quantize_static_qdq(source, tmp_path / "clipped.onnx", cfg, files, None, clips={"x": 99.9})

    low, high = json.loads(files.input_ranges.read_text())["x"]["99.9"]
    assert -5 < low < -2 and 2 < high < 5  # the peaks are outside the cut
    assert input_scale(tmp_path / "clipped.onnx") == np.float32((high - low) / 255)
    assert input_scale(tmp_path / "plain.onnx") > 10 * input_scale(tmp_path / "clipped.onnx")
    lowest = json.loads(files.ranges.read_text())["data"]["x"]["lowest"]
    assert np.min(lowest["data"] if isinstance(lowest, dict) else lowest) <= -50  # the shared cache keeps the full range
