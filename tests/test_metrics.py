"""Known-answer tests for the quality and timing metrics (kokoro_opt.evaluate.metrics, .asr)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.signal import lfilter

from kokoro_opt.evaluate import metrics
from tests import needs

SR = 24_000
# (F1, F2, F3) of a few vowels: "speech" with formants, voicing and pauses, as PESQ's VAD expects.
VOWELS = {"a": (730, 1090, 2440), "i": (270, 2290, 3010), "u": (300, 870, 2240), "e": (530, 1840, 2480), "o": (570, 840, 2410)}


def speechlike(word: str, seconds_per_vowel: float = 0.22, f0: float = 120.0, seed: int = 0) -> np.ndarray:
    """A formant-synthesised vowel string: a glottal pulse train through three resonators per vowel."""
    rng = np.random.default_rng(seed)
    pieces = [np.zeros(int(0.2 * SR))]
    for k, vowel in enumerate(word):
        n = int(seconds_per_vowel * SR)
        t = np.arange(n) / SR
        pitch = f0 * (1 + 0.08 * np.sin(2 * np.pi * 3 * t + k))  # intonation
        phase = np.cumsum(pitch / SR)
        source = (np.diff(np.floor(phase), prepend=0) > 0).astype(np.float64) + 0.01 * rng.standard_normal(n)
        y = source
        for formant, bandwidth in zip(VOWELS[vowel], (80, 100, 120), strict=True):
            r = np.exp(-np.pi * bandwidth / SR)
            y = lfilter([1 - r], [1, -2 * r * np.cos(2 * np.pi * formant / SR), r * r], y)
        pieces += [y * np.hanning(n), np.zeros(int(0.06 * SR))]
    pieces.append(np.zeros(int(0.2 * SR)))
    audio = np.concatenate(pieces)
    return (0.3 * audio / np.abs(audio).max()).astype(np.float32)


def with_noise(audio: np.ndarray, snr_db: float, seed: int = 1) -> np.ndarray:
    noise = np.random.default_rng(seed).standard_normal(audio.size)
    scale = np.sqrt(np.mean(audio.astype(np.float64) ** 2) / (np.mean(noise**2) * 10 ** (snr_db / 10)))
    return (audio + scale * noise).astype(np.float32)


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return speechlike("aiueoaeiou")


def test_pesq_of_a_clip_against_itself_is_the_maximum(clip: np.ndarray) -> None:
    assert metrics.pesq_wb(clip, clip, SR) == pytest.approx(metrics.PESQ_MAX, abs=0.01)


def test_pesq_ignores_level(clip: np.ndarray) -> None:
    # kokoro-onnx's int8 graph is 1.5x louder: that alone must not cost quality points
    assert metrics.pesq_wb(clip, 1.5 * clip, SR) == pytest.approx(metrics.PESQ_MAX, abs=0.01)
    assert metrics.pesq_wb(clip, 0.2 * clip, SR) == pytest.approx(metrics.PESQ_MAX, abs=0.01)


def test_pesq_falls_monotonically_with_added_noise(clip: np.ndarray) -> None:
    scores = [metrics.pesq_wb(clip, with_noise(clip, snr), SR) for snr in (40, 30, 20, 10, 0)]
    assert all(a > b for a, b in itertools.pairwise(scores)), scores
    assert scores[0] < metrics.PESQ_MAX and scores[-1] < 2.0


def test_pesq_scores_nan_or_silent_output_as_worst_not_as_error(clip: np.ndarray) -> None:
    assert metrics.pesq_wb(clip, np.zeros_like(clip), SR) == 1.0
    assert metrics.pesq_wb(clip, np.full_like(clip, np.nan), SR) == 1.0
    assert math.isnan(metrics.pesq_wb(np.zeros_like(clip), clip, SR))  # nothing to compare against


def test_mcd_dtw_is_small_for_a_time_stretched_copy_and_large_for_other_speech(clip: np.ndarray) -> None:
    same = metrics.mel_distance(clip, clip, SR)
    assert same.mcd == pytest.approx(0.0, abs=1e-6) and same.l1 == pytest.approx(0.0, abs=1e-6)
    slower = speechlike("aiueoaeiou", seconds_per_vowel=0.28)  # same "sentence", 27% longer
    stretched = metrics.mel_distance(clip, slower, SR)
    other = metrics.mel_distance(clip, speechlike("ouoiuaeaoi", f0=180.0, seed=3), SR)
    assert stretched.frames_test > stretched.frames_ref * 1.15  # DTW really had to align different lengths
    assert stretched.mcd < 0.5 * other.mcd, (stretched, other)
    assert stretched.l2 < other.l2


def test_mcd_ignores_level(clip: np.ndarray) -> None:
    assert metrics.mel_distance(clip, 1.5 * clip, SR).mcd == pytest.approx(0.0, abs=1e-3)


def test_high_band_ratio_flags_static(clip: np.ndarray) -> None:
    assert metrics.high_band_ratio_db(clip, 1.5 * clip, SR) == pytest.approx(0.0, abs=1e-3)
    crackle = np.zeros_like(clip)
    crackle[np.random.default_rng(5).integers(0, clip.size, 400)] = 0.2  # clicks, like a broken conv_post
    static = metrics.high_band_ratio_db(clip, clip + crackle, SR)
    hiss = metrics.high_band_ratio_db(clip, with_noise(clip, 25), SR)
    assert static > 6.0 and hiss > 3.0, (static, hiss)
    # a muffled (low-passed) output goes the other way
    muffled = lfilter([0.05], [1, -0.95], clip)
    assert metrics.high_band_ratio_db(clip, muffled, SR) < -6.0


def test_durations_equal() -> None:
    assert metrics.durations_equal(np.array([2, 3, 4]), np.array([[2, 3, 4]])) is True
    assert metrics.durations_equal(np.array([2, 3, 4]), np.array([2, 3, 5])) is False
    assert metrics.durations_equal(np.array([2, 3]), None) is None  # the kokoro-onnx graph has no durations output


def test_percentiles_and_geometric_mean() -> None:
    assert metrics.percentile([1, 2, 3, 4, 5], 50) == 3
    assert metrics.percentile([1.0] * 9 + [10.0], 90) == pytest.approx(1.9)
    assert math.isnan(metrics.percentile([], 50))
    assert metrics.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert metrics.geometric_mean([2.0, math.nan, 0.0, 8.0]) == pytest.approx(4.0)


def test_op_type_times_reads_the_last_run_and_skips_control_flow() -> None:
    def node(op: str, ts: int, dur: int) -> dict[str, object]:
        return {"cat": "Node", "name": f"/n_{op}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    trace = [
        {"cat": "Session", "name": "model_run", "ts": 0, "dur": 100},
        node("Conv", 10, 50_000),  # warm-up run: ignored
        {"cat": "Session", "name": "model_run", "ts": 1000, "dur": 100},
        node("Conv", 1010, 2_000_000),
        node("Conv", 1020, 1_000_000),
        node("Sin", 1030, 500_000),
        node("Loop", 1040, 700_000),  # includes its body's nodes
        {"cat": "Node", "name": "/n_Conv_fence_before", "ts": 1050, "dur": 9, "args": {"op_name": "Conv"}},
    ]
    assert metrics.op_type_times(trace) == {"Conv": 3.0, "Sin": 0.5}


def test_wer_normalises_numbers_abbreviations_and_punctuation() -> None:
    needs.module("jiwer", "pip install 'kokoro-opt[asr]'")
    from kokoro_opt.evaluate.asr import normalise_for_wer, word_error_rate

    assert normalise_for_wer("Mr. Fogg lived, in 1872, at No. 7!") == "mister fogg lived in eighteen seventy two at number seven"
    assert word_error_rate(["Mr. Fogg paid $3.50."], ["Mister Fogg paid three dollars fifty cents"]) == 0.0
    two = ["the boy was there", "when the sun rose"]
    assert word_error_rate(two, ["the boy was here", "when the sun rose"]) == pytest.approx(1 / 8)
    assert word_error_rate(["the boy was there"], [""]) == 1.0


def test_a_clip_with_nan_samples_scores_the_pesq_floor_instead_of_crashing() -> None:
    """An FP16 artifact that overflows gives NaN audio: the evaluation reports it, it does not stop."""
    rate = 24000
    t = np.arange(rate) / rate
    reference = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    broken = reference.copy()
    broken[100:200] = np.nan
    row = metrics.quality_row(reference, broken, rate, np.array([3, 4]), np.array([3, 4]))
    assert row["pesq"] == 1.0 and math.isnan(row["mcd"]) and row["durations_equal"] is True
    summary = metrics.summarise_quality([row, metrics.quality_row(reference, reference, rate)])
    assert summary["pesq_min"] == 1.0 and math.isfinite(summary["mcd_mean"])


def test_the_short_phrase_slice_is_summarised_apart_from_the_sentences() -> None:
    """Phrases (the screen-reader slice) neither lower the sentence means nor hide behind them."""
    rate = 24000
    t = np.arange(rate) / rate
    reference = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    noisy = reference + np.random.default_rng(0).normal(0, 0.05, rate).astype(np.float32)
    same = {**metrics.quality_row(reference, reference, rate), "kind": "short"}
    worse = {**metrics.quality_row(reference, noisy, rate), "kind": "phrase"}
    summary = metrics.summarise_quality([same, worse])
    assert summary["pesq_mean"] == same["pesq"] and summary["pesq_scored"] == 1.0
    assert summary["phrase_pesq_mean"] == summary["phrase_pesq_min"] == worse["pesq"] < same["pesq"]
    assert summary["phrase_mcd_mean"] == worse["mcd"] > 0.0
    assert "phrase_pesq_mean" not in metrics.summarise_quality([same])  # no slice scored, no number
