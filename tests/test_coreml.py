"""Core ML stage: converts on Linux (spec validated, op counts and precision recorded); prediction
needs macOS and says so instead of reporting a number."""

from __future__ import annotations

import platform

import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.runtime.availability import coreml_unavailable_reason
from kokoro_opt.runtime.coreml import CoreMLSynthesizer

pytest.importorskip("coremltools")


@pytest.fixture(scope="module")
def coreml_artifact(tiny_recipe, artifacts_root):
    from kokoro_opt.build import build
    from kokoro_opt.recipe import parse_recipe

    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name="t-coreml", stages=[{"kind": "coreml", "precision": "fp16", "int8_weights": True, "max_tokens": 32}])
    return build(parse_recipe(data), artifacts_root).artifact


def test_conversion_records_the_split_ops_and_precision(coreml_artifact) -> None:
    record = coreml_artifact.build.stages[-1]
    assert (coreml_artifact.path / "model.mlpackage").is_dir() and (coreml_artifact.path / "front.onnx").is_file()
    assert record["op_counts"]["conv"] > 10 and "sin" in record["op_counts"]
    assert "mod" not in record["op_counts"]  # SineGen's % 1 was rewritten as x - floor(x)
    assert "sin" in record["fp32_ops"] and record["flexible_frames"] == [8, 256]
    assert record["prediction"].startswith("needs macOS")


def test_front_runs_on_onnx_runtime(coreml_artifact) -> None:

    from kokoro_opt.passes.coreml import example_feeds
    from kokoro_opt.voices import style_for

    pack = coreml_artifact.voice_packs()["tiny_0"]
    feeds = example_feeds(coreml_artifact.path / "front.onnx", list(range(20, 50)), style_for(pack, 30))
    assert feeds["asr"].shape[-1] * 2 == feeds["f0"].shape[-1] == int(feeds["durations"].sum()) * 2


@pytest.mark.skipif(platform.system() == "Darwin", reason="on macOS the artifact really runs")
def test_prediction_off_macos_is_a_clear_skip(coreml_artifact) -> None:
    assert "needs macOS" in (coreml_unavailable_reason() or "")
    with pytest.raises(UserError, match="needs macOS"):
        CoreMLSynthesizer(coreml_artifact)
