"""Sentences streamed as the server cuts and decodes them, with 0, 1 or 2 words of context on each side of a cut at
words (`serve --context-words`), each against the sentence decoded whole.

    .venv/bin/python benchmarks/first_chunk_lookahead.py [ARTIFACT] [--size 40] [--context 0,1,2] [--sentences 12]

For the evaluation corpus's and the calibration texts' sentences whose first chunk is cut at words (up to 320
tokens), the server's pieces (`serve.plan.make_pieces`: a first chunk of `--size` tokens, later pieces of twice
that) are each decoded as the windowed server decodes a lone listener's job (first window, then its finish or
windows, only the piece's own frames) and joined by the server's joiner (`Engine.join`); the whole sentence is one
job. Per setting: the joined sentence's length against the whole one's, PESQ-WB (mean / worst) and MCD (DTW-aligned)
against it, and the tokens the first front runs over. Voice: the corpus's first.
"""

from __future__ import annotations

import argparse
from typing import cast

import numpy as np


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.chunking import chunk_text
    from kokoro_opt.evaluate import metrics as M
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.first_chunk import benchmark_texts, cut_at_words
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.runtime import open_synthesizer
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.plan import Piece, make_pieces
    from kokoro_opt.tables import print_table
    from kokoro_opt.text import utterance_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="artifacts/int8-mixed")
    parser.add_argument("--size", type=int, default=40, help="first_chunk_tokens")
    parser.add_argument("--context", default="0,1,2", help="context_words settings to compare, comma separated")
    parser.add_argument("--sentences", type=int, default=12)
    args = parser.parse_args()
    settings = [int(k) for k in args.context.split(",")]

    synth = open_synthesizer(args.artifact)
    engine = Engine(cast(Selection, None), ServeConfig(windowed=True, warmup=False))
    engine.attach(synth)
    decoder = engine.mode.decoder
    corpus = load_corpus()
    voice = next(v for v in corpus.voices if v in synth.packs)
    pack, rate = synth.packs[voice], synth.sample_rate

    def decoded(piece: Piece) -> np.ndarray:
        """A job's speech as the windowed server decodes a lone listener's: first window, then finish or windows."""
        job = decoder.start(piece.feed, pack, context=piece.context)
        parts = [decoder.next_window(job)]
        while not job.done:
            parts.append(decoder.finish(job) if job.finish else decoder.next_window(job))
        return np.concatenate(parts)

    def streamed(pieces: list[Piece]) -> np.ndarray:
        joiner = engine.new_joiner()
        return np.concatenate([engine.join(joiner, p, decoded(p), k == len(pieces) - 1, 1.0) for k, p in enumerate(pieces)])

    rows: dict[int, list[tuple[float, float, float, int]]] = {k: [] for k in settings}
    for text in benchmark_texts():
        ids = utterance_tokens(text, synth.vocab)
        chunks = chunk_text(text, synth.vocab, first_chunk_tokens=args.size, chunk_tokens=2 * args.size)
        if not (len(chunks) > 1 and cut_at_words(chunks[0].text) and ids[: len(chunks[0].token_ids)] == chunks[0].token_ids):
            continue
        if len(ids) > 320:
            continue
        whole = streamed([Piece(ids)])
        for k in settings:
            pieces = make_pieces(text, synth.vocab, args.size, 2 * args.size, k)
            audio = streamed(pieces)
            mcd = M.mel_distance(whole, audio, rate).mcd
            rows[k].append((len(audio) / len(whole), M.pesq_wb(whole, audio, rate), mcd, len(pieces[0])))
        if len(rows[settings[0]]) == args.sentences:
            break

    table = Table(title=f"first sentences cut at words, first chunk {args.size} tokens, {voice} ({describe(fingerprint())})")
    for column in ("context words", "sentences", "length vs whole", "PESQ-WB vs whole", "MCD dB vs whole", "first front tokens"):
        table.add_column(column, justify="right")
    for k in settings:
        if not rows[k]:  # no first sentence here is cut at words
            continue
        length, pesq, mcd, first = (np.array(v) for v in zip(*rows[k], strict=True))
        table.add_row(str(k), str(len(length)), f"{np.median(length):.3f}", f"{np.mean(pesq):.2f} / {np.min(pesq):.2f}",
                      f"{np.mean(mcd):.2f}", f"{np.mean(first):.1f}")  # fmt: skip
    print_table(Console(), table)


if __name__ == "__main__":
    main()
