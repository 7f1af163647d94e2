"""The export gate: does the ONNX graph compute what the PyTorch model computes?

It gates on what float32 noise cannot move and a wrong graph cannot hide:
- per-token durations identical (integers: the predictor's rounding, the same on every CPU so far);
- audio length identical (follows from the durations through the decoder's fixed upsampling);
- log-mel distance in dB, frame by frame (durations are equal, so no alignment is needed).

Sample-level SNR and correlation are recorded but not gated: SineGen integrates F0 into a phase,
so a 1e-7 difference in F0 becomes a phase drift that costs 1-2 dB of SNR between CPUs while the
spectrogram is unchanged (measured: 29.9-30.7 dB across kernel paths of one correct export).
Thresholds and their measured margins: docs/stages.md#export-validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.audio import correlation, snr_db
from kokoro_opt.recipe import ValidationConfig

# (token ids without pads, style (1, 256), speed) -> (audio, durations)
Synthesize = Callable[[list[int], np.ndarray, float], tuple[np.ndarray, np.ndarray]]
_DB_PER_NEPER = 10.0 / math.log(10.0)


@dataclass(frozen=True)
class Case:
    sentence: str
    tokens: list[int]
    style: np.ndarray
    speed: float


def validation_cases(cfg: ValidationConfig, vocab: dict[str, int], packs: dict[str, np.ndarray]) -> list[Case]:
    """Sentence i at speed i mod len(speeds): a graph that ignores `speed` cannot pass."""
    from kokoro_opt.text import utterance_tokens
    from kokoro_opt.voices import style_for

    cases = []
    for i, sentence in enumerate(cfg.sentences):
        tokens = utterance_tokens(sentence, vocab)
        cases.append(Case(sentence, tokens, style_for(packs[cfg.voice], len(tokens)), cfg.speeds[i % len(cfg.speeds)]))
    return cases


def mel_distance_db(reference: np.ndarray, test: np.ndarray, sample_rate: int) -> float:
    """Mean |Δ log-mel| in dB over frames and bins, frame by frame (no DTW: lengths must match)."""
    from kokoro_opt.evaluate.metrics import log_mel

    ref, deg = log_mel(reference, sample_rate), log_mel(test, sample_rate)
    if ref.shape != deg.shape or not (np.all(np.isfinite(ref)) and np.all(np.isfinite(deg))):
        return math.inf
    return float(np.mean(np.abs(ref - deg)) * _DB_PER_NEPER)


@dataclass(frozen=True)
class CaseScore:
    sentence: str
    tokens: int
    speed: float
    durations_equal: bool
    length_equal: bool
    mel_db: float
    correlation: float  # recorded, not gated
    snr_db: float  # recorded, not gated


def score_case(case: Case, reference: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], rate: int) -> CaseScore:
    ref_audio, ref_durations = reference
    audio, durations = np.asarray(test[0]).reshape(-1), np.asarray(test[1]).reshape(-1)
    finite = bool(np.all(np.isfinite(audio)))
    return CaseScore(
        sentence=case.sentence,
        tokens=len(case.tokens),
        speed=case.speed,
        durations_equal=bool(np.array_equal(durations, ref_durations)),
        length_equal=len(audio) == len(ref_audio),
        mel_db=mel_distance_db(ref_audio, audio, rate) if finite else math.inf,
        correlation=correlation(ref_audio, audio) if finite else 0.0,
        snr_db=snr_db(ref_audio, audio) if finite else -math.inf,
    )


def verdict(scores: Sequence[CaseScore], cfg: ValidationConfig) -> dict[str, Any]:
    """The gate's record: each case, the gated figures, and pass/fail with the reasons."""
    report: dict[str, Any] = {
        "sentences": [asdict(s) for s in scores],
        "durations_equal": all(s.durations_equal for s in scores),
        "length_equal": all(s.length_equal for s in scores),
        "max_mel_db": max(s.mel_db for s in scores),
        "max_mel_db_threshold": cfg.max_mel_db,
        "min_correlation": min(s.correlation for s in scores),
        "min_snr_db": min(s.snr_db for s in scores),
    }
    reasons = []
    if not report["durations_equal"]:
        bad = [s.sentence for s in scores if not s.durations_equal]
        reasons.append(f"durations differ from PyTorch on {len(bad)} of {len(scores)} sentences")
    if not report["length_equal"]:
        reasons.append("audio length differs from PyTorch")
    if not report["max_mel_db"] <= cfg.max_mel_db:
        reasons.append(f"log-mel distance {report['max_mel_db']:.2f} dB > {cfg.max_mel_db} dB")
    report["passed"] = not reasons
    report["reasons"] = reasons
    return report


def validate(
    reference: Synthesize, candidate: Synthesize, cases: Sequence[Case], cfg: ValidationConfig, rate: int
) -> dict[str, Any]:
    """Run both on every case and judge the candidate against the reference."""
    scores = [score_case(c, reference(c.tokens, c.style, c.speed), candidate(c.tokens, c.style, c.speed), rate) for c in cases]
    return verdict(scores, cfg)


def onnx_synthesize(model_file: Path | bytes, threads: int = 0) -> Synthesize:
    """A Synthesize over an ONNX Runtime session of `model_file` (path or serialized bytes)."""
    from kokoro_opt.runtime.feeds import model_feeds
    from kokoro_opt.runtime.session import SessionSettings, make_session

    session = make_session(model_file, SessionSettings(intra_op_num_threads=threads))

    def run(tokens: list[int], style: np.ndarray, speed: float) -> tuple[np.ndarray, np.ndarray]:
        audio, durations = session.run(None, model_feeds(tokens, style, speed))[:2]
        return np.asarray(audio).reshape(-1), np.asarray(durations).reshape(-1)

    return run


def torch_synthesizer(model: Any) -> Synthesize:
    """A Synthesize over KModel with SineGen's noise zeroed, memoised: references are computed once."""
    from kokoro_opt.model import deterministic_noise, torch_synthesize

    memo: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}

    def run(tokens: list[int], style: np.ndarray, speed: float) -> tuple[np.ndarray, np.ndarray]:
        key = (tuple(tokens), style.tobytes(), speed)
        if key not in memo:
            with deterministic_noise():
                memo[key] = torch_synthesize(model, tokens, style, speed)
        return memo[key]

    return run
