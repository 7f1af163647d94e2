"""Small audio helpers shared by export validation, evaluation and serving."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf

from kokoro_opt.errors import UserError
from kokoro_opt.paths import output_file


def align(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = min(len(a), len(b))
    return np.asarray(a[:n], dtype=np.float64), np.asarray(b[:n], dtype=np.float64)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    x, y = align(a, b)
    if x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    x, y = align(reference, test)
    noise = np.sum((x - y) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(x**2) / noise))


def is_speechlike(audio: np.ndarray) -> bool:
    """Finite, not silent, not clipped to a constant: the minimum any synthesized clip must pass."""
    return bool(np.all(np.isfinite(audio)) and audio.size > 0 and float(np.abs(audio).max()) > 1e-3)


def to_pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def wav_target(path: str | Path) -> Path:
    """Where a WAV file may be written, checked before any work goes into it; else one UserError saying why."""
    return output_file(path, ".wav", "hello.wav")


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """A 16-bit WAV file's bytes."""
    buffer = io.BytesIO()
    sf.write(buffer, np.clip(audio, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> Path:
    """A 16-bit WAV, written to a temporary file beside `path` and renamed into place (never half-written)."""
    path = wav_target(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(wav_bytes(audio, sample_rate))
        tmp.replace(path)
    except (OSError, sf.LibsndfileError) as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path} ({exc})", "choose a folder you can write to") from None
    return path
