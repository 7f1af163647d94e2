"""How much prosody a small first chunk loses: the first chunk synthesized alone (as `serve` sends it)
vs the same words inside the whole sentence, for several first-chunk sizes.

    .venv/bin/python benchmarks/first_chunk_prosody.py artifacts/fp32 --sizes 16,24,32,40,56

For each sentence (the evaluation corpus, then --texts) longer than the largest size, the span is the first chunk's
tokens (the leading pad's silence left out); in the whole sentence it is cut at the frames the
model's own durations give it. Per size: the F0 difference (median over frames voiced in both, in
cents, contours stretched to one length), MCD (DTW-aligned), the span's length alone / in context,
and PESQ-WB where both spans last at least a second (PESQ does not score shorter clips reliably).
Prosody is the model's, not the precision's: run it on the fp32 artifact.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kokoro_opt.chunking import chunk_text
from kokoro_opt.evaluate import metrics as M
from kokoro_opt.evaluate.corpus import load_corpus
from kokoro_opt.runtime import open_synthesizer
from kokoro_opt.text import CONTEXT_TOKENS, utterance_tokens

MIN_PESQ_SECONDS = 1.0


def f0_cents(reference: np.ndarray, test: np.ndarray, rate: int) -> float:
    """Median |F0 difference| in cents over frames voiced in both, the contours stretched to one length."""
    import librosa

    def contour(audio: np.ndarray) -> np.ndarray:
        f0, voiced, _ = librosa.pyin(audio.astype(np.float32), fmin=60, fmax=500, sr=rate, frame_length=1024)
        return np.where(voiced, f0, np.nan)

    a, b = contour(reference), contour(test)
    n = min(len(a), len(b))
    if n < 4:
        return math.nan
    grid = np.linspace(0, 1, n)
    a = np.interp(grid, np.linspace(0, 1, len(a)), a)
    b = np.interp(grid, np.linspace(0, 1, len(b)), b)
    both = np.isfinite(a) & np.isfinite(b)
    return float(np.median(np.abs(1200 * np.log2(a[both] / b[both])))) if both.any() else math.nan


def token_span(audio: np.ndarray, durations: np.ndarray, tokens: int) -> np.ndarray:
    """The audio of tokens 1..`tokens` (after the leading pad), by the model's frame durations."""
    per_frame = len(audio) / float(np.sum(durations))
    start, end = float(durations[0]), float(np.sum(durations[: tokens + 1]))
    return audio[round(start * per_frame) : round(end * per_frame)]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--sizes", default="16,24,32,40,56")
    parser.add_argument("--sentences", type=int, default=8)
    parser.add_argument("--voice", default=None)
    parser.add_argument("--texts", default="calibration/sentences.txt", help="more sentences, one a line, after the corpus")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    synth = open_synthesizer(args.artifact)
    voice = args.voice or synth.voices[0]
    rate = synth.sample_rate
    picked = []
    texts = [s.text for s in load_corpus().sentences] + Path(args.texts).read_text(encoding="utf-8").splitlines()
    for text in (t.strip() for t in texts if t.strip()):
        ids = utterance_tokens(text, synth.vocab)  # the whole sentence (chunk_text would cut its first clause)
        if max(sizes) + 8 < len(ids) <= CONTEXT_TOKENS:
            picked.append((text, ids))
        if len(picked) == args.sentences:
            break
    rows: dict[int, list[tuple[float, ...]]] = {k: [] for k in sizes}
    for text, ids in picked:
        context = synth.run_tokens(ids, voice)
        for k in sizes:
            first = chunk_text(text, synth.vocab, first_chunk_tokens=k, chunk_tokens=510)[0].token_ids
            if ids[: len(first)] != first:  # phonemized differently alone: not the same words
                continue
            alone = synth.run_tokens(first, voice)
            ref = token_span(context.audio, context.durations, len(first))
            test = token_span(alone.audio, alone.durations, len(first))
            long_enough = min(len(ref), len(test)) >= MIN_PESQ_SECONDS * rate
            pesq = M.pesq_wb(ref, test, rate) if long_enough else math.nan
            mcd = M.mel_distance(ref, test, rate).mcd
            rows[k].append((len(first), f0_cents(ref, test, rate), mcd, len(test) / len(ref), pesq))
    table = Table(title=f"first chunk alone vs in its sentence: {args.artifact}, voice {voice}, {len(picked)} sentences")
    for column in ("first_chunk_tokens", "tokens (median)", "F0 diff cents", "MCD dB", "length ratio", "PESQ (>= 1 s)", "n"):
        table.add_column(column, justify="right")
    for k, found in rows.items():
        if not found:
            continue
        tokens, cents, mcd, ratio, pesq = (np.array(col, dtype=float) for col in zip(*found, strict=True))
        scored = pesq[np.isfinite(pesq)]
        table.add_row(
            str(k), f"{np.median(tokens):.0f}", f"{np.nanmedian(cents):.0f}", f"{np.nanmean(mcd):.2f}",
            f"{np.median(ratio):.2f}", f"{scored.mean():.2f} ({len(scored)})" if len(scored) else "—", str(len(found)),
        )  # fmt: skip
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
