"""Core ML stage: converts on Linux (spec validated, op counts and precision recorded); prediction
needs macOS and says so instead of reporting a number."""

from __future__ import annotations

import platform

import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.runtime.availability import coreml_unavailable_reason
from kokoro_opt.runtime.coreml import CoreMLSynthesizer
from tests import needs

needs.module("coremltools", "pip install 'kokoro-opt[coreml]'")


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


@pytest.mark.skipif(platform.system() == "Darwin", reason="macOS runs Core ML: there it is a fair pick")
def test_best_passes_over_an_evaluated_artifact_this_machine_cannot_run(coreml_artifact, tiny_artifact, tmp_path) -> None:
    """A team's shared store may rank a Mac's Core ML evaluation first; off macOS `best` serves the fastest
    artifact that runs here instead of refusing to start."""
    from kokoro_opt.select import resolve_artifact
    from tests.serve_helpers import record_evaluations

    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    record_evaluations(
        uri, [(coreml_artifact.id, {"speedup_vs_reference": 5.0}), (tiny_artifact.id, {"speedup_vs_reference": 2.0})]
    )  # the Mac's Core ML run is the fastest
    assert resolve_artifact("best", coreml_artifact.path.parent.parent, uri).artifact.id == tiny_artifact.id


def test_a_job_longer_than_the_decoder_takes_is_cut_at_a_word(coreml_artifact) -> None:
    """The decoder's frame axis is flexible up to max_tokens x 8 (32 here): slow speech of a long job has more
    frames, and the synthesizer then speaks it as two utterances cut at the word boundary nearest the middle."""
    import coremltools as ct

    from kokoro_opt.runtime.coreml import decoder_frame_limit, split_point

    spec = ct.utils.load_spec(str(coreml_artifact.path / "model.mlpackage"))
    assert decoder_frame_limit(spec) == 32 * 8 == coreml_artifact.build.stage("coreml")["flexible_frames"][1]
    space = coreml_artifact.kokoro["vocab"][" "]
    assert split_point([5, 6, space, 7, 8, space, 9, 10, 11, 12], space) == 5  # the space nearest index 5
    assert split_point([5, 6, 7, 8], space) == 2  # one word: its middle
    assert split_point([space, 5, 6, space], space) == 2  # never an edge, which would leave an empty half
