"""Context around a cut at words (serve/plan.Piece): a job is fed words of its sentence on either side, speaks its
own frames and a step past the cut, and overlaps the job beside it there, crossfaded and untrimmed."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import numpy as np
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.runtime.steps import SEAM_STEPS, STEPS_PER_FRAME
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.runtime.windowed import STEP_SAMPLES, WindowedDecoder, WindowSettings
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


SEAM = SEAM_STEPS * STEP_SAMPLES


def _spoken_samples(durations: np.ndarray, context: tuple[int, int]) -> tuple[int, int]:
    """Where the tokens between the context start and end in the audio (durations: the leading pad first), and
    SEAM_STEPS past each end where context was fed."""
    frames = np.cumsum(durations)
    per_frame = STEPS_PER_FRAME * STEP_SAMPLES
    return int(frames[context[0]]) * per_frame - SEAM, int(frames[len(durations) - 2 - context[1]]) * per_frame + SEAM


def test_a_windowed_job_with_context_speaks_its_own_frames_and_a_step_past_each_cut(windowed) -> None:
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


def test_jobs_beside_a_cut_at_words_overlap_there_untrimmed(plain) -> None:
    """Two jobs beside a cut with context are one utterance in two runs: each is decoded a step past the cut, and the
    two overlap by those two steps, crossfaded (butted together, the two runs' samples at a cut inside a word boundary
    differ: a step of 3-6x the samples' usual change). Neither end is trimmed, though the next job begins quietly."""
    engine = Engine(cast(Selection, None), ServeConfig(warmup=False))
    engine.attach(Synthesizer(plain))
    rate = engine.sample_rate
    rng = np.random.default_rng(0)
    speech = (0.3 * rng.normal(size=rate // 2)).astype(np.float32)
    quiet = np.concatenate([1e-5 * speech[: rate // 10], speech])  # begins below the silence threshold
    cut = Piece([10, 11, 16], ahead=[12, 13])
    joiner = engine.new_joiner()
    first = engine.join(joiner, cut, np.concatenate([np.zeros(rate // 4, np.float32), speech]), False, 1.0)
    assert len(first) == round(0.03 * rate) + len(speech) - 2 * SEAM  # lead-in cut to 30 ms; the overlap held back
    np.testing.assert_array_equal(first[-len(speech) + 2 * SEAM :], speech[: -2 * SEAM])
    after = engine.join(joiner, Piece([12, 13], behind=[10, 11, 16]), quiet, True, 1.0)
    np.testing.assert_array_equal(after[2 * SEAM : len(quiet)], quiet[2 * SEAM :])  # untrimmed after the overlap
    blend = after[: 2 * SEAM]
    assert np.all(np.abs(blend) <= np.maximum(np.abs(speech[-2 * SEAM :]), np.abs(quiet[: 2 * SEAM])) + 1e-6)
    assert blend[0] == pytest.approx(speech[-2 * SEAM], abs=1e-3) and blend[-1] == pytest.approx(quiet[2 * SEAM - 1], abs=1e-3)
    seam = engine.new_joiner()  # the same two jobs spoken alone: the second's lead-in is cut and faded in
    engine.join(seam, Piece([10, 11]), np.concatenate([np.zeros(rate // 4, np.float32), speech]), False, 1.0)
    assert len(engine.join(seam, Piece([12, 13]), quiet, True, 1.0)) < len(quiet) - round(0.05 * rate)


def test_serve_plans_context_as_configured(plain) -> None:
    engine = Engine(cast(Selection, None), ServeConfig(warmup=False, context_words=2))
    engine.attach(Synthesizer(plain))
    first, rest = engine.plan(LONG_FIRST)
    assert first.ahead and rest.behind and first.tokens[-1] == engine.synth.vocab[" "]  # the cut's space spoken before it
    *_, end = engine.plan(LONG_FIRST + " ?")  # a last chunk that says nothing is dropped: the stream ends as before
    assert end.context == (len(rest.behind), 0)
    slow = engine.plan(LONG_FIRST, speed=0.25)  # a piece and its context in no more frames than a job at speed 1
    assert len(slow) > 2 and max(map(len, slow)) <= 200 * 0.25
    none = Engine(cast(Selection, None), ServeConfig(warmup=False, context_words=0))
    none.attach(Synthesizer(plain))
    assert all(p.context == (0, 0) for p in none.plan(LONG_FIRST))
    with pytest.raises(UserError, match="--context-words must be 0 to 8"):
        ServeConfig(context_words=9)


def test_a_model_without_durations_speaks_every_chunk_alone(artifacts_root) -> None:
    """kokoro-onnx's own graph gives no durations: nothing says where a job's own tokens lie in its audio."""
    from kokoro_opt.evaluate.runners import import_kokoro_onnx

    engine = Engine(cast(Selection, None), ServeConfig(warmup=False, context_words=2))
    engine.attach(Synthesizer(import_kokoro_onnx(artifacts_root)))
    assert not engine.synth.gives_durations
    assert len(engine.plan(LONG_FIRST)) == 2 and all(p.context == (0, 0) for p in engine.plan(LONG_FIRST))


def test_only_the_leading_pad_before_a_first_window_is_decoded_with_less_context(windowed) -> None:
    """Before the first window of a job that starts its utterance there is only the leading pad, which nobody hears:
    `lead_overlap_steps` of context are decoded there (the first sound comes sooner), the usual overlap everywhere
    else. Before a job cut inside its sentence is speech: its first window keeps the usual overlap."""
    decoder = WindowedDecoder.of_artifact(Synthesizer(windowed))
    pack = windowed.voice_packs()["tiny_0"]
    default = decoder.settings
    slow = 0.5  # the tiny model's leading pad is then longer than the frames decoded of it

    def first_window(lead: int, context: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, np.ndarray]:
        decoder.settings = replace(default, lead_overlap_steps=lead)
        job = decoder.start(FEED, pack, slow, context=context)
        a = job.speech[0]
        audio = decoder.next_window(job)
        full = decoder.window(job.front, a, job.cursor, job.stats, constants=job.constants)  # the usual overlap
        lean = min(lead, default.overlap_steps, a) - min(default.overlap_steps, a) if context == (0, 0) else 0
        assert job.extra_steps == lean  # what the server's window cost model counts the window as
        return audio, full

    try:
        assert decoder.start(FEED, pack, slow).speech[0] > 0  # a leading pad to decode context in
        lean, full = first_window(0)
        assert lean.shape == full.shape and not np.array_equal(lean, full)  # the context reaches the window
        np.testing.assert_array_equal(*first_window(default.overlap_steps))  # as many steps: the usual window
        cut, full_cut = first_window(0, CONTEXT)
        np.testing.assert_array_equal(cut, full_cut)
    finally:
        decoder.settings = default
    # an artifact built before the setting was gated with the usual overlap there, and keeps it
    assert WindowSettings.of({"overlap_steps": 6}).lead_overlap_steps == 6
    assert WindowSettings.of({"overlap_steps": 6, "lead_overlap_steps": 2}).lead_overlap_steps == 2
