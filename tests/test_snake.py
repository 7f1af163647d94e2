"""The snake stage: Snake's sin^2 as a polynomial of stock ONNX ops, AdaIN folded into InstanceNorm."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.passes.snake import fold_adain, fold_scale_into_quantize, polynomial_snakes, sin2_coefficients
from kokoro_opt.recipe import parse_recipe
from tests.test_passes import build_with, ops, runs

SIMPLIFY = {"kind": "simplify"}  # folds Snake's 1/alpha and exponent into initializers
SMOOTH = {"kind": "smooth", "calibration_sentences": 1}


def test_the_polynomial_tracks_sin2_relatively_over_every_period() -> None:
    """r = y - round(y) reduces any argument; the error is relative, so a tiny alpha cannot blow it up."""
    errors = [sin2_coefficients(d)[1] for d in (2, 3, 4, 5)]
    assert errors == sorted(errors, reverse=True) and errors[2] < 1e-4
    coefficients, worst = sin2_coefficients(4)
    y = np.random.default_rng(0).uniform(-300, 300, 200_000)
    r = y - np.round(y)
    fitted = sum(c * (r * r) ** (k + 1) for k, c in enumerate(coefficients))
    exact = np.sin(np.pi * y) ** 2
    assert np.all(np.abs(fitted - exact) <= worst * exact + 1e-9)


def _model(nodes: list, inputs: dict[str, list], initializers: dict[str, np.ndarray]):
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["out"], feeds)[0]


def _snake_model(alpha: np.ndarray, exponent: float = 2.0, extra_sin_reader: bool = False, producer: str = "input"):
    """A Snake on `xt`, which is the graph input x itself, an InstanceNormalization of x with per-channel
    scale and bias, or an AdaIN (gain and shift inputs) on an InstanceNormalization that something else reads too."""
    from onnx import helper

    channels = alpha.size
    made_by = {
        "input": [helper.make_node("Identity", ["x"], ["xt"], name="input")],
        "instance_norm": [helper.make_node("InstanceNormalization", ["x", "scale", "bias"], ["xt"], name="norm")],
        "adain": [
            helper.make_node("InstanceNormalization", ["x", "ones", "zeros"], ["n"], name="norm"),
            helper.make_node("Mul", ["n", "gain"], ["scaled"], name="gain_mul"),
            helper.make_node("Add", ["scaled", "shift"], ["xt"], name="shift_add"),
            helper.make_node("ReduceMean", ["n"], ["n_mean"], name="other_reader", keepdims=0),
        ],
    }[producer]
    nodes = [
        *made_by,
        helper.make_node("Mul", ["xt", "alpha"], ["ax"], name="snake/Mul"),
        helper.make_node("Sin", ["ax"], ["s"], name="snake/Sin"),
        helper.make_node("Pow", ["s", "two"], ["s2"], name="snake/Pow"),
        helper.make_node("Mul", ["inv_alpha", "s2"], ["term"], name="snake/Mul_1"),
        helper.make_node("Add", ["xt", "term"], ["u"], name="snake/Add"),
        helper.make_node("Add", ["u", "s"] if extra_sin_reader else ["u", "zero"], ["out"], name="after"),
    ]
    if producer == "input":  # no producer: the Snake reads the graph input
        nodes = [n for n in nodes if n.name != "input"]
        for n in nodes:
            n.input[:] = ["x" if i == "xt" else i for i in n.input]
    rng = np.random.default_rng(channels)
    consts = {"alpha": alpha, "inv_alpha": (1 / alpha).astype(np.float32), "two": np.float32(exponent), "zero": np.float32(0)}
    consts |= {"scale": 10 ** rng.uniform(-1, 1.5, channels), "bias": rng.standard_normal(channels) * 5}
    consts |= {"ones": np.ones(channels), "zeros": np.zeros(channels)}
    inputs = {"x": [1, channels, None]} | ({"gain": [1, channels, 1], "shift": [1, channels, 1]} if producer == "adain" else {})
    used = {i for n in nodes for i in n.input}
    return _model(nodes, inputs, {k: np.asarray(v, np.float32) for k, v in consts.items() if k in used})


def _snake_input(model, producer: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """xt in float64, as `_snake_model` makes it."""
    from onnx import numpy_helper

    x = feeds["x"].astype(np.float64)
    if producer == "input":
        return x
    const = {i.name: numpy_helper.to_array(i).astype(np.float64).reshape(1, -1, 1) for i in model.graph.initializer}
    normed = (x - x.mean(axis=2, keepdims=True)) / np.sqrt(x.var(axis=2, keepdims=True) + 1e-5)
    if producer == "instance_norm":
        return normed * const["scale"] + const["bias"]
    return normed * feeds["gain"] + feeds["shift"]


@pytest.mark.parametrize("producer", ["input", "instance_norm", "adain"])
@pytest.mark.parametrize("degree", [2, 3])
def test_polynomial_snake_in_onnx_runtime_matches_snake_for_any_alpha(degree: int, producer: str) -> None:
    """Per-channel alpha from 1e-4 to 50, both signs, |xt| up to 100. Where xt comes from an
    InstanceNormalization or an AdaIN, that node makes y = |alpha| xt / pi itself (alpha_absorbed)."""
    rng = np.random.default_rng(degree)
    alpha = (10 ** rng.uniform(-4, np.log10(50), 16) * rng.choice([-1, 1], 16)).astype(np.float32).reshape(1, -1, 1)
    x = (rng.standard_normal((1, 16, 4000)) * np.array([0.1, 1, 10, 100])[rng.integers(0, 4, (1, 16, 1))]).astype(np.float32)
    adain = {"gain": rng.uniform(0.1, 30, (1, 16, 1)), "shift": rng.standard_normal((1, 16, 1))} if producer == "adain" else {}
    feeds = {k: v.astype(np.float32) for k, v in ({"x": x} | adain).items()}
    model = _snake_model(alpha, producer=producer)
    xt = _snake_input(model, producer, feeds)
    assert polynomial_snakes(model, degree) == (1, int(producer != "input"))
    assert {n.op_type for n in model.graph.node} - {"InstanceNormalization", "ReduceMean"} == {"Mul", "Sub", "Add"}
    got = _run(model, feeds).astype(np.float64)
    a = alpha.astype(np.float64)
    term = np.sin(a * xt) ** 2 / a
    y = np.abs(a * xt / np.pi)
    tolerance = sin2_coefficients(degree)[1] * np.abs(term) + np.pi * y * 2.4e-7 / np.abs(a) + 2e-6 * (np.abs(xt) + 1)
    assert np.all(np.abs(got - (xt + term)) <= tolerance)


SNAKE_FACTOR = "snake/pi_over_abs_alpha"


@pytest.mark.parametrize(
    ("factor", "other_reader", "name", "folds"),
    [(1, False, SNAKE_FACTOR, 1), (-1, False, SNAKE_FACTOR, 0), (1, True, SNAKE_FACTOR, 0), (1, False, "mask", 0)],
)
def test_the_snake_factor_moves_into_the_quantize_that_reads_it(factor: int, other_reader: bool, name: str, folds: int) -> None:
    """u * (pi / |alpha|) -> QuantizeLinear becomes a per-channel QuantizeLinear: the same uint8 codes, one pass
    fewer. A negative factor (a quantization scale must be positive), a second reader of the product, or a
    Mul that is not a Snake's (its [1, C, 1] need not mean channels on axis 1) stays."""
    from onnx import TensorProto, helper

    v = np.geomspace(1e-2, 1e3, 8, dtype=np.float32).reshape(1, -1, 1)
    v[0, 0, 0] *= factor
    nodes = [
        helper.make_node("Mul", ["x", name], ["xv"], name="scale"),
        helper.make_node("QuantizeLinear", ["xv", "s", "z"], ["q"], name="quant"),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], name="dequant"),
        helper.make_node("Add", ["dq", "xv" if other_reader else "zero"], ["out"], name="after"),
    ]
    model = _model(nodes, {"x": [1, 8, None]}, {name: v, "s": np.float32(0.05), "zero": np.float32(0)})
    model.graph.initializer.append(helper.make_tensor("z", TensorProto.UINT8, [], [128]))
    x = (np.random.default_rng(0).standard_normal((1, 8, 3000)) * (3 / np.abs(v))).astype(np.float32)
    before = _run(model, {"x": x})
    assert fold_scale_into_quantize(model) == folds
    assert sum(n.op_type == "Mul" for n in model.graph.node) == 1 - folds
    moved = np.abs(_run(model, {"x": x}) - before)
    assert np.mean(moved > 1e-6) < 1e-3 and moved.max() <= 0.05 + 1e-6  # a code apart at most, and rarely (rounding)


@pytest.mark.parametrize("variant", [{"exponent": 3.0}, {"extra_sin_reader": True}])
def test_polynomial_snake_leaves_other_patterns_alone(variant: dict) -> None:
    model = _snake_model(np.full((1, 4, 1), 0.5, np.float32), **variant)
    assert polynomial_snakes(model, 3) == (0, 0) and "Sin" in {n.op_type for n in model.graph.node}


@pytest.mark.parametrize(("gain_shape", "folds"), [([1, 8, 1], 1), ([1, 1, 50], 0)])
def test_adain_folds_only_per_channel_vectors(gain_shape: list, folds: int) -> None:
    """A [1, C, 1] gain becomes InstanceNormalization's scale; a [1, 1, T] one (a mask) must stay a Mul."""
    from onnx import helper

    nodes = [
        helper.make_node("InstanceNormalization", ["x", "ones", "zeros"], ["n"], name="norm"),
        helper.make_node("Mul", ["n", "gain"], ["scaled"], name="gain_mul"),
        helper.make_node("Add", ["scaled", "shift"], ["out"], name="shift_add"),
    ]
    consts = {"ones": np.ones(8, np.float32), "zeros": np.zeros(8, np.float32)}
    model = _model(nodes, {"x": [1, 8, 50], "gain": gain_shape, "shift": gain_shape}, consts)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 8, 50)), "gain": rng.uniform(0.5, 2, gain_shape)}
    feeds = {k: v.astype(np.float32) for k, v in (feeds | {"shift": rng.standard_normal(gain_shape)}).items()}
    before = _run(model, feeds)
    assert fold_adain(model) == folds
    np.testing.assert_allclose(_run(model, feeds), before, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # builds a chain of stages
def test_snake_stage_keeps_the_output_and_drops_the_generator_sin(tiny_recipe, artifacts_root) -> None:
    smoothed = build_with(tiny_recipe, artifacts_root, "t-smooth", [SIMPLIFY, SMOOTH])
    result = build_with(tiny_recipe, artifacts_root, "t-snake", [SIMPLIFY, SMOOTH, {"kind": "snake"}])
    before, record = smoothed.artifact.build.stages[-1], result.artifact.build.stages[-1]
    assert record["snakes"] >= 12 and record["adain_folded"] >= 12  # every resblock's two Snakes and AdaINs
    assert record["alpha_absorbed"] == record["snakes"]  # every Snake's input is made by an InstanceNorm or an AdaIN
    assert ops(record)["Sin"] == ops(before)["Sin"] - record["snakes"]  # SineGen's own Sin stays
    assert ops(record).get("Pow", 0) == ops(before)["Pow"] - record["snakes"]
    assert ops(record).get("Round", 0) == ops(before).get("Round", 0)  # round(y) is (y + M) - M
    assert ops(record)["Sub"] == ops(before).get("Sub", 0) + 2 * record["snakes"]
    np.testing.assert_allclose(runs(result.artifact), runs(smoothed.artifact), rtol=1e-3, atol=1e-4)


def test_folding_adain_alone_changes_only_float_rounding(tiny_recipe, artifacts_root) -> None:
    plain = build_with(tiny_recipe, artifacts_root, "t-simplify-basic", [SIMPLIFY])
    result = build_with(tiny_recipe, artifacts_root, "t-adain", [SIMPLIFY, {"kind": "snake", "polynomial_degree": None}])
    before, record = plain.artifact.build.stages[-1], result.artifact.build.stages[-1]
    assert "snakes" not in record and ops(record)["Sin"] == ops(before)["Sin"]
    assert ops(record)["InstanceNormalization"] == ops(before)["InstanceNormalization"]
    for op, change in (("Mul", -1), ("Add", -1), ("Reshape", 2)):  # per fold: gain Mul and shift Add out, 2 Reshapes in
        assert ops(record).get(op, 0) == ops(before).get(op, 0) + change * record["adain_folded"]
    np.testing.assert_allclose(runs(result.artifact), runs(plain.artifact), rtol=0, atol=1e-4)  # float rounding only


@pytest.mark.slow  # builds a chain of stages
def test_quantization_after_snake_still_makes_integer_convs(tiny_recipe, artifacts_root) -> None:
    static = {"kind": "quantize", "mode": "static", "op_types": ["Conv", "MatMul"], "calibration_sentences": 1}
    result = build_with(tiny_recipe, artifacts_root, "t-snake-static", [SIMPLIFY, {"kind": "snake"}, static])
    counts = ops(result.artifact.build.stages[-1])
    assert counts["QuantizeLinear"] > 0 and counts["Sub"] > 24
    model = onnx.load(str(result.artifact.model_file))
    per_channel = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and any(a.name == "axis" for a in n.attribute)]
    assert len(per_channel) >= 12 and all(n.input[0].endswith("/poly/u") for n in per_channel)  # each Snake's last Mul is gone
    runs(result.artifact)


def test_snake_without_simplify_says_what_to_put_first(tiny_recipe, artifacts_root) -> None:
    with pytest.raises(UserError, match="simplify"):
        build_with(tiny_recipe, artifacts_root, "t-snake-raw", [{"kind": "snake"}])


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([SIMPLIFY, {"kind": "snake"}, SMOOTH], "'smooth' must come before stage 'snake'"),
        ([SIMPLIFY, {"kind": "snake"}, {"kind": "fp16"}], "'fp16' cannot follow stage 'snake'"),
        ([{"kind": "snake", "polynomial_degree": 1}], "polynomial_degree"),
        ([{"kind": "snake", "fold": True}], "unknown field 'stages.0.snake.fold'"),
    ],
)
def test_snake_recipe_errors_name_the_problem(stages: list[dict], message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_recipe({"name": "x", "stages": stages})
