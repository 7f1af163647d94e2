"""What a small first chunk costs in prosody, as one number per size: its *timing distortion*.

The server speaks a sentence's first chunk alone, to start sooner. Kokoro's duration predictor sees
the whole utterance, so the chunk alone is timed like a whole sentence (mostly final lengthening):
the same words last longer, or shorter, than inside their sentence. Distortion = the factor between
the frames of the chunk's tokens spoken alone and of the same tokens in their sentence, whichever
way round (1.0 = same timing). It is read from the model's own durations output, so it is exact and
needs no audio analysis. Of what benchmarks/first_chunk_prosody.py measures (F0, MCD, PESQ), timing
is the one that moves with the size. `kokoro-opt tune` holds first_chunk_tokens to a budget with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.chunking import Chunk, chunk_text
from kokoro_opt.errors import UserError
from kokoro_opt.runtime.feeds import model_feeds
from kokoro_opt.text import CONTEXT_TOKENS, utterance_tokens
from kokoro_opt.text_spans import ends_at_clause
from kokoro_opt.voices import style_for

SENTENCES = 8  # sentences per voice and size
VOICES = 3  # voices, the evaluation corpus's first (else the speaker's own, sorted)


def cut_at_words(first: str) -> bool:
    """Whether a first chunk's text, shorter than its sentence, ends at a word (or at the end of an earlier sentence of
    the same line), not at a clause mark."""
    return not ends_at_clause(first)


def benchmark_texts(extra: Path | None = None) -> list[str]:
    """What the first-chunk benchmarks cut: the evaluation corpus's sentences, the calibration and sensitivity texts,
    then `extra`'s lines."""
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.passes.qdq import CALIBRATION_CORPUS, read_corpus
    from kokoro_opt.passes.sensitivity import SENSITIVITY_CORPUS

    texts = [s.text for s in load_corpus().sentences] + read_corpus(CALIBRATION_CORPUS) + read_corpus(SENSITIVITY_CORPUS)
    if extra is not None:
        texts += [line.strip() for line in extra.read_text(encoding="utf-8").splitlines() if line.strip()]
    return texts


def stretch(alone: np.ndarray, in_sentence: np.ndarray, tokens: int) -> float:
    """Frames of a first chunk's `tokens` spoken alone / frames of the same tokens at the start of their
    sentence; both are the model's durations output (the leading pad first)."""
    span = slice(1, tokens + 1)
    return float(np.sum(alone[span]) / max(float(np.sum(in_sentence[span])), 1.0))


def distortion(stretches: Iterable[float]) -> float:
    """Median timing distortion: a stretch of 0.8 counts as 1.25, as much as one of 1.25."""
    return float(np.median([max(s, 1.0 / s) for s in stretches if s > 0]))


def within_budget(sizes: list[int], measured: dict[int, float], budget: float) -> list[int]:
    """The sizes whose measured distortion is within `budget`, in their order (an unmeasured size, too
    long for every sentence, stays: it is the whole sentence)."""
    return [k for k in sizes if measured.get(k, 1.0) <= budget]


class DurationModel:
    """Only the front of an ONNX artifact's graph, up to its `durations` output: the timing of an
    utterance without decoding it (measured 8x faster than a whole run on int8-mixed, same durations)."""

    def __init__(self, artifact: Artifact) -> None:
        import onnx
        import onnx.utils

        from kokoro_opt.runtime.session import make_session

        try:  # a fetched artifact's graph: external data outside its folder, or no protobuf at all
            model = onnx.load(str(artifact.model_file))
        except Exception as exc:  # onnx raises its checker's, protobuf's and OS errors alike
            raise UserError(f"{artifact.model_file} is not a loadable ONNX model ({type(exc).__name__}: {exc})"[:500],
                            "rebuild the artifact, or fetch it again") from None  # fmt: skip
        if "durations" not in {o.name for o in model.graph.output}:
            raise UserError(f"{artifact.path} has no durations output", "measure a kokoro-opt ONNX artifact")
        constants = {i.name for i in model.graph.initializer}
        inputs = [i.name for i in model.graph.input if i.name not in constants]
        front = onnx.utils.Extractor(model).extract_model(inputs, ["durations"])
        self.session = make_session(front.SerializeToString())
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.vocab: dict[str, int] = artifact.kokoro["vocab"]
        self.packs = artifact.voice_packs()

    def __call__(self, token_ids: list[int], voice: str) -> np.ndarray:
        style = style_for(self.packs[voice], len(token_ids))
        return np.asarray(self.session.run(None, model_feeds(token_ids, style, 1.0, names=self.inputs))[0]).reshape(-1)


def distortion_by_size(
    model: DurationModel,
    sizes: Iterable[int],
    texts: Iterable[str],
    sentences: int = SENTENCES,
    voices: int = VOICES,
    context_words: int = 0,
) -> dict[int, float]:
    """Median distortion of each first-chunk size, over the first `sentences` texts longer than every
    size spoken by each of `voices` voices (the evaluation corpus's, else the model's own); a size
    whose chunk is phonemized differently alone than in its sentence skips that sentence. With
    `context_words`, a chunk cut at words is timed as the server speaks it: fed the words after it
    (`chunk_text`'s context), which come out of its size."""
    from kokoro_opt.evaluate.corpus import load_corpus

    sizes = sorted(set(sizes))
    voice_names = [v for v in load_corpus().voices if v in model.packs][:voices] or sorted(model.packs)[:voices]
    picked: list[tuple[list[int], dict[int, Chunk]]] = []
    for text in texts:
        ids = utterance_tokens(text, model.vocab)  # the sentence in one piece, as evaluations speak it
        if max(sizes) + 8 < len(ids) <= CONTEXT_TOKENS:
            firsts = {k: chunk_text(text, model.vocab, k, CONTEXT_TOKENS, context_words=context_words)[0] for k in sizes}
            picked.append((ids, {k: c for k, c in firsts.items() if ids[: len(c.token_ids)] == c.token_ids}))
        if len(picked) == sentences:
            break
    found: dict[int, list[float]] = {k: [] for k in sizes}
    for voice in voice_names:
        for ids, firsts in picked:
            in_sentence = model(ids, voice)
            for k, first in firsts.items():
                found[k].append(stretch(model(first.token_ids + first.ahead, voice), in_sentence, len(first.token_ids)))
    return {k: distortion(v) for k, v in found.items() if v}
