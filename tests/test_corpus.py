"""The evaluation corpus: held out from calibration, varied, its short-phrase slice scored apart, and the
inputs the edge check feeds a model."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kokoro_opt.evaluate.corpus import KINDS, load_corpus
from kokoro_opt.recipe import DEFAULT_SENTENCES

ROOT = Path(__file__).resolve().parents[1]


def test_corpus_is_held_out_varied_and_long_enough(vocab: dict[str, int]) -> None:
    from kokoro_opt.recipe import CORPUS_SENTENCES
    from kokoro_opt.text import CONTEXT_TOKENS, phonemize, tokenize

    corpus = load_corpus()
    assert len(corpus.sentences) == CORPUS_SENTENCES >= 40  # the most --sentences and the gates' may ask for
    assert {s.kind for s in corpus.sentences[:8]} == set(KINDS)  # the default 8 already cover every kind
    texts = {s.text for s in corpus.sentences}
    calibration = ROOT / "calibration" / "sentences.txt"
    if calibration.is_file():
        lines = {ln.strip() for ln in calibration.read_text(encoding="utf-8").splitlines() if not ln.startswith("#")}
        assert not texts & lines
    assert not texts & set(DEFAULT_SENTENCES)
    assert len(tokenize(phonemize(corpus.paragraph), vocab)) >= 400
    assert all(0 < len(tokenize(phonemize(t), vocab)) <= CONTEXT_TOKENS for t in texts)
    from kokoro_opt.weights.sources import offline_voice_packs

    assert set(corpus.voices) <= set(offline_voice_packs())


def test_the_short_phrase_slice_is_short_held_out_and_scored_after_the_sentences(vocab: dict[str, int]) -> None:
    from kokoro_opt.evaluate.corpus import PHRASE
    from kokoro_opt.serve.bench import PHRASES
    from kokoro_opt.text import phonemize, tokenize

    corpus = load_corpus()
    assert len(corpus.phrases) >= 10 and {p.kind for p in corpus.phrases} == {PHRASE}
    assert all(len(tokenize(phonemize(p.text), vocab)) <= 30 for p in corpus.phrases)  # 1-4 words
    assert not {p.text.lower().rstrip(".") for p in corpus.phrases} & set(PHRASES)  # bench-serve's are its own
    picked = corpus.utterances(2, list(corpus.voices), phrases=3)
    assert [u.sentence.kind == PHRASE for u in picked] == [False, False, True, True, True]
    assert [u.sentence.id for u in picked[2:]] == [p.id for p in corpus.phrases[:3]]
    assert len(corpus.utterances(2, list(corpus.voices))) == 2  # none unless asked


def test_corpus_hash_is_recorded_in_the_docs() -> None:
    documented = re.search(r"corpus sha256: `([0-9a-f]{64})`", (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8"))
    assert documented and documented.group(1) == load_corpus().sha256, "corpus changed: update docs/evaluation.md"


def test_edge_inputs_cover_one_word_punctuation_and_a_full_context(vocab: dict[str, int]) -> None:
    from kokoro_opt.evaluate.edge import check_edge_inputs, edge_token_inputs

    inputs = edge_token_inputs(vocab, load_corpus().paragraph)
    assert [len(t) > 0 for t in inputs.values()] == [True, True, True] and len(inputs["500 tokens"]) == 500
    assert len({len(t) for t in inputs.values()}) == 3  # the fake model below tells them apart by length
    outputs = {len(inputs["one word"]): np.full(100, np.nan), len(inputs["punctuation only"]): np.zeros(100)}
    verdict = check_edge_inputs(lambda tokens: outputs.get(len(tokens), np.full(100, 0.3)), inputs)
    silent = "NaN or silent output"
    assert verdict == {"one word": silent, "punctuation only": silent, "500 tokens": None}

    def fails_on_long(tokens: list[int]) -> np.ndarray:
        if len(tokens) == 500:
            raise RuntimeError("model error")
        return np.full(100, 0.3)

    # a crash is reported as the crash it was, not as silence
    expected = {"one word": None, "punctuation only": None, "500 tokens": "raised RuntimeError: model error"}
    assert check_edge_inputs(fails_on_long, inputs) == expected


def test_voices_and_speeds_are_assigned_round_robin() -> None:
    corpus = load_corpus()
    utts = corpus.utterances(9, ["jf_alpha", "jf_nezumi", "jm_kumo", "jf_tebukuro"])
    assert {(u.voice, u.speed) for u in utts} == {(v, s) for v in corpus.voices for s in corpus.speeds}
    tiny = corpus.utterances(3, ["tiny_1", "tiny_0"])  # a model without the corpus voices speaks with its own
    assert [u.voice for u in tiny] == ["tiny_0", "tiny_1", "tiny_0"]
