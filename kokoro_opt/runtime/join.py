"""Joining consecutive job outputs into one stream: trimmed silences and a crossfade, so seams are inaudible.

Kokoro frames every utterance with silence: ~0.25 s before the speech and ~0.6 s after it (measured on
the fp32 artifact). Concatenating jobs as they are would put ~0.9 s of silence at every seam, where a
single utterance pauses ~0.15 s at a comma and ~0.5 s at a sentence end. So at each seam the
trailing silence is cut to the pause the punctuation calls for, the next job's leading silence to
30 ms, and the two are overlapped with a 10 ms raised-cosine crossfade so no seam has a step (click).
The stream's very start keeps 30 ms of lead-in, its end 0.3 s of tail.

Two jobs cut inside a sentence and fed the words around the cut (serve/plan.Piece) are one utterance split in two:
each is decoded a little past the cut, and the two overlap by `seam` samples centred on it, crossfaded, with
nothing trimmed.
"""

from __future__ import annotations

import numpy as np

CROSSFADE_MS = 10.0  # the seams' raised-cosine crossfade
LEAD_KEEP = 0.03  # seconds kept before the first audible frame of a job
END_KEEP = 0.3  # seconds kept after the last audible frame of the whole stream
PAUSES = {"sentence": 0.42, "clause": 0.12, "word": 0.0}  # silence kept after a job, by how its text ends
SILENCE_DB = -60.0  # a 10 ms frame this far below the job's peak is silence
_SENTENCE_END = set(".!?…")
_CLAUSE_END = set(",;:—–-")
_CLOSERS = set("\"'”’)]»")


def boundary(tokens: list[int], symbols: dict[int, str]) -> str:
    """'sentence', 'clause' or 'word': how the text of these token ids ends."""
    for token in reversed(tokens):
        symbol = symbols.get(token, "")
        if symbol in _CLOSERS or symbol.isspace():
            continue
        return "sentence" if symbol in _SENTENCE_END else "clause" if symbol in _CLAUSE_END else "word"
    return "word"


def edge_silence(audio: np.ndarray, sample_rate: int, peak: float | None = None) -> tuple[int, int]:
    """Samples of silence at the start and at the end, relative to `peak` (default: the audio's own);
    all of it when nothing is audible."""
    frame = max(1, sample_rate // 100)
    n = len(audio) // frame
    if n == 0:
        return 0, 0
    rms = np.sqrt(np.mean(np.square(audio[: n * frame].reshape(n, frame), dtype=np.float64), axis=1))
    reference = float(np.abs(audio).max()) if peak is None else peak
    loud = np.flatnonzero(rms > reference * 10 ** (SILENCE_DB / 20))
    if len(loud) == 0:
        return len(audio), len(audio)
    return int(loud[0]) * frame, len(audio) - (int(loud[-1]) + 1) * frame


class Joiner:
    """Feed job outputs in order with `push`; what it returns is ready to encode and send."""

    def __init__(self, sample_rate: int, crossfade_ms: float, trim: bool = True, seam: int = 0) -> None:
        """`seam`: samples two jobs beside a cut inside a sentence overlap by: what they are decoded past the cut,
        together (the engine's joiners: 2 x steps.SEAM_STEPS steps)."""
        self.sample_rate, self.trim, self.seam = sample_rate, trim, seam
        self.n = max(0, round(sample_rate * crossfade_ms / 1000))
        self.tail: np.ndarray | None = None
        self.level = 0.0  # the current job's peak so far: parts of a job are silent against it, not their own
        self.held = np.zeros(0, np.float32)  # silence that ended the job's last part: a pause, or where it ends

    def _trimmed(self, audio: np.ndarray, last: bool, pause: float, opens: bool, closes: bool) -> np.ndarray:
        if opens:
            self.level, self.held = 0.0, self.held[:0]
        self.level = max(self.level, float(np.abs(audio).max(initial=0.0)))
        if self.level == 0.0:  # nothing audible yet: leave it alone
            return audio
        audio, self.held = np.concatenate([self.held, audio]), self.held[:0]
        lead, tail = edge_silence(audio, self.sample_rate, self.level)
        start = max(0, lead - round(LEAD_KEEP * self.sample_rate)) if opens else 0
        end = max(start, len(audio) - tail)
        if not closes:  # hold the trailing silence until the next part says whether speech goes on
            self.held = audio[end:]
            return audio[start:end]
        keep = END_KEEP if last else pause + self.n / self.sample_rate  # the crossfade overlaps the kept pause
        cut = tail - round(keep * self.sample_rate)
        if cut < 0 and not last:  # a seam with less silence than its pause (capped edges)
            return np.concatenate([audio[start:], np.zeros(-cut, dtype=np.float32)])
        return audio[start : max(start, len(audio) - cut)]

    def push(
        self,
        audio: np.ndarray,
        last: bool,
        pause: float = PAUSES["sentence"],
        *,
        opens: bool = True,
        closes: bool = True,
        seams: tuple[bool, bool] = (False, False),
    ) -> np.ndarray:
        """The next job's audio; `pause` is the silence to keep after it (see `boundary`). A job can come in
        consecutive parts (windowed decoding): only the part that `opens` it is trimmed and crossfaded at
        its start, only the one that `closes` it at its end. `seams`: whether the job goes on from the job before
        it and into the one after it, cut inside a sentence (the module's docs): those ends are not trimmed."""
        audio = np.asarray(audio, dtype=np.float32)
        after = closes and seams[1] and not last
        if opens and seams[0] and self.tail is not None and len(audio) >= len(self.tail):
            audio = self._crossfaded(audio)  # before trimming: what overlaps the job before the cut is speech
        if self.trim:
            audio = self._trimmed(audio, last, pause, opens and not seams[0], closes and not seams[1])
            if after:  # silence before the cut is speech's, not a pause to cut: the next job goes on from it
                audio, self.held = np.concatenate([audio, self.held]), self.held[:0]
        if not opens:  # a continuation of continuous audio: nothing to fade
            audio = audio if self.tail is None else np.concatenate([self.tail, audio])
            self.tail = None
        elif self.tail is not None:
            if len(audio) >= len(self.tail):
                audio = self._crossfaded(audio)
            else:  # a sliver of audio: nothing to fade into, keep every sample
                audio, self.tail = np.concatenate([self.tail, audio]), None
        n = self.seam if after else self.n
        if last or not closes or n == 0 or len(audio) <= n:
            return audio
        self.tail = audio[-n:].copy()  # held back to overlap the next job's start
        return audio[:-n]

    def _crossfaded(self, audio: np.ndarray) -> np.ndarray:
        """The held tail faded out over the start of `audio`, faded in."""
        assert self.tail is not None
        n = len(self.tail)
        fade_in, fade_out = _fades(n)
        audio = np.concatenate([self.tail * fade_out + audio[:n] * fade_in, audio[n:]])
        self.tail = None
        return audio


def _fades(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A raised-cosine fade in and out over `n` samples; the two gains sum to 1: no bump on correlated edges."""
    rise = 0.5 - 0.5 * np.cos(np.pi * (np.arange(n) + 0.5) / max(n, 1))
    return rise.astype(np.float32), (1.0 - rise).astype(np.float32)
