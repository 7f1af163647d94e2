"""A first sentence streamed as the server does (its first chunk alone, then the rest) against the same sentence
with the first chunk's front fed the next words too (only the chunk's frames decoded), both against the sentence
decoded whole.

    .venv/bin/python benchmarks/first_chunk_lookahead.py [ARTIFACT] [--size 40] [--words 2] [--sentences 12]

For the evaluation corpus's and the calibration texts' sentences whose first chunk is cut at words, each way is
decoded windowed (kokoro_opt.runtime.windowed, the server's decoder: first window, then its finish or windows) and
joined with the server's joiner; the whole sentence is one job. Per way: the joined sentence's length against the
whole one's, PESQ-WB (mean / worst) and MCD (DTW-aligned) against it. Voice: the corpus's first. A measurement
of a next step (docs/measurements/2026-12-07-first-chunk-endings.md), not what `serve` does.
"""

from __future__ import annotations

import argparse

import numpy as np


def _positive(value: str) -> int:
    if int(value) < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return int(value)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.chunking import chunk_text
    from kokoro_opt.evaluate import metrics as M
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.first_chunk import benchmark_texts, cut_at_words
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.runtime import open_synthesizer
    from kokoro_opt.runtime.join import CROSSFADE_MS, PAUSES, Joiner
    from kokoro_opt.runtime.windowed import STEPS_PER_FRAME, WindowedDecoder
    from kokoro_opt.tables import print_table
    from kokoro_opt.text import utterance_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", default="artifacts/int8-mixed")
    parser.add_argument("--size", type=int, default=40, help="first_chunk_tokens")
    parser.add_argument("--words", type=_positive, default=2, help="words of the sentence fed after the first chunk")
    parser.add_argument("--sentences", type=int, default=12)
    args = parser.parse_args()

    synth = open_synthesizer(args.artifact)
    decoder = WindowedDecoder.of_artifact(synth)
    corpus = load_corpus()
    voice = next(v for v in corpus.voices if v in synth.packs)
    pack, rate, space = synth.packs[voice], synth.sample_rate, synth.vocab[" "]
    texts = benchmark_texts()

    def decoded(tokens: list[int], ahead: list[int] | None = None, behind: list[int] | None = None) -> np.ndarray:
        """A job's speech as the server decodes it; with `ahead` (after it) or `behind` (before it), the front sees
        those tokens too and only `tokens` is decoded, from the end of the frames before it or up to the end of its
        last token's frames."""
        before = behind or []
        job = decoder.start([*before, *tokens, *(ahead or [])], pack)
        frames = np.cumsum(job.front.durations)
        start, end = job.speech
        if before:
            start = STEPS_PER_FRAME * int(frames[len(before)])
        if ahead:
            end = STEPS_PER_FRAME * int(frames[len(before) + len(tokens)])
        job.speech, job.cursor = (start, end), start
        parts = [decoder.next_window(job)]
        while not job.done:
            parts.append(decoder.finish(job) if job.finish else decoder.next_window(job))
        return np.concatenate(parts)

    def joined(jobs: list[tuple[np.ndarray, str]]) -> np.ndarray:
        joiner = Joiner(rate, CROSSFADE_MS)
        return np.concatenate([joiner.push(a, k == len(jobs) - 1, PAUSES[end]) for k, (a, end) in enumerate(jobs)])

    rows: dict[str, list[tuple[float, float, float]]] = {"alone": [], "lookahead": [], "both sides": []}
    for text in texts:
        ids = utterance_tokens(text, synth.vocab)
        chunks = chunk_text(text, synth.vocab, first_chunk_tokens=args.size, chunk_tokens=2 * args.size)
        first, rest = chunks[0].token_ids, [t for c in chunks[1:] for t in [space, *c.token_ids]][1:]
        at_words = len(chunks) > 1 and cut_at_words(chunks[0].text)
        if not (at_words and ids[: len(first)] == first and len(ids) <= 320):
            continue
        whole = joined([(decoded(ids), "sentence")])
        spaces = [i for i, t in enumerate(rest) if t == space][: args.words]
        ahead = [space, *rest[: spaces[-1] if len(spaces) == args.words else len(rest)]]
        starts = [i for i, t in enumerate(first) if t == space][-args.words :]
        behind = [*first[starts[0] + 1 :], space] if len(starts) == args.words else [*first, space]
        tail = decoded(rest)
        ways = (("alone", None, tail), ("lookahead", ahead, tail), ("both sides", ahead, decoded(rest, behind=behind)))
        for way, feed, after in ways:
            streamed = joined([(decoded(first, feed), "word"), (after, "sentence")])
            mcd = M.mel_distance(whole, streamed, rate).mcd
            rows[way].append((len(streamed) / len(whole), M.pesq_wb(whole, streamed, rate), mcd))
        if len(rows["alone"]) == args.sentences:
            break

    table = Table(title=f"first sentences, first chunk {args.size} tokens, {voice} ({describe(fingerprint())})")
    for column in ("first chunk", "sentences", "length vs whole", "PESQ-WB vs whole", "MCD dB vs whole"):
        table.add_column(column, justify="right")
    labels = {"alone": "alone", "lookahead": f"with the next {args.words} words",
              "both sides": f"and the rest with the {args.words} words before it"}  # fmt: skip
    for way, label in labels.items():
        if not rows[way]:  # no first sentence here is cut at words
            continue
        length, pesq, mcd = (np.array(v) for v in zip(*rows[way], strict=True))
        table.add_row(label, str(len(length)), f"{np.median(length):.3f}", f"{np.mean(pesq):.2f} / {np.min(pesq):.2f}",
                      f"{np.mean(mcd):.2f}")  # fmt: skip
    print_table(Console(), table)


if __name__ == "__main__":
    main()
