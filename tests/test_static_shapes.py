"""Constant Reshape targets (the simplify stage's `static_reshapes`): exact, and fewer Core ML partitions."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.evaluate.ep_support import coreml_partitioning
from kokoro_opt.passes.static_shapes import constant_target
from kokoro_opt.recipe import parse_recipe
from kokoro_opt.runtime.synth import Synthesizer
from tests.test_passes import TOKENS, build_with

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast


def test_constant_target_keeps_symbolic_axes_and_infers_at_most_one() -> None:
    assert constant_target([1, "tokens", 768], [1, "tokens", 12, 64]) == [1, 0, 12, 64]
    assert constant_target([1, "tokens", 12, 64], [1, "tokens", 768]) == [1, 0, 768]
    assert constant_target(["b", "tokens", 768], ["tokens", "b", 768]) is None  # two axes move: undetermined
    assert constant_target([1, 512, "frames"], [1, 512, "2*frames"]) == [1, 512, -1]
    assert constant_target([1, "tokens"], [1, None]) is None  # an axis the inference could not name


def test_static_reshapes_remove_shape_arithmetic_and_keep_the_audio(tiny_recipe, artifacts_root) -> None:
    stock = tiny_recipe.model_copy(update={"export": tiny_recipe.export.model_copy(update={"alignment": "stock"})})
    plain = build_with(stock, artifacts_root, "t-reshape-plain", [{"kind": "simplify"}]).artifact
    static = build_with(stock, artifacts_root, "t-reshape-static", [{"kind": "simplify", "static_reshapes": True}]).artifact
    record = static.build.stages[-1]["static_reshapes"]
    assert record["reshapes"] > 10 and record["nodes_removed"] > 0 and record["drift"] < 1e-5
    graph = onnx.load(str(static.model_file)).graph
    constants = {i.name for i in graph.initializer}
    assert (
        sum(n.op_type == "Reshape" and n.input[1] not in constants for n in graph.node)
        < sum(n.op_type == "Reshape" for n in onnx.load(str(plain.model_file)).graph.node) - record["reshapes"] + 1
    )
    for tokens in (TOKENS, TOKENS[:1], TOKENS * 8):  # other lengths than the stage checked
        a, b = (Synthesizer(x).run_tokens(tokens, "tiny_0") for x in (plain, static))
        np.testing.assert_array_equal(a.durations, b.durations)
        np.testing.assert_allclose(b.audio, a.audio, atol=1e-5 * max(1.0, float(np.abs(a.audio).max())))
    before, after = (coreml_partitioning(x.model_file)[0] for x in (plain, static))
    assert after.partitions < before.partitions


def test_static_reshapes_need_the_stock_alignment(tiny_recipe) -> None:
    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name="t-bad", stages=[{"kind": "simplify", "static_reshapes": True}])
    with pytest.raises(UserError, match=r"static_reshapes needs export\.alignment: stock"):
        parse_recipe(data)


def test_the_stage_check_catches_a_wrong_target(tiny_recipe, artifacts_root, tmp_path) -> None:
    """The drift check the stage runs (limit 1e-3; a correct rewrite measured 0.0 at 1, 2 and 4
    threads on the real weights) fails on a target with two axes swapped (scrambled data, or a graph
    ONNX Runtime rejects)."""
    from onnx import numpy_helper

    from kokoro_opt.passes.qdq import calibration_feeds
    from kokoro_opt.passes.simplify import STATIC_RESHAPE_MAX_DRIFT
    from kokoro_opt.passes.static_shapes import output_drift

    stock = tiny_recipe.model_copy(update={"export": tiny_recipe.export.model_copy(update={"alignment": "stock"})})
    static = build_with(stock, artifacts_root, "t-reshape-static", [{"kind": "simplify", "static_reshapes": True}]).artifact
    model = onnx.load(str(static.model_file))
    for init in model.graph.initializer:
        target = numpy_helper.to_array(init).copy()
        positive = [i for i, d in enumerate(target) if d > 1] if init.name.endswith("_target") else []
        if len(positive) >= 2 and target[positive[0]] != target[positive[1]]:
            target[[positive[0], positive[1]]] = target[[positive[1], positive[0]]]
            init.CopyFrom(numpy_helper.from_array(target, init.name))
            break
    else:
        pytest.fail("no constant target with two distinct axes to swap")
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    feeds = calibration_feeds(static, 2)
    assert output_drift(static.model_file, static.model_file, feeds) == 0.0
    assert not output_drift(static.model_file, broken, feeds) <= STATIC_RESHAPE_MAX_DRIFT
