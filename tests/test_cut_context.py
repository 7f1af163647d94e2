"""Context around a cut at words (serve/plan.Piece): a job is fed words of its sentence on either side, speaks only
its own frames, and joins the jobs beside it without a seam's trimming or crossfade."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.runtime.windowed import STEP_SAMPLES, STEPS_PER_FRAME, WindowedDecoder
from kokoro_opt.select import Selection
from kokoro_opt.serve import ServeConfig
from kokoro_opt.serve.engine import Engine
from kokoro_opt.serve.plan import Piece
from tests import test_windows
from tests.test_chunking import LONG_FIRST
from tests.test_passes import TOKENS

pytestmark = pytest.mark.slow  # tiny artifacts built with the windows stage

plain, windowed = test_windows.plain, test_windows.windowed
FEED = TOKENS * 2
CONTEXT = (5, 7)  # tokens of FEED before and after the spoken ones


def _spoken_samples(durations: np.ndarray, context: tuple[int, int]) -> tuple[int, int]:
    """Where the tokens between the context start and end in the audio (durations: the leading pad first)."""
    frames = np.cumsum(durations)
    per_frame = STEPS_PER_FRAME * STEP_SAMPLES
    return int(frames[context[0]]) * per_frame, int(frames[len(durations) - 2 - context[1]]) * per_frame


def test_a_windowed_job_with_context_speaks_its_own_frames_only(windowed) -> None:
    synth = Synthesizer(windowed)
    decoder = WindowedDecoder.of_artifact(synth)
    pack = synth.packs["tiny_0"]
    job = decoder.start(FEED, pack, context=CONTEXT)
    start, end = _spoken_samples(job.front.durations, CONTEXT)
    assert (job.speech[0] * STEP_SAMPLES, job.speech[1] * STEP_SAMPLES) == (start, end)
    parts = [decoder.next_window(job)]
    while not job.done:
        parts.append(decoder.next_window(job))
    assert sum(map(len, parts)) == end - start
    alone = decoder.start(FEED, pack)  # no context: the speech runs from the lead-in to the final pause
    assert alone.speech[0] < job.speech[0] and alone.speech[1] > job.speech[1]


def test_a_whole_job_with_context_is_the_run_over_its_feed_cut_at_its_own_frames(plain) -> None:
    engine = Engine(cast(Selection, None), ServeConfig(warmup=False))
    engine.attach(Synthesizer(plain))
    pack = engine.synth.packs["tiny_0"]
    behind, ahead = FEED[: CONTEXT[0]], FEED[len(FEED) - CONTEXT[1] :]
    piece = Piece(FEED[CONTEXT[0] : len(FEED) - CONTEXT[1]], behind, ahead)
    result = engine.synth.run_tokens(FEED, pack)
    start, end = _spoken_samples(result.durations, CONTEXT)
    np.testing.assert_array_equal(engine.synthesize(piece, pack, 1.0, None), result.audio[start:end])
    assert len(engine.synthesize(Piece(FEED), pack, 1.0, None)) == len(result.audio)


def test_jobs_beside_a_cut_at_words_join_without_trimming_or_crossfade(plain) -> None:
    """The audio at a cut with context runs on, as inside one utterance: the first job keeps its last samples (no
    crossfade tail held back), the next keeps its first ones (no lead-in trimmed, no fade)."""
    engine = Engine(cast(Selection, None), ServeConfig(warmup=False))
    engine.attach(Synthesizer(plain))
    rate = engine.sample_rate
    rng = np.random.default_rng(0)
    speech = (0.3 * rng.normal(size=rate // 2)).astype(np.float32)
    quiet = np.concatenate([1e-5 * speech[: rate // 10], speech])  # begins below the silence threshold
    cut = Piece([10, 11, 16], ahead=[12, 13])
    joiner = engine.new_joiner()
    first = engine.join(joiner, cut, np.concatenate([np.zeros(rate // 4, np.float32), speech]), False, 1.0)
    assert len(first) == round(0.03 * rate) + len(speech)  # its lead-in trimmed to 30 ms, its end all there
    np.testing.assert_array_equal(first[-len(speech) :], speech)
    after = engine.join(joiner, Piece([12, 13], behind=[10, 11, 16]), quiet, True, 1.0)
    np.testing.assert_array_equal(after[: len(quiet)], quiet)
    seam = engine.new_joiner()  # the same two jobs spoken alone: the second's lead-in is cut and faded in
    engine.join(seam, Piece([10, 11]), np.concatenate([np.zeros(rate // 4, np.float32), speech]), False, 1.0)
    assert len(engine.join(seam, Piece([12, 13]), quiet, True, 1.0)) < len(quiet) - round(0.05 * rate)


def test_serve_plans_context_as_configured(plain) -> None:
    engine = Engine(cast(Selection, None), ServeConfig(warmup=False, context_words=2))
    engine.attach(Synthesizer(plain))
    first, rest = engine.plan(LONG_FIRST)
    assert first.ahead and rest.behind and first.tokens[-1] == engine.synth.vocab[" "]  # the cut's space spoken before it
    none = Engine(cast(Selection, None), ServeConfig(warmup=False, context_words=0))
    none.attach(Synthesizer(plain))
    assert all(p.context == (0, 0) for p in none.plan(LONG_FIRST))
    with pytest.raises(UserError, match="context_words must be 0 to 8"):
        ServeConfig(context_words=9)
