"""Audio quality and timing metrics. Pure functions of arrays: no model, no I/O.

Every quality metric compares a test clip with the fp32 reference clip of the same utterance and
is level-independent (the kokoro-onnx int8 graph is 1.5x louder; a quieter copy is not "worse").
What each one measures and misses is written down in docs/evaluation.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kokoro_opt.evaluate.corpus import PHRASE

PESQ_RATE = 16_000
PESQ_MAX = 4.644  # the ceiling of P.862.2 MOS-LQO (wide band)
HIGH_BAND = (4_000.0, 12_000.0)
_RMS_TARGET = 0.05  # about -26 dBFS: P.862's nominal speech level
_N_FFT, _HOP, _N_MELS, _N_MFCC = 1024, 256, 80, 13
MEL_HOP = _HOP  # samples per log-mel frame (plots put frames on a time axis)
_MCD_SCALE = 10.0 * math.sqrt(2.0) / math.log(10.0)  # the usual dB factor on natural-log cepstra


# ---- timing -------------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    data = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(data, q)) if data.size else math.nan


def geometric_mean(values: Iterable[float]) -> float:
    data = np.asarray([v for v in values if v > 0 and math.isfinite(v)], dtype=np.float64)
    return float(np.exp(np.log(data).mean())) if data.size else math.nan


# ---- level and rate -----------------------------------------------------------------------------


def normalise_level(audio: np.ndarray, target_rms: float = _RMS_TARGET) -> np.ndarray:
    x = np.asarray(audio, dtype=np.float64).reshape(-1)
    rms = float(np.sqrt(np.mean(x**2))) if x.size else 0.0
    return x * (target_rms / rms) if rms > 0 else x


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    from scipy.signal import resample_poly

    if rate == target:
        return np.asarray(audio, dtype=np.float64)
    g = math.gcd(rate, target)
    return resample_poly(np.asarray(audio, dtype=np.float64), target // g, rate // g)


# ---- PESQ ---------------------------------------------------------------------------------------


def pesq_wb(reference: np.ndarray, test: np.ndarray, sample_rate: int) -> float:
    """ITU-T P.862.2 wide-band PESQ on 16 kHz copies at equal level; NaN when PESQ cannot score
    (it found no speech in the reference, e.g. silence or the tiny model's noise)."""
    from pesq import PesqError, pesq

    ref = normalise_level(resample(reference, sample_rate, PESQ_RATE))
    deg = normalise_level(resample(test, sample_rate, PESQ_RATE))
    if not (np.all(np.isfinite(deg)) and np.any(deg)):
        return 1.0 if np.any(ref) else math.nan  # NaN or silent output: the worst score, not an error
    try:
        return float(pesq(PESQ_RATE, ref.astype(np.float32), deg.astype(np.float32), "wb"))
    except PesqError:
        return math.nan


# ---- spectral distances with DTW ----------------------------------------------------------------


def log_mel(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """Natural-log mel power spectrogram (n_mels, frames) of the level-normalised clip."""
    import librosa

    mel = librosa.feature.melspectrogram(
        y=normalise_level(audio).astype(np.float32),
        sr=sample_rate,
        n_fft=_N_FFT,
        hop_length=_HOP,
        n_mels=_N_MELS,
        fmin=0.0,
        fmax=sample_rate / 2,
    )
    # An 80 dB floor below the clip's peak (librosa's top_db): digital silence vs a faint noise floor
    # in pauses must not dominate the distance.
    return np.log(np.maximum(mel, max(float(mel.max()), 1e-10) * 1e-8))


@dataclass(frozen=True)
class MelDistance:
    l1: float  # mean |Δ log-mel| per bin along the DTW path (nats)
    l2: float  # RMS of Δ log-mel along the path
    mcd: float  # mel-cepstral distortion (dB), c1..c12, along the same path
    frames_ref: int
    frames_test: int


def mel_distance(reference: np.ndarray, test: np.ndarray, sample_rate: int) -> MelDistance:
    """Log-mel L1/L2 and MCD after DTW alignment: a slower or faster rendering of the same
    speech stays close; different speech does not."""
    import librosa
    from scipy.fft import dct

    ref, deg = log_mel(reference, sample_rate), log_mel(test, sample_rate)
    if not (np.all(np.isfinite(ref)) and np.all(np.isfinite(deg))):
        return MelDistance(math.nan, math.nan, math.nan, ref.shape[1], deg.shape[1])
    _, path = librosa.sequence.dtw(X=ref, Y=deg, metric="euclidean")
    i, j = path[::-1, 0], path[::-1, 1]
    diff = ref[:, i] - deg[:, j]
    cep_ref = dct(ref, type=2, norm="ortho", axis=0)[1:_N_MFCC]
    cep_deg = dct(deg, type=2, norm="ortho", axis=0)[1:_N_MFCC]
    cep_diff = cep_ref[:, i] - cep_deg[:, j]
    mcd = float(np.mean(_MCD_SCALE * np.sqrt(np.sum(cep_diff**2, axis=0))))
    return MelDistance(float(np.mean(np.abs(diff))), float(np.sqrt(np.mean(diff**2))), mcd, ref.shape[1], deg.shape[1])


# ---- static / hiss ------------------------------------------------------------------------------


def band_fraction(audio: np.ndarray, sample_rate: int, band: tuple[float, float] = HIGH_BAND) -> float:
    """Share of the clip's power (50 Hz .. Nyquist) that lies in `band`."""
    from scipy.signal import welch

    x = np.asarray(audio, dtype=np.float64)
    if x.size < 256 or not np.all(np.isfinite(x)):
        return math.nan
    freqs, power = welch(x, fs=sample_rate, nperseg=min(1024, x.size))
    total = power[freqs >= 50].sum()
    inside = power[(freqs >= band[0]) & (freqs <= min(band[1], sample_rate / 2))].sum()
    return float(inside / total) if total > 0 else math.nan


def high_band_ratio_db(reference: np.ndarray, test: np.ndarray, sample_rate: int) -> float:
    """How much more of the test clip's energy sits in 4-12 kHz than the reference's, in dB.
    ~0 dB: same balance; static, hiss or clicks push it up, a muffled output down."""
    ref, deg = band_fraction(reference, sample_rate), band_fraction(test, sample_rate)
    if not (ref > 0 and deg > 0):
        return math.nan
    return float(10.0 * math.log10(deg / ref))


# ---- durations ----------------------------------------------------------------------------------


def durations_equal(reference: np.ndarray | None, test: np.ndarray | None) -> bool | None:
    """Identical per-token frame counts; None when a model does not output durations."""
    if reference is None or test is None or np.asarray(test).size == 0:
        return None
    return bool(np.array_equal(np.asarray(reference).reshape(-1), np.asarray(test).reshape(-1)))


# ---- ORT profile --------------------------------------------------------------------------------

_CONTROL_FLOW = {"Loop", "If", "Scan"}  # their kernel time includes their body's nodes: no double counting


def op_type_times(trace: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Seconds per op type in the LAST `model_run` of an ORT profiling trace (earlier runs are warm-up)."""
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    start = max((int(e["ts"]) for e in runs), default=0)
    totals: dict[str, float] = {}
    for event in trace:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time"):
            continue
        op = str(event.get("args", {}).get("op_name", "?"))
        if int(event.get("ts", 0)) < start or op in _CONTROL_FLOW:
            continue
        totals[op] = totals.get(op, 0.0) + float(event.get("dur", 0)) / 1e6
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


# ---- per-utterance quality rows and their summary ---------------------------------------------------


def quality_row(
    reference: np.ndarray,
    test: np.ndarray,
    sample_rate: int,
    ref_durations: np.ndarray | None = None,
    test_durations: np.ndarray | None = None,
) -> dict[str, Any]:
    """Every quality metric of one utterance vs its fp32 reference. A clip with NaN or inf samples gets
    PESQ's floor and no spectral distances (they are undefined); `bad_outputs` counts it as well."""
    if not np.all(np.isfinite(test)):
        return {
            "pesq": 1.0,
            "mel_l1": math.nan,
            "mel_l2": math.nan,
            "mcd": math.nan,
            "high_band_db": math.nan,
            "durations_equal": durations_equal(ref_durations, test_durations),
        }
    dist = mel_distance(reference, test, sample_rate)
    return {
        "pesq": pesq_wb(reference, test, sample_rate),
        "mel_l1": dist.l1,
        "mel_l2": dist.l2,
        "mcd": dist.mcd,
        "high_band_db": high_band_ratio_db(reference, test, sample_rate),
        "durations_equal": durations_equal(ref_durations, test_durations),
    }


def summarise_quality(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Corpus-level quality: means, worst cases, share of identical durations (NaN-free where possible).
    Rows of kind 'phrase' (the short-phrase slice) are summarised apart, as phrase_pesq_mean etc."""
    sentences = [row for row in rows if row.get("kind") != PHRASE]
    phrases = [row for row in rows if row.get("kind") == PHRASE]
    summary = _summarise(sentences)
    if phrases:
        summary |= {f"phrase_{k}": v for k, v in _summarise(phrases).items() if k in PHRASE_METRICS}
    return summary


PHRASE_METRICS = ("pesq_mean", "pesq_min", "mcd_mean", "high_band_db_max", "durations_equal_pct")


def _summarise(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    def values(name: str) -> np.ndarray:
        data = np.array([row.get(name, math.nan) for row in rows], dtype=np.float64)
        return data[np.isfinite(data)]

    def agg(name: str, fn: Any) -> float:
        data = values(name)
        return float(fn(data)) if data.size else math.nan

    equal = [row["durations_equal"] for row in rows if row.get("durations_equal") is not None]
    return {
        "pesq_mean": agg("pesq", np.mean),
        "pesq_min": agg("pesq", np.min),
        "pesq_scored": float(values("pesq").size),
        "mel_l1_mean": agg("mel_l1", np.mean),
        "mel_l2_mean": agg("mel_l2", np.mean),
        "mcd_mean": agg("mcd", np.mean),
        "mcd_max": agg("mcd", np.max),
        "high_band_db_mean": agg("high_band_db", np.mean),
        "high_band_db_max": agg("high_band_db", np.max),
        "durations_equal_pct": 100.0 * float(np.mean(equal)) if equal else math.nan,
    }
