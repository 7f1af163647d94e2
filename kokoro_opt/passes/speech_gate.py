"""The gate a stage holds its speech to (recipe.SpeechGate): each utterance of the evaluation corpus, spoken by
the stage's way (capped edges, windowed decoding) and by the same model's reference way, scored PESQ-WB and by
its 4-12 kHz energy share; the sentences and the short-phrase slice summarised apart; the budget checked."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.recipe import SpeechBudget, SpeechGate


def gate_utterances(cfg: SpeechGate, voices: list[str], vocab: dict[str, int]) -> Iterator[tuple[Any, list[int]]]:
    """(corpus utterance, its token ids) for the gate's sentences, then its phrases, voices round robin."""
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.text import utterance_tokens

    for utterance in load_corpus().utterances(cfg.check_sentences, voices, cfg.check_phrases):
        yield utterance, utterance_tokens(utterance.sentence.text, vocab)


def score(utterance: Any, reference: np.ndarray, speech: np.ndarray, rate: int, **facts: Any) -> dict[str, Any]:
    """One row: `speech` against `reference` (the same samples the reference way)."""
    from kokoro_opt.evaluate import metrics as M

    pesq = M.pesq_wb(reference, speech, rate)
    return {
        "utterance": utterance.sentence.id,
        "kind": utterance.sentence.kind,
        **facts,
        "pesq": round(pesq, 3) if math.isfinite(pesq) else None,
        "high_band_db": round(M.high_band_ratio_db(reference, speech, rate), 3),
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows and their summary: each kind's mean and worst PESQ, the worst of all (and which utterance it is),
    the largest 4-12 kHz move."""
    from kokoro_opt.evaluate.corpus import PHRASE

    def scores(phrases: bool) -> list[float]:
        return [r["pesq"] for r in rows if r["pesq"] is not None and (r["kind"] == PHRASE) == phrases]

    def rounded(values: list[float], how: Any) -> float | None:
        return round(float(how(values)), 3) if values else None

    sentences, phrases = scores(False), scores(True)
    scored = [r for r in rows if r["pesq"] is not None]
    return {
        "utterances": rows,
        "pesq_mean": rounded(sentences, np.mean),
        "pesq_min": rounded(sentences, np.min),
        "phrase_pesq_mean": rounded(phrases, np.mean),
        "phrase_pesq_min": rounded(phrases, np.min),
        "utterance_pesq_min": rounded(sentences + phrases, np.min),
        "worst_utterance": min(scored, key=lambda r: r["pesq"])["utterance"] if scored else None,
        "high_band_db_max": round(max((abs(r["high_band_db"]) for r in rows), default=0.0), 3),
    }


GATE_COLUMNS = ("PESQ mean", "worst sentence", "worst utterance (which)", "phrases", "4-12 kHz dB (max)")


def gate_cells(summary: dict[str, Any]) -> tuple[str, ...]:
    """A `summarise` result as the cells of a table with GATE_COLUMNS (the benchmarks' tables)."""
    s = summary
    return (
        f"{s['pesq_mean']:.3f}",
        f"{s['pesq_min']:.3f}",
        f"{s['utterance_pesq_min']:.3f} ({s['worst_utterance']})",
        f"{s['phrase_pesq_mean']:.3f}",
        f"{s['high_band_db_max']:.2f}",
    )


def speaks(artifact: Any) -> bool:
    """Whether the artifact's weights speak. Random weights (the tiny test model) make noise, and PESQ of noise
    against noise measures nothing: the stages record such scores without judging them."""
    return artifact.kokoro.get("weights", {}).get("source") != "tiny"  # kokoro.json: every stage's output has it


def judge(scores: dict[str, Any], cfg: SpeechBudget, artifact: Any) -> list[str]:
    """Records on `scores` whether the artifact's weights speak and which budgets its speech misses; returns the
    misses a stage raises: none on random weights."""
    scores["judged"] = speaks(artifact)
    scores["failures"] = gate_failures(scores, cfg)
    return scores["failures"] if scores["judged"] else []


def require_within_budget(scores: dict[str, Any], cfg: SpeechBudget, artifact: Any, what: str, hint: str) -> None:
    """`judge`, and one UserError naming `what` changed the speech and each budget it missed."""
    failures = judge(scores, cfg, artifact)
    if failures:
        raise UserError(f"{what} changes the speech beyond the budget: {'; '.join(failures)}", hint)


def gate_failures(scores: dict[str, Any], cfg: SpeechBudget) -> list[str]:
    """Why the speech is outside the budget (empty when it is within)."""
    checks = [
        (scores["pesq_mean"], cfg.min_pesq, "mean PESQ {} < min_pesq {}", False),
        (scores["utterance_pesq_min"], cfg.min_sentence_pesq, "worst utterance PESQ {} < min_sentence_pesq {}", False),
        (scores["phrase_pesq_mean"], cfg.min_phrase_pesq, "phrase PESQ {} < min_phrase_pesq {}", False),
        (scores["high_band_db_max"], cfg.max_high_band_db, "4-12 kHz energy moved {} dB > max_high_band_db {}", True),
    ]
    if scores["pesq_mean"] is None and scores["phrase_pesq_mean"] is None:
        return ["PESQ found no speech in any utterance (silence or noise)"]
    return [
        text.format(value, limit)
        for value, limit, text, upper in checks
        if value is not None and (value > limit if upper else value < limit)
    ]
