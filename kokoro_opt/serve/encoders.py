"""Audio encoders that emit bytes as audio arrives, so a response can stream chunk by chunk.

Every encoder has `encode(audio) -> bytes` (float32 mono, any length) and `finish() -> bytes`. In
streaming mode bytes leave as soon as the codec has them; headers that normally hold the total
length say "unknown" instead (WAV sizes 0xFFFFFFFF like OpenAI, FLAC total samples 0). Without
streaming, everything is returned by `finish()` with exact lengths.

WAV/PCM are written directly; MP3, Opus (in Ogg) and FLAC go through libsndfile (>= 1.1 encodes MP3
and Opus); AAC (ADTS) needs PyAV, which is optional.
"""

from __future__ import annotations

import struct
from functools import cache
from typing import Any, Protocol

import numpy as np

from kokoro_opt.audio import to_pcm16
from kokoro_opt.errors import UserError

MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
_SNDFILE = {"mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS"), "flac": ("FLAC", "PCM_16")}
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # from sndfile.h; soundfile has no wrapper for it
_OPUS_PAGE_MS = 20.0  # libsndfile's default is 1000 ms: a page would hold back the first second of audio
_MP3_COMPRESSION = 0.6  # constant bitrate ~64 kbit/s at 24 kHz mono: clear speech, small stream
_AAC_BITRATE = 64_000


class Encoder(Protocol):
    def encode(self, audio: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM16 mono header; `None` = unknown length (0xFFFFFFFF), what streaming players expect."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data" + struct.pack("<I", data)
    )  # fmt: skip


class PcmEncoder:
    """Raw little-endian int16; `wav=True` prepends a RIFF header."""

    def __init__(self, sample_rate: int, streaming: bool, wav: bool = False) -> None:
        self.sample_rate, self.streaming, self.wav = sample_rate, streaming, wav
        self._started = False
        self._parts: list[bytes] = []

    def encode(self, audio: np.ndarray) -> bytes:
        pcm = to_pcm16(audio)
        if not self.streaming:
            self._parts.append(pcm)
            return b""
        if self.wav and not self._started:
            pcm = wav_header(self.sample_rate, None) + pcm
        self._started = True
        return pcm

    def finish(self) -> bytes:
        if self.streaming:
            return b"" if self._started or not self.wav else wav_header(self.sample_rate, None)
        body = b"".join(self._parts)
        self._parts.clear()
        return (wav_header(self.sample_rate, len(body)) if self.wav else b"") + body


class _Sink:
    """A seekable file for libsndfile that lets bytes go once drained; rewrites of sent bytes are dropped."""

    def __init__(self) -> None:
        self.sent = 0  # bytes already handed out
        self.buf = bytearray()  # bytes at offsets sent.. not yet handed out
        self.pos = 0

    def write(self, data: Any) -> int:
        data = bytes(data)
        start = self.pos - self.sent
        if start < 0:  # a header update at closing time: those bytes have left already
            data, start = data[-start:], 0
        end = start + len(data)
        if end > len(self.buf):
            self.buf.extend(b"\0" * (end - len(self.buf)))
        self.buf[start:end] = data
        self.pos = self.sent + end
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        size = self.sent + len(self.buf)
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int = -1) -> bytes:
        return b""  # write-only; libsndfile probes once at open

    def drain(self) -> bytes:
        out = bytes(self.buf)
        self.sent += len(out)
        self.buf.clear()
        return out


class SndfileEncoder:
    def __init__(self, fmt: str, sample_rate: int, streaming: bool) -> None:
        import soundfile as sf

        self.streaming = streaming
        self._sink = _Sink()
        container, subtype = _SNDFILE[fmt]
        extra: dict[str, Any] = {"compression_level": _MP3_COMPRESSION, "bitrate_mode": "CONSTANT"} if fmt == "mp3" else {}
        self._file = sf.SoundFile(self._sink, "w", samplerate=sample_rate, channels=1, format=container, subtype=subtype, **extra)
        if fmt == "opus":
            latency = sf._ffi.new("double*", _OPUS_PAGE_MS)
            sf._snd.sf_command(self._file._file, _SFC_SET_OGG_PAGE_LATENCY_MS, latency, sf._ffi.sizeof("double"))

    def encode(self, audio: np.ndarray) -> bytes:
        self._file.write(np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0))
        return self._sink.drain() if self.streaming else b""

    def finish(self) -> bytes:
        self._file.close()
        return self._sink.drain()


class AacEncoder:
    """AAC-LC in ADTS frames (what OpenAI returns for `aac`), through PyAV's FFmpeg encoder."""

    def __init__(self, sample_rate: int, streaming: bool) -> None:
        import av

        self.sample_rate, self.streaming = sample_rate, streaming
        self._sink = _Sink()
        self._container = av.open(self._sink, "w", format="adts")
        self._stream: Any = self._container.add_stream("aac", rate=sample_rate, layout="mono")
        self._stream.bit_rate = _AAC_BITRATE

    def _mux(self, frame: Any) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def encode(self, audio: np.ndarray) -> bytes:
        import av

        if len(audio):
            frame = av.AudioFrame.from_ndarray(
                np.clip(np.asarray(audio, dtype=np.float32), -1, 1)[None, :], format="flt", layout="mono"
            )
            frame.sample_rate = self.sample_rate
            self._mux(frame)
        return self._sink.drain() if self.streaming else b""

    def finish(self) -> bytes:
        self._mux(None)
        self._container.close()
        return self._sink.drain()


@cache
def aac_available() -> bool:
    try:
        import av

        return "aac" in av.codecs_available
    except ImportError:
        return False


def supported_formats() -> list[str]:
    return [f for f in MEDIA_TYPES if f != "aac" or aac_available()]


def make_encoder(fmt: str, sample_rate: int, streaming: bool) -> Encoder:
    if fmt in ("pcm", "wav"):
        return PcmEncoder(sample_rate, streaming, wav=fmt == "wav")
    if fmt in _SNDFILE:
        return SndfileEncoder(fmt, sample_rate, streaming)
    if fmt == "aac" and aac_available():
        return AacEncoder(sample_rate, streaming)
    if fmt == "aac":
        raise UserError("response_format 'aac' needs PyAV, which is not installed", "install `av`, or use mp3/opus/flac/wav/pcm")
    raise UserError(f"unknown response_format '{fmt}'", f"use one of: {', '.join(supported_formats())}")
