"""The snake stage: Snake's sin^2 as a polynomial of stock ONNX ops, AdaIN folded into InstanceNorm."""

from __future__ import annotations

import numpy as np
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.passes.snake import sin2_coefficients
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


def test_snake_stage_keeps_the_output_and_drops_the_generator_sin(tiny_recipe, artifacts_root) -> None:
    smoothed = build_with(tiny_recipe, artifacts_root, "t-smooth", [SIMPLIFY, SMOOTH])
    result = build_with(tiny_recipe, artifacts_root, "t-snake", [SIMPLIFY, SMOOTH, {"kind": "snake"}])
    before, record = smoothed.artifact.manifest["stages"][-1], result.artifact.manifest["stages"][-1]
    assert record["snakes"] >= 12 and record["adain_folded"] >= 12  # every resblock's two Snakes and AdaINs
    assert ops(record)["Sin"] == ops(before)["Sin"] - record["snakes"]  # SineGen's own Sin stays
    assert ops(record).get("Pow", 0) == ops(before)["Pow"] - record["snakes"]
    assert ops(record)["Round"] == ops(before).get("Round", 0) + record["snakes"]
    np.testing.assert_allclose(runs(result.artifact), runs(smoothed.artifact), rtol=1e-3, atol=1e-4)


def test_folding_adain_alone_changes_only_float_rounding(tiny_recipe, artifacts_root) -> None:
    plain = build_with(tiny_recipe, artifacts_root, "t-simplify-basic", [SIMPLIFY])
    result = build_with(tiny_recipe, artifacts_root, "t-adain", [SIMPLIFY, {"kind": "snake", "polynomial_degree": None}])
    before, record = plain.artifact.manifest["stages"][-1], result.artifact.manifest["stages"][-1]
    assert "snakes" not in record and ops(record)["Sin"] == ops(before)["Sin"]
    assert ops(record)["InstanceNormalization"] == ops(before)["InstanceNormalization"]
    assert ops(record)["Mul"] < ops(before)["Mul"] - record["adain_folded"] // 2
    np.testing.assert_allclose(runs(result.artifact), runs(plain.artifact), rtol=0, atol=1e-4)  # float rounding only


def test_quantization_after_snake_still_makes_integer_convs(tiny_recipe, artifacts_root) -> None:
    static = {"kind": "quantize", "mode": "static", "op_types": ["Conv", "MatMul"], "calibration_sentences": 1}
    result = build_with(tiny_recipe, artifacts_root, "t-snake-static", [SIMPLIFY, {"kind": "snake"}, static])
    counts = ops(result.artifact.manifest["stages"][-1])
    assert counts["QuantizeLinear"] > 0 and counts["Round"] > 12
    runs(result.artifact)


def test_snake_without_simplify_says_what_to_put_first(tiny_recipe, artifacts_root) -> None:
    with pytest.raises(UserError, match="simplify"):
        build_with(tiny_recipe, artifacts_root, "t-snake-raw", [{"kind": "snake"}])


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([SIMPLIFY, {"kind": "snake"}, SMOOTH], "'smooth' must come before stage 'snake'"),
        ([{"kind": "snake", "polynomial_degree": 1}], "polynomial_degree"),
        ([{"kind": "snake", "fold": True}], "unknown field 'stages.0.snake.fold'"),
    ],
)
def test_snake_recipe_errors_name_the_problem(stages: list[dict], message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_recipe({"name": "x", "stages": stages})
