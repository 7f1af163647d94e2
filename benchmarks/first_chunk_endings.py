"""Where the server's first chunk of a long sentence ends, and how its last word is timed spoken alone.

    .venv/bin/python benchmarks/first_chunk_endings.py [ARTIFACT] [--sizes 32,40,56] [--texts FILE] [--lookahead 2]

A first chunk cut at a word is spoken alone, so its last word gets a sentence's final lengthening
(kokoro_opt.phrasing). For every sentence of the evaluation corpus, the calibration texts and `--texts` (one
sentence a line) longer than the size, the model's own durations (kokoro_opt.first_chunk.DurationModel, no audio)
give, per first-chunk size: how many of the first chunks cut at words (not at a clause) end on a function word,
and for those tokenized alone as inside their sentence the chunk's timing distortion and the last word's frames
alone / in its sentence (median, 90th percentile, worst), for three voices. `--lookahead N`: the same, with the
chunk fed to the model followed by the next N words of its sentence (its own tokens timed): how much of the
distortion is the utterance ending there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def last_word(token_ids: list[int], space: int) -> slice:
    """The positions of a chunk's last word in the model's durations (the leading pad first)."""
    after = max((i for i, t in enumerate(token_ids) if t == space), default=-1) + 1
    return slice(1 + after, 1 + len(token_ids))


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.chunking import chunk_text
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.first_chunk import DurationModel, benchmark_texts, cut_at_words, distortion, stretch
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.phrasing import ends_phrase
    from kokoro_opt.tables import print_table
    from kokoro_opt.text import utterance_tokens
    from kokoro_opt.text_spans import last_words

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="artifacts/int8-mixed")
    parser.add_argument("--sizes", default="32,40,56", help="first_chunk_tokens to measure")
    parser.add_argument("--texts", type=Path, help="more sentences, one a line")
    parser.add_argument("--lookahead", type=int, default=0, help="also time each chunk with its sentence's next N words after it")
    args = parser.parse_args()

    model = DurationModel(open_artifact(args.artifact))
    corpus = load_corpus()
    texts = benchmark_texts(args.texts)
    voices = [v for v in corpus.voices if v in model.packs][:3] or sorted(model.packs)[:3]
    space = model.vocab[" "]

    table = Table(title=f"first chunks of long sentences, {len(voices)} voices ({describe(fingerprint())})")
    for column in (
        "size",
        "cut at words: end on a function word",
        "chunk distortion (sentences)",
        "last word alone / in sentence",
        *(f"with {args.lookahead} more words: chunk / last word" for _ in range(args.lookahead > 0)),
    ):
        table.add_column(column, justify="right")
    for size in (int(k) for k in args.sizes.split(",")):
        cut, timed = [], []  # first chunks cut at words inside their sentence; those tokenized alone as inside it
        timings = {ahead: ([], []) for ahead in {0, args.lookahead}}  # chunk stretches, last-word stretches
        for text in texts:
            ids = utterance_tokens(text, model.vocab)
            first = chunk_text(text, model.vocab, first_chunk_tokens=size, chunk_tokens=2 * size)[0]
            if len(first.token_ids) < len(ids) and cut_at_words(first.text):
                cut.append(first.text)
                if ids[: len(first.token_ids)] == first.token_ids:  # a word phonemized otherwise: not comparable
                    # the sentence's tokens up to each number of words after the chunk
                    spaces = [i for i, t in enumerate(ids) if t == space and i > len(first.token_ids)] + [len(ids)]
                    fed = {ahead: ids[: spaces[min(ahead, len(spaces)) - 1]] if ahead else first.token_ids for ahead in timings}
                    timed.append((ids, first.token_ids, fed))
        for voice in voices:
            for ids, first, fed in timed:
                in_sentence = model(ids, voice)
                for ahead, (chunks, words) in timings.items():
                    alone = model(fed[ahead], voice)  # timed over the chunk's own tokens
                    chunks.append(stretch(alone, in_sentence, len(first)))
                    span = last_word(first, space)
                    words.append(float(np.sum(alone[span]) / max(float(np.sum(in_sentence[span])), 1.0)))
        chunks, words = timings[0]
        ending = f"{sum(not ends_phrase(last_words(text)) for text in cut)} of {len(cut)}"
        if not timed:  # none of this size tokenized alone as in its sentence: nothing to time
            table.add_row(str(size), ending, *("–" for _ in range(2 + (args.lookahead > 0))))
            continue
        row = [
            str(size),
            ending,
            f"{distortion(chunks):.3f} ({len(timed)})",
            f"{np.median(words):.2f} / {np.percentile(words, 90):.2f} / {max(words):.2f}",
        ]
        if args.lookahead:
            chunks, words = timings[args.lookahead]
            row.append(f"{distortion(chunks):.3f} / {np.median(words):.2f}, {np.percentile(words, 90):.2f}, {max(words):.2f}")
        table.add_row(*row)
    print_table(Console(), table)


if __name__ == "__main__":
    main()
