"""A small first chunk's prosody as a number (its timing distortion), the front-only model that
measures it, and `kokoro-opt tune` holding first_chunk_tokens to a budget with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kokoro_opt.artifacts import link_or_copy
from kokoro_opt.chunking import CONTEXT_WORDS
from kokoro_opt.evaluate.corpus import load_corpus
from kokoro_opt.first_chunk import DurationModel, distortion, distortion_by_size, stretch, within_budget
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.text import phonemize, tokenize
from kokoro_opt.tune import parse_tune_recipe
from kokoro_opt.tuning.space import Candidate, first_chunk_sizes

TEXTS = [s.text for s in load_corpus().sentences]


def test_stretch_compares_the_chunks_tokens_and_distortion_counts_both_ways() -> None:
    alone = np.array([9, 4, 6, 2, 7])  # leading pad, three tokens, final pad
    in_sentence = np.array([12, 4, 4, 2, 1, 5, 9])
    assert stretch(alone, in_sentence, 3) == pytest.approx(12 / 10)
    assert distortion([1.25, 0.8, 1.0]) == pytest.approx(1.25)  # 20% shorter is as far off as 25% longer
    assert within_budget([16, 24, 40, 600], {16: 1.46, 24: 1.31, 40: 1.18}, 1.25) == [40, 600]  # 600: never cut


def test_the_front_only_model_gives_the_whole_models_durations(tiny_artifact: Any) -> None:
    front, whole = DurationModel(tiny_artifact), Synthesizer(tiny_artifact)
    assert [o.name for o in front.session.get_outputs()] == ["durations"]
    ids = tokenize(phonemize("The birch canoe slid on the smooth planks."), whole.vocab)
    for voice in whole.voices[:2]:
        assert np.array_equal(front(ids, voice), whole.run_tokens(ids, voice).durations)


def test_a_graph_that_is_none_is_one_clear_error(tiny_artifact: Any, tmp_path: Path) -> None:
    """tune times first chunks on candidates that may have been fetched: a model.onnx that is no graph is one line."""
    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.errors import UserError

    folder = tmp_path / "tiny" / tiny_artifact.id
    link_or_copy(tiny_artifact.path, folder)
    (folder / "model.onnx").unlink()  # a hard link to the fixture's file: replaced, not written through
    (folder / "model.onnx").write_bytes(b"\x08\x07garbage")
    with pytest.raises(UserError, match=r"model\.onnx is not a loadable ONNX model"):
        DurationModel(open_artifact(folder))


def test_tune_drops_the_first_chunk_sizes_timed_beyond_the_budget(tiny_artifact: Any, tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    link_or_copy(tiny_artifact.path, root / "tiny" / tiny_artifact.id)
    sizes = [6, 10, 16, 24]
    measured = distortion_by_size(DurationModel(tiny_artifact), sizes, TEXTS, context_words=CONTEXT_WORDS)  # as tune times them
    assert set(measured) == set(sizes) and min(measured.values()) >= 1.0
    assert len(set(measured.values())) > 1, "the tiny model times every size alike: nothing to drop"
    budget = min(measured.values())
    tiny = Candidate(f"tiny@{tiny_artifact.id[:8]}", "tiny", {"onnx": tiny_artifact.id}, 4.64, "the reference")
    recipe = parse_tune_recipe(
        {"name": "fc", "space": {"first_chunk_tokens": sizes}, "quality": {"max_first_chunk_distortion": budget}}
    )
    said: list[str] = []
    kept = first_chunk_sizes(recipe, [tiny], root, said.append)
    assert kept == within_budget(sizes, measured, budget) and 0 < len(kept) < len(sizes)
    assert "timing distortion" in said[0] and all(f"{k} tokens {measured[k]:.2f}" in said[0] for k in sizes)
    assert said[1].startswith("first_chunk_tokens ") and "dropped" in said[1]
    space = {"first_chunk_tokens": sizes}
    off = parse_tune_recipe({"name": "fc", "space": space, "quality": {"max_first_chunk_distortion": None}})
    assert first_chunk_sizes(off, [tiny], root, said.append) == sizes  # no budget: nothing measured, nothing dropped
