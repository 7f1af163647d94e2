"""How a request's text becomes synthesis jobs, and how job outputs are joined without clicks.

Text is cut once into small *pieces* (`chunk_text` with the first-chunk size for every piece: sentence,
then clause, then word boundaries; nothing is ever truncated). The worker then merges consecutive
pieces into one job as large as the listener's buffered audio allows (see `Engine`), up to
`chunk_tokens`. So the first job is small (fast first audio) and later ones grow to full chunks once
the stream is ahead of real time; under load jobs stay small so no stream falls behind.
Merging appends token ids with a space between them, which is what phonemizing the joined text gives.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from kokoro_opt.text import CONTEXT_TOKENS, chunk_text


def make_pieces(text: str, vocab: dict[str, int], first_chunk_tokens: int, piece_tokens: int) -> list[list[int]]:
    """Token ids of each piece, in order; the first piece is the small first chunk."""
    chunks = chunk_text(text, vocab, first_chunk_tokens=first_chunk_tokens, chunk_tokens=piece_tokens)
    return [chunk.token_ids for chunk in chunks]


def take_job(pieces: deque[list[int]], budget_tokens: int, space_id: int | None) -> list[int]:
    """Pop the first piece and merge following ones while the job stays within the budget (and 510)."""
    job = list(pieces.popleft())
    glue = [space_id] if space_id is not None else []
    limit = min(budget_tokens, CONTEXT_TOKENS)
    while pieces and len(job) + len(glue) + len(pieces[0]) <= limit:
        job += glue + pieces.popleft()
    return job


class Crossfader:
    """Joins consecutive job outputs with a short raised-cosine crossfade.

    Each output's last `crossfade_ms` is held back and overlapped with the start of the next one, so a
    seam never has a step (a click) whatever the two edge samples are; the held tail is tiny next to a
    job's audio, so it delays nothing a listener hears. The last job's tail is emitted as is.
    """

    def __init__(self, sample_rate: int, crossfade_ms: float) -> None:
        self.n = max(0, round(sample_rate * crossfade_ms / 1000))
        rise = 0.5 - 0.5 * np.cos(np.pi * (np.arange(self.n) + 0.5) / max(self.n, 1))
        self.fade_in = rise.astype(np.float32)
        self.fade_out = (1.0 - rise).astype(np.float32)  # the two gains sum to 1: no bump on correlated edges
        self.tail: np.ndarray | None = None

    def push(self, audio: np.ndarray, last: bool) -> np.ndarray:
        audio = np.asarray(audio, dtype=np.float32)
        n = self.n
        if self.tail is not None:
            if len(audio) >= n:
                audio = np.concatenate([self.tail * self.fade_out + audio[:n] * self.fade_in, audio[n:]])
            else:  # a sliver of audio: nothing to fade into, keep every sample
                audio = np.concatenate([self.tail, audio])
            self.tail = None
        if last or n == 0 or len(audio) <= n:
            return audio
        self.tail = audio[-n:].copy()
        return audio[:-n]


def seconds_to_tokens(seconds: float, sec_per_token: float) -> int:
    return max(0, math.floor(seconds / max(sec_per_token, 1e-6)))
