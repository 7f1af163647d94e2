"""Server building blocks without HTTP: joining, planning, scheduling, encoders, voice names, bench maths."""

from __future__ import annotations

import asyncio
import io
import math
import re
import struct
import time
from collections import deque
from pathlib import Path
from typing import Any, cast

import av
import numpy as np
import pytest
import soundfile as sf

from kokoro_opt.chunking import chunk_text
from kokoro_opt.errors import UserError
from kokoro_opt.runtime.join import END_KEEP, LEAD_KEEP, PAUSES, Joiner, boundary, edge_silence
from kokoro_opt.select import Selection
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.encoders import make_encoder, supported_formats
from kokoro_opt.serve.engine import Engine
from kokoro_opt.serve.openai_compat import voice_entries
from kokoro_opt.serve.plan import CostModel, Piece, as_pieces, frames_bound, make_pieces, queue_seconds, take_job, window_steps
from kokoro_opt.serve.scenario import playback
from kokoro_opt.serve.stream import Stream, waits_for_first_send
from kokoro_opt.voices import OPENAI_VOICES, openai_voice_map

SR = 24_000


def test_crossfade_removes_the_step_at_a_seam() -> None:
    a, b = np.full(SR, 0.5, np.float32), np.full(SR, -0.5, np.float32)  # worst case: opposite DC at the seam
    joiner = Joiner(SR, 10.0, trim=False)
    joined = np.concatenate([joiner.push(a, last=False), joiner.push(b, last=True)])
    assert len(joined) == 2 * SR - joiner.n  # one overlap, nothing lost or added otherwise
    assert np.abs(np.diff(joined)).max() < 0.01  # raw concatenation would step by 1.0
    plain = Joiner(SR, 0.0, trim=False)
    assert np.abs(np.diff(np.concatenate([plain.push(a, False), plain.push(b, True)]))).max() == pytest.approx(1.0)


def test_crossfade_keeps_short_outputs_and_continuity() -> None:
    joiner = Joiner(SR, 10.0, trim=False)
    tone = np.sin(np.arange(3 * SR) / 20).astype(np.float32)
    parts = [tone[:SR], tone[SR : 2 * SR], tone[2 * SR :]]
    out = np.concatenate([joiner.push(p, last=i == 2) for i, p in enumerate(parts)])
    assert len(out) == len(tone) - 2 * joiner.n
    joiner = Joiner(SR, 10.0, trim=False)
    assert len(np.concatenate([joiner.push(tone[:SR], False), joiner.push(tone[:10], True)])) == SR + 10


def _utterance(lead: float, speech: float, tail: float) -> np.ndarray:
    """Kokoro-like output: digital silence, speech, silence."""
    voiced = 0.4 * np.sin(np.arange(int(speech * SR)) / 7)
    return np.concatenate([np.zeros(int(lead * SR)), voiced, np.zeros(int(tail * SR))]).astype(np.float32)


def test_seams_get_natural_pauses_not_kokoros_edge_silence() -> None:
    job = _utterance(0.25, 1.0, 0.6)
    assert edge_silence(job, SR) == (int(0.25 * SR), int(0.6 * SR))
    joiner = Joiner(SR, 10.0)
    first = joiner.push(job, last=False, pause=PAUSES["clause"])
    out = np.concatenate([first, joiner.push(job, last=True, pause=PAUSES["sentence"])])
    voiced = np.flatnonzero(np.abs(out) > 1e-3)
    longest_gap = np.diff(voiced).max() / SR  # the silence at the seam
    assert abs(longest_gap - (PAUSES["clause"] + LEAD_KEEP)) < 0.02  # untrimmed, it would be 0.85 s
    lead, tail = edge_silence(out, SR)
    assert abs(lead / SR - LEAD_KEEP) < 0.011 and abs(tail / SR - END_KEEP) < 0.011  # 30 ms in, 0.3 s out
    assert Joiner(SR, 10.0).push(np.zeros(SR, np.float32), last=True).size == SR  # all silence: left alone


def test_boundary(vocab: dict[str, int]) -> None:
    symbols = {i: s for s, i in vocab.items()}
    ids = [vocab[c] for c in "hˈɛlO"]
    assert boundary([*ids, vocab["."]], symbols) == "sentence"
    assert boundary([*ids, vocab["?"], vocab["”"]], symbols) == "sentence"
    assert boundary([*ids, vocab[","]], symbols) == "clause"
    assert boundary(ids, symbols) == "word" and boundary([], symbols) == "word"


def test_take_job_merges_within_budget() -> None:
    pieces = deque(as_pieces([[1] * 10, [2] * 10, [3] * 10, [4] * 300, [5] * 300]))
    assert take_job(pieces, 0, 16) == Piece([1] * 10)  # always at least one piece
    assert take_job(pieces, 21, 16) == Piece([2] * 10 + [16] + [3] * 10)  # joined with a space token
    assert take_job(pieces, 10_000, 16) == Piece([4] * 300)  # never past 510 tokens
    assert take_job(pieces, 10_000, 16) == Piece([5] * 300) and not pieces


def test_a_job_of_pieces_cut_at_words_keeps_the_outer_context_and_counts_it() -> None:
    """Pieces cut at words inside a sentence (a space ends the first: it is spoken before the cut) merge without a
    second space; the job is fed the first piece's words before it and the last one's after it, and those count
    against the budget, since the front runs over them."""
    first, second, third = Piece([1] * 10 + [16], [7, 16], [2, 2]), Piece([2] * 10, [1, 16], [3]), Piece([3] * 10, [2, 16])
    assert take_job(deque([first, second, third]), 10_000, 16) == Piece([1] * 10 + [16] + [2] * 10 + [16] + [3] * 10, [7, 16])
    assert take_job(deque([first, second]), 2 + 11 + 10 + 1, 16) == Piece([1] * 10 + [16] + [2] * 10, [7, 16], [3])
    assert take_job(deque([first, second]), 2 + 11 + 10, 16) == first  # the second's context would not fit


def test_pieces_cover_long_text(vocab: dict[str, int]) -> None:
    text = " ".join(["The lighthouse keeper climbed the stairs at dusk, and lit the great lamp."] * 12)
    pieces = make_pieces(text, vocab, first_chunk_tokens=40, piece_tokens=80)
    assert all(len(p.tokens) - bool(p.ahead) <= 80 for p in pieces) and len(pieces) >= 12  # a space ends a cut at words
    whole = sum(len(c.token_ids) for c in chunk_text(text, vocab, first_chunk_tokens=40, chunk_tokens=510))
    assert whole > 510 and abs(sum(len(p.tokens) for p in pieces) - whole) <= 0.05 * whole  # nothing truncated


def test_a_request_s_spoken_tokens_are_the_same_however_it_is_cut(vocab: dict[str, int]) -> None:
    """What a 413 counts: a slow request is cut into smaller pieces, and the pieces' own tokens alone counted fewer
    the finer the cut (a cut on a space drops it; merging puts it back)."""
    from kokoro_opt.serve.plan import spoken_tokens

    text = " ".join(["Sentence number one is here, and it keeps going on without a stop for a while."] * 5)
    cuts = {size: make_pieces(text, vocab, first_chunk_tokens=size // 2, piece_tokens=size) for size in (200, 80, 40, 20)}
    merged = take_job(deque(cuts[200]), 10**6, vocab[" "])  # one job of everything, as the decoder would merge it
    assert len(merged.tokens) < 510 and merged.tokens[-1] != vocab[" "]
    own = {size: sum(p.spoken for p in pieces) for size, pieces in cuts.items()}
    assert len(set(own.values())) > 1  # the pieces' own tokens differ with the cut
    assert {spoken_tokens(pieces, vocab[" "]) for pieces in cuts.values()} == {len(merged.tokens)}


def test_slow_speech_gets_jobs_of_no_more_frames_than_at_speed_1() -> None:
    """Below speed 1 a token makes 1/speed frames, and a job's memory grows with its frames: pieces and jobs
    of a slow request hold speed x the tokens (inputs at speed 0.25-0.5 took a server 200 MB above its
    peak under four plain streams before)."""
    assert [frames_bound(200, s) for s in (4.0, 1.0, 0.5, 0.25)] == [200, 200, 100, 50]
    assert frames_bound(3, 0.25) == 1  # never zero: a job holds at least one piece

    async def budgets() -> tuple[int, int]:
        engine = Engine(cast(Selection, None), ServeConfig(chunk_tokens=200))
        pack = np.zeros((510, 1, 256), np.float32)
        normal, slow = (engine.submit([[1] * 10] * 40, pack, speed, _FakeEncoder(), False) for speed in (1.0, 0.25))
        now = time.monotonic()
        return engine._budget(normal, now), engine._budget(slow, now)  # nobody listening live: the largest jobs

    assert asyncio.run(budgets()) == (200, 50)


def test_cost_model() -> None:
    cost = CostModel()
    cost.calibrate((40, 0.5), (200, 2.1))
    assert cost.per_token == pytest.approx(0.01) and cost.fixed == pytest.approx(0.1)
    assert cost.predict(100) == pytest.approx(1.1)
    assert cost.tokens_within(1.1) == 100 and cost.tokens_within(0.05) == 0
    assert cost.predict(100, speed=0.5) > cost.predict(100)
    for _ in range(20):
        cost.observe(100, 1.0, 2.2)  # the machine got twice as slow
    assert cost.load == pytest.approx(2.0, rel=0.01) and cost.tokens_within(2.2) == 100


def test_window_sizes_follow_who_is_listening() -> None:
    step = 0.0125

    def size(**kw: Any) -> int:
        return window_steps(24, 80, step_seconds=step, **{"streaming": True, "heard": False, "cover_seconds": 0.0, **kw})

    assert size() == 24  # a new listener alone: a short first window, first audio soon
    assert size(heard=True) == 80  # later windows: full size
    assert size(streaming=False) == 160  # nobody hears it before it ends: few windows, a phrase in one
    # three more listeners wait for their first windows (0.45 s of work): this one must last that long
    covered = size(cover_seconds=0.45)
    assert covered == math.ceil(0.45 / 0.7 / step) and covered * step >= 0.45 / 0.7
    assert size(cover_seconds=5.0) == 80  # never more than a later window: the others' first audio waits on it
    assert size(cover_seconds=0.01) == 24
    # later windows: cut short so each other listener, served in deadline order, still gets audio in time
    assert size(heard=True, fit_steps=50) == 50 and size(heard=True, fit_steps=3) == 40  # half of `steps` at least
    assert queue_seconds([], []) == math.inf
    assert queue_seconds([1.0], [0.06]) == pytest.approx(0.7 - 0.06)
    # three buffers running dry together leave less room than the tightest one alone suggests
    assert queue_seconds([0.3, 0.3, 0.3], [0.06] * 3) == pytest.approx(0.7 * 0.3 - 3 * 0.06)
    assert queue_seconds([2.0, 0.3], [0.06] * 2) == pytest.approx(0.7 * 0.3 - 0.06)
    # each priced at its own next unit: a front and a window for one whose job is done
    assert queue_seconds([0.3, 0.4], [0.1, 0.05]) == pytest.approx(min(0.7 * 0.3 - 0.1, 0.7 * 0.4 - 0.15))
    assert queue_seconds([0.4, 0.3], [0.05, 0.1]) == queue_seconds([0.3, 0.4], [0.1, 0.05])  # paired, in any order


def test_a_first_window_lasts_while_the_next_one_runs() -> None:
    """A lone listener's first window is as short as the setting allows, yet holds audio for as long as
    its next window takes (by the fitted window cost): a slower machine gets a longer first window."""
    from types import SimpleNamespace

    from kokoro_opt.runtime.windowed import STEP_SAMPLES, WindowSettings
    from kokoro_opt.serve.modes import SAFETY, WindowedJobs

    async def sizes() -> list[tuple[int, float]]:
        engine = Engine(cast(Selection, None), ServeConfig())
        settings = WindowSettings()
        engine.mode = WindowedJobs(engine, cast(Any, SimpleNamespace(settings=settings)))
        engine.window_cost.calibrate((12, 0.06), (80, 0.2))
        pack = np.zeros((510, 1, 256), np.float32)
        lone = engine.submit([[1] * 10], pack, 1.0, _FakeEncoder(), True)
        out = []
        for load in (0.5, 1.0, 2.0):  # a fast machine, the fitted one, a slow phase
            engine.window_cost.load = load
            out.append(
                (engine.mode.window_steps(lone), engine.window_cost.predict(max(settings.first_steps, settings.steps // 2)))
            )
        return out

    step = STEP_SAMPLES / 24_000
    (fast, _), (fitted, next_window), (slow, slow_next) = asyncio.run(sizes())
    assert fast == WindowSettings().first_steps == 12  # the setting is the floor
    assert fitted > fast  # at the fitted cost the floor would not last
    assert fitted * step * SAFETY >= next_window > (fitted - 1) * step * SAFETY
    assert slow * step * SAFETY >= slow_next and slow > fitted


def test_a_heard_listeners_next_job_leaves_room_for_the_others_next_fronts() -> None:
    """Listeners who start together reach their next jobs together: each next job was sized to the tightest
    buffer alone, and a 158-token front and then four 67-token ones in a row left the last three 38-102 ms short.
    A job's front is now priced with its own first window and, for every other listener, its next unit: the
    front of its next piece and a window when its job is done, a window when it is decoding one."""
    from types import SimpleNamespace

    from kokoro_opt.runtime.windowed import WindowSettings
    from kokoro_opt.serve.modes import WholeJobs, WindowedJobs

    async def budgets() -> dict[str, int]:
        engine = Engine(cast(Selection, None), ServeConfig(chunk_tokens=400))
        engine.mode = WindowedJobs(engine, cast(Any, SimpleNamespace(settings=WindowSettings())))
        engine.cost.calibrate((40, 0.05), (400, 0.35))  # a front: ~17 ms + 0.83 ms a token
        engine.window_cost.calibrate((12, 0.016), (80, 0.05))
        pack = np.zeros((510, 1, 256), np.float32)
        now = time.monotonic()
        streams = [engine.submit([[1] * 40] * 10, pack, 1.0, _FakeEncoder(), True) for _ in range(4)]
        for s in streams:
            s.jobs, s.first_out, s.audio_out = 1, now, 0.5  # each 0.5 s of audio ahead
        for s in streams[1:]:
            s.job = cast(Any, SimpleNamespace())  # decoding a job: a window next
        out = {"others decoding a job": engine._budget(streams[0], now)}
        others = engine.mode.others_seconds(streams[0], now)
        new = engine.submit([[1] * 40] * 10, pack, 1.0, _FakeEncoder(), True)  # not heard yet: its first job goes first
        out["a new listener leaves the others' share"] = engine.mode.others_seconds(streams[0], now) == others
        engine.streams.remove(new)
        for s in streams[1:]:
            s.job = None  # their jobs are done: each needs a front next
        out["others needing fronts"] = engine._budget(streams[0], now)
        engine._running.update(streams[1:])  # a worker sends a job's last audio: its next unit is still a front
        out["others sending their jobs' last audio"] = engine._budget(streams[0], now)
        for s in streams[1:]:
            s.starting = True  # workers picked their next jobs and run their fronts: each a window next
        out["others' fronts running"] = engine._budget(streams[0], now)
        engine._running.clear()
        engine.mode = WholeJobs(engine)
        out["whole jobs"] = engine._budget(streams[0], now)
        out["tightest buffer alone"] = engine.cost.tokens_within(0.7 * 0.5)
        return out

    out = asyncio.run(budgets())
    assert out["whole jobs"] > out["others decoding a job"] > out["others needing fronts"] >= 40
    assert out["others decoding a job"] == out["others' fronts running"]
    assert out["others sending their jobs' last audio"] == out["others needing fronts"]
    assert out["a new listener leaves the others' share"]
    assert out["whole jobs"] == out["tightest buffer alone"]


class _FakeEncoder:
    def encode(self, audio: np.ndarray) -> bytes:
        return b""

    def finish(self) -> bytes:
        return b""


def test_a_worker_waits_for_a_first_audio_to_be_sent_only_when_no_other_listener_waits_for_theirs() -> None:
    """A lone listener's first bytes go out while the cores are free; listeners who start together are not made to
    wait for each other's sends (the next unit is the next listener's front). A whole answer is no listener."""

    async def streams() -> list[Stream]:
        encoder = make_encoder("pcm", SR, True)
        return [Stream([[1, 2, 3]], np.zeros(1), 1.0, encoder, streaming, Joiner(SR, 10.0)) for streaming in (True, True, False)]

    heard, starting, whole = asyncio.run(streams())
    heard.first_out = time.monotonic()
    assert waits_for_first_send(heard, [heard])
    assert waits_for_first_send(heard, [heard, whole])  # a whole answer waiting: not a listener's first sound
    assert not waits_for_first_send(heard, [heard, starting, whole])
    starting.first_out = time.monotonic()
    assert waits_for_first_send(heard, [heard, starting, whole])


def test_scheduler_first_chunks_then_earliest_deadline() -> None:
    async def scenario() -> list[tuple[int, int]]:
        engine = Engine(cast(Selection, None), ServeConfig(chunk_tokens=100))
        engine.cost.calibrate((10, 0.1), (100, 1.0))  # 10 ms per token
        pack = np.zeros((510, 1, 256), np.float32)
        ahead = engine.submit([[1] * 10] * 20, pack, 1.0, _FakeEncoder(), True)  # started, far ahead
        behind = engine.submit([[1] * 10] * 20, pack, 1.0, _FakeEncoder(), True)  # started, about to run dry
        fresh = engine.submit([[1] * 10] * 20, pack, 1.0, _FakeEncoder(), True)  # no audio yet
        now = time.monotonic()
        for stream, buffered in ((ahead, 30.0), (behind, 0.5)):
            stream.jobs, stream.first_out, stream.audio_out = 1, now, buffered
        order = []
        for _ in range(3):
            picked = engine._pick()
            assert picked is not None
            stream, tokens, _ = picked
            order.append((stream.id, len(tokens)))
            stream.jobs += 1
            if stream is fresh:
                stream.first_out, stream.audio_out = now, 100.0
        return [(s - fresh.id, n) for s, n in order]

    first, second, third = asyncio.run(scenario())
    assert first == (0, 10)  # the new request's first chunk, one piece
    assert second[0] == -1 and second[1] < 50  # then the stream about to underrun, with a small job (0.35 s budget)
    assert third[0] == -1  # still the tightest deadline


def test_first_audio_is_what_a_streaming_request_sends_first(tiny_artifact: Any) -> None:
    """kokoro-opt tune times `Engine.first_audio`: it must be the worker's own first job, synthesis and joining."""
    from kokoro_opt.select import resolve_artifact

    text = "Hi there, friend. This second sentence is long enough to be a piece of its own, after the first."
    engine = Engine(resolve_artifact(str(tiny_artifact.path)), ServeConfig(first_chunk_tokens=10, chunk_tokens=40))
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.synth is not None, engine.error
        pack = engine.synth.packs[engine.synth.voices[0]]
        assert len(engine.plan(text)) > 2

        async def first_bytes() -> Any:
            stream = engine.submit(engine.plan(text), pack, 1.0, make_encoder("pcm", engine.sample_rate, True), True)
            first = await asyncio.wait_for(stream.queue.get(), 60)
            engine.cancel(stream)
            return first

        served = asyncio.run(first_bytes())
    finally:
        engine.stop()
    measured = engine.first_audio(text, pack)  # on this thread, the worker stopped: the same session, same steps
    assert isinstance(served, bytes) and served == make_encoder("pcm", engine.sample_rate, True).encode(measured)


def test_the_body_limit_holds_every_input_the_character_limit_allows() -> None:
    """30,000 "é" escaped as JSON are 180 KB: under a fixed 128 KB body limit --max-input-chars 30000 was a 413."""
    import json

    from kokoro_opt.serve.openai_compat import MAX_INSTRUCTIONS_CHARS

    assert ServeConfig().body_bytes == 128 * 1024  # the default limits' largest body fits already
    for chars in (4096, 30_000, 200_000):
        body = json.dumps({"input": "\ud83d\ude00" * (chars // 2), "instructions": "é" * MAX_INSTRUCTIONS_CHARS})
        assert len(body.encode()) <= ServeConfig(max_input_chars=chars).body_bytes


def test_config_validation_and_tuned_chunking(tiny_artifact: Any) -> None:
    """Each wrong setting is named as the user typed it (the `serve` option), with its value."""
    with pytest.raises(UserError, match="--first-chunk-tokens 300 is larger than --chunk-tokens 200"):
        ServeConfig(first_chunk_tokens=300, chunk_tokens=200)
    with pytest.raises(UserError, match=r"--chunk-tokens must be at most 510.*not 600"):
        ServeConfig(chunk_tokens=600)
    with pytest.raises(UserError, match="--timeout must be > 0 seconds, not -1"):
        ServeConfig(request_timeout=-1)
    with pytest.raises(UserError, match="--max-queue must be at least 1, not 0"):
        ServeConfig(max_queue=0)
    with pytest.raises(UserError, match="--audio-cache-mb must be >= 0"):
        ServeConfig(audio_cache_mb=-1)
    selection = Selection(tiny_artifact, chunking={"first_chunk_tokens": 30, "crossfade_ms": 5, "other": 1})
    config = ServeConfig.for_selection(selection, chunk_tokens=150, crossfade_ms=None)
    assert (config.first_chunk_tokens, config.chunk_tokens, config.crossfade_ms) == (30, 150, 5)
    # a tuned value the user never typed is said to come from tuning, with what overrides it
    with pytest.raises(UserError, match=r"larger than --chunk-tokens 20 \(.*first_chunk_tokens=30 came from tuning\)"):
        ServeConfig.for_selection(selection, chunk_tokens=20)
    with pytest.raises(UserError, match=r"^--chunk-tokens must be at most 510 \(Kokoro's context\), not 600$"):
        ServeConfig.for_selection(Selection(tiny_artifact), chunk_tokens=600)  # nothing tuned: the message as it was


@pytest.mark.parametrize("fmt", supported_formats())
def test_encoders_stream_and_finish(fmt: str) -> None:
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(3 * SR) / SR)).astype(np.float32)
    decoded = {}
    for streaming in (True, False):
        encoder = make_encoder(fmt, SR, streaming)
        parts = [encoder.encode(tone[i * SR : (i + 1) * SR]) for i in range(3)] + [encoder.finish()]
        if streaming:
            assert len(parts[0]) > 200  # the first second leaves at once, not at the next write
        else:
            assert not any(parts[:3])
        data = b"".join(parts)
        if fmt == "pcm":
            decoded[streaming] = len(data) // 2
        elif fmt == "wav":
            expected = 0xFFFFFFFF if streaming else len(data) - 44
            assert struct.unpack("<I", data[40:44])[0] == expected
            decoded[streaming] = (len(data) - 44) // 2
        else:  # FFmpeg copes with streamed headers that leave the length unknown
            frames = list(av.open(io.BytesIO(data)).decode(audio=0))  # Opus decodes at 48 kHz
            decoded[streaming] = round(sum(f.samples for f in frames) * SR / frames[0].sample_rate)
    for streaming, samples in decoded.items():
        assert 3 * SR <= samples <= 3 * SR + 2048, (streaming, samples)  # codec priming/padding only


def test_non_streaming_files_read_back_with_libsndfile() -> None:
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(SR) / SR)).astype(np.float32)
    for fmt in ("wav", "flac", "mp3", "opus"):
        encoder = make_encoder(fmt, SR, streaming=False)
        audio, rate = sf.read(io.BytesIO(encoder.encode(tone) + encoder.finish()))
        assert rate == SR and abs(len(audio) - SR) < 1200


def test_unknown_format() -> None:
    with pytest.raises(UserError, match="wma"):
        make_encoder("wma", SR, True)


def test_openai_voice_map() -> None:
    real = ["jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo"]
    assert openai_voice_map(real) == OPENAI_VOICES
    tiny = openai_voice_map(["tiny_1", "tiny_0"])
    assert set(tiny) == set(OPENAI_VOICES) and set(tiny.values()) == {"tiny_0", "tiny_1"}
    assert tiny == openai_voice_map(["tiny_0", "tiny_1"])  # deterministic, order-independent
    other = openai_voice_map(["af_heart", "am_adam", "bf_emma"])
    assert other["onyx"] == "am_adam" and other["alloy"] in {"af_heart", "bf_emma"}
    names = {e["id"]: e["name"] for e in voice_entries(real, OPENAI_VOICES)}
    assert names["jm_kumo"] == "Kumo (Japanese, male)" and names["nova"].endswith("jf_nezumi)")


def test_playback_lag() -> None:
    bps = 2.0 * SR  # pcm16 mono
    steady = [(t, int(bps)) for t in (0.0, 0.5, 1.0, 1.5)]  # 1 s of audio every 0.5 s: always ahead
    assert playback(steady, bps) == (4.0, 0.5, 0.0)
    late = [(0.0, int(bps)), (2.5, int(bps))]  # the second second arrives 1.5 s after the first ran out
    audio, gap, lag = playback(late, bps)
    assert (audio, gap) == (2.0, 2.5) and lag == pytest.approx(1.5)
    assert playback([(0.0, 44 + int(bps))], bps, skip=44)[0] == 1.0
    # a WAV header sent alone starts no playback: the clock starts with the first audio
    assert playback([(0.0, 44), (0.3, int(bps)), (1.2, int(bps))], bps, skip=44) == (2.0, pytest.approx(0.9), 0.0)


def test_bench_refuses_compressed_formats() -> None:
    from kokoro_opt.serve.bench import bench

    with pytest.raises(UserError):
        bench("http://127.0.0.1:9", [1], response_format="mp3")


def test_the_docs_voice_table_is_the_servers() -> None:
    """docs/serving.md's table of OpenAI voice names is the mapping the server applies, row for row."""

    doc = (Path(__file__).parent.parent / "docs" / "serving.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| ([a-z]+) \| (j[fm]_[a-z]+) \|$", doc, flags=re.M))
    assert rows == OPENAI_VOICES


def test_capacity_is_the_largest_count_every_listener_was_kept_fed_at() -> None:
    from kokoro_opt.serve.capacity import sustained

    def run(clients: int, underruns: int = 0, p95: float = 0.2, rejected: int = 0) -> dict:
        ok = clients - rejected
        return {"mode": "stream", "clients": clients, "requests": clients, "ok": ok, "rejected_429": rejected,
                "errors": 0, "underruns": underruns, "ttfa_p95": p95}  # fmt: skip

    assert sustained([run(1), run(2), run(4), run(6, underruns=1)]) == (4, 0.5)
    assert sustained([run(1), run(2, p95=0.6), run(4)]) == (1, 0.5)  # a later pass does not count past a failure
    # a count that missed once and then held in its second run counts; missed in both, the probe stops there
    assert sustained([run(1), run(2), run(4, underruns=2), run(4), run(6, underruns=1), run(6, p95=0.6)]) == (4, 0.5)
    assert sustained([run(1, rejected=1)]) == (0, 0.5)
    assert sustained([run(1, underruns=1)]) == (0, 0.5)
    assert sustained([{**run(8), "mode": "full"}]) == (0, 0.5)  # only streams count
    # a machine where one listener alone waits 0.65 s: more listeners are held to twice that, not to 0.5 s
    assert sustained([run(1, p95=0.65), run(2, p95=1.2), run(4, p95=1.4)]) == (2, 1.3)
    assert sustained([run(1, p95=1.6)]) == (0, 1.5)  # never over 1.5 s: that slow a machine sustains none
    # the counts between the last sustained and the first not are measured too: 6 held, 8 did not, 7 held
    assert sustained([run(1), run(2), run(4), run(6), run(8, p95=0.6), run(7)]) == (7, 0.5)


@pytest.mark.parametrize(
    ("carries", "probed"),
    [
        (7, [1, 2, 4, 6, 8, 7]),
        (5, [1, 2, 4, 6, 5]),
        (0, [1]),
        (16, [1, 2, 4, 6, 8, 10, 12, 16]),
        (13, [1, 2, 4, 6, 8, 10, 12, 16, 13, 14]),
    ],
)
def test_a_capacity_probe_narrows_down_between_its_steps(carries: int, probed: list[int]) -> None:
    from kokoro_opt.serve.capacity import next_count

    results: dict[int, bool] = {}
    while (clients := next_count(results)) is not None:
        results[clients] = clients <= carries
    assert list(results) == probed


def test_serve_admits_what_this_machine_was_measured_to_sustain(tiny_artifact, tmp_path: Path, monkeypatch) -> None:
    """bench-serve --capacity records, per machine and its cores, artifact, mode, workers, their threads and the
    scheduling; serve takes it as its default queue limit where all of those are its own."""
    from kokoro_opt.artifacts import link_or_copy, open_artifact
    from kokoro_opt.runtime.session import THREADS_ENV
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.capacity import CAPACITY_FILE, DEFAULT_QUEUE, measured_capacity, record_capacity

    monkeypatch.delenv(THREADS_ENV, raising=False)  # a server whose sessions take every core (threads 0)
    root = tmp_path / "artifacts"
    link_or_copy(tiny_artifact.path, root / "tiny" / tiny_artifact.id)
    selection = Selection(open_artifact(root / "tiny" / tiny_artifact.id))
    assert ServeConfig.for_selection(selection).max_queue == DEFAULT_QUEUE  # nothing measured yet
    unmeasured = ServeConfig.for_selection(selection).admission(selection, False)
    assert "nothing was measured for this artifact in whole mode" in unmeasured and str(root / CAPACITY_FILE) in unmeasured
    cut = ServeConfig.for_selection(selection).scheduling
    record_capacity(root, tiny_artifact.id, "windowed", 1, 9, scheduling=cut)  # another mode: not this one's
    assert ServeConfig.for_selection(selection).max_queue == DEFAULT_QUEUE
    record_capacity(root, tiny_artifact.id, "whole", 1, 3, scheduling=cut)
    record_capacity(root, tiny_artifact.id, "whole", 1, 7, scheduling=cut)  # measured again: replaces it
    assert measured_capacity(root, tiny_artifact.id, "whole", 1, scheduling=cut).streams == 7
    record_capacity(root, tiny_artifact.id, "whole", 2, 11, scheduling=cut)  # two workers: a count of its own
    record_capacity(root, tiny_artifact.id, "whole", 1, 5, threads=1, scheduling=cut)  # one-thread sessions: its own too
    assert measured_capacity(root, tiny_artifact.id, "whole", 1, scheduling=cut).streams == 7
    assert measured_capacity(root, tiny_artifact.id, "whole", 1, threads=1, scheduling=cut).streams == 5
    monkeypatch.setenv(THREADS_ENV, "1")
    assert ServeConfig.for_selection(selection).max_queue == 5
    assert "(whole, 1 worker of 1 thread;" in ServeConfig.for_selection(selection).admission(selection, False)
    monkeypatch.delenv(THREADS_ENV)
    assert ServeConfig.for_selection(selection).max_queue == 7
    assert "this machine sustains 7 simultaneous" in ServeConfig.for_selection(selection).admission(selection, False)
    record_capacity(root, tiny_artifact.id, "whole", 1, 0, threads=1, scheduling=cut)  # a machine that sustains none
    monkeypatch.setenv(THREADS_ENV, "1")
    assert ServeConfig.for_selection(selection).max_queue == 1  # still serves one listener at a time
    assert "sustains 0 simultaneous" in ServeConfig.for_selection(selection).admission(selection, False)
    monkeypatch.delenv(THREADS_ENV)
    assert ServeConfig.for_selection(selection, max_queue=2).max_queue == 2  # asked for: kept
    assert ServeConfig.for_selection(selection, max_queue=2).admission(selection, True).endswith("(--max-queue)")
    # chunks of another size cut a stream's work otherwise: what the machine carried with them is not this server's
    assert ServeConfig.for_selection(selection, first_chunk_tokens=20).max_queue == DEFAULT_QUEUE
    # edge capping is its own mode: what plain whole jobs sustain is not its count
    assert measured_capacity(root, tiny_artifact.id, ServeConfig(cap_edges=True).mode_name, 1, scheduling=cut) is None


def test_a_capacity_measured_on_other_cores_is_not_this_ones(tmp_path: Path) -> None:
    """The same CPU model with fewer usable cores (an affinity, a container's quota) carries fewer streams."""
    import json

    from kokoro_opt.machine import fingerprint
    from kokoro_opt.serve.capacity import CAPACITY_FILE, measured_capacity, record_capacity

    record_capacity(tmp_path, "a", "whole", 1, 6)
    assert measured_capacity(tmp_path, "a", "whole", 1).streams == 6
    record = json.loads((tmp_path / CAPACITY_FILE).read_text())
    record["measurements"][0]["machine"]["usable_cpus"] = fingerprint()["usable_cpus"] + 2
    (tmp_path / CAPACITY_FILE).write_text(json.dumps(record))
    assert measured_capacity(tmp_path, "a", "whole", 1) is None
    record_capacity(tmp_path, "a", "whole", 1, 3)  # measured here: kept beside the other cores' record, not over it
    assert len(json.loads((tmp_path / CAPACITY_FILE).read_text())["measurements"]) == 2


@pytest.mark.parametrize(
    "entry",
    [1, {"streams": "5"}, {"streams": None}, {"streams": 1e9}, {"streams": True}, {"ttfa_limit": "x"},
     {"ttfa_limit": math.nan}, {"measured": 5}, {"machine": "here"}],
)  # fmt: skip
def test_a_capacity_record_that_is_not_one_is_passed_over(tmp_path: Path, entry: Any) -> None:
    """capacity.json is a file anyone can edit: an entry of the wrong types is skipped (serve falls back to the
    default and says so), never a traceback, and no value can switch admission off."""
    import json

    from kokoro_opt.machine import fingerprint
    from kokoro_opt.serve.capacity import measured_capacity

    good = {"artifact_id": "a", "mode": "whole", "workers": 1, "streams": 3, "machine": fingerprint(), "measured": "2026"}
    bad = {**good, "streams": 7, **entry} if isinstance(entry, dict) else entry
    (tmp_path / "capacity.json").write_text(json.dumps({"measurements": [good, bad]}))
    assert measured_capacity(tmp_path, "a", "whole", 1).streams == 3
    (tmp_path / "capacity.json").write_text("[" * 100_000)
    assert measured_capacity(tmp_path, "a", "whole", 1) is None


@pytest.mark.parametrize(
    ("setting", "flag"),
    [({"max_queue": math.nan}, "--max-queue"), ({"max_queue": 2.5}, "--max-queue"), ({"max_queue": True}, "--max-queue"),
     ({"first_chunk_tokens": "40"}, "--first-chunk-tokens"), ({"crossfade_ms": math.nan}, "--crossfade-ms"),
     ({"crossfade_ms": 2e5}, "--crossfade-ms"), ({"request_timeout": math.inf}, "--timeout"),
     ({"first_window_steps": 12.0}, "--first-window-steps"), ({"max_body_bytes": 1.5}, "max_body_bytes")],  # no option
)  # fmt: skip
def test_serve_settings_are_numbers_of_their_kind(setting: dict[str, Any], flag: str) -> None:
    """A NaN limit compares False and would switch its check off; a string would fail on first use."""
    from kokoro_opt.errors import UserError
    from kokoro_opt.serve import ServeConfig

    with pytest.raises(UserError, match=f"^{flag} must be"):
        ServeConfig(**setting)


def test_capacity_records_of_other_versions_are_read(tmp_path: Path) -> None:
    """A record written before the TTFA limit was kept, or by a newer version with fields this one lacks."""
    import json

    from kokoro_opt.machine import fingerprint
    from kokoro_opt.serve.capacity import TTFA_P95_LIMIT, measured_capacity

    entry = {"artifact_id": "a", "mode": "whole", "workers": 1, "streams": 3, "machine": fingerprint(), "measured": "2026"}
    (tmp_path / "capacity.json").write_text(json.dumps({"measurements": [entry, {**entry, "mode": "windowed", "later": 1}]}))
    assert measured_capacity(tmp_path, "a", "whole", 1).ttfa_limit == TTFA_P95_LIMIT
    assert measured_capacity(tmp_path, "a", "windowed", 1).streams == 3


def test_names_in_any_case_are_ascii_letters_in_any_case() -> None:
    """The OpenAPI document writes a name in any case as `[kK]` classes: what the server reads must be the same."""
    from kokoro_opt.serve.openai_compat import SpeechRequest
    from kokoro_opt.serve.openapi import speech_body
    from kokoro_opt.voices import ascii_lower

    assert ascii_lower("JM_KUMO") == "jm_kumo" and ascii_lower("jm_\u212aumo") == "jm_\u212aumo"  # not the Kelvin sign
    schema = speech_body(["tiny_0"], ServeConfig())["requestBody"]["content"]["application/json"]["schema"]
    pattern = schema["properties"]["response_format"]["pattern"]
    for written in ("mp3", "MP3", "Wav", "\u212aac"):
        read = SpeechRequest.model_validate({"input": "Hi.", "response_format": written}).response_format
        assert bool(re.fullmatch(pattern, written)) == (read in supported_formats()), written


def test_an_api_key_is_what_a_header_can_carry() -> None:
    for key in ("clé", "", " padded ", "tab\tin"):
        with pytest.raises(UserError, match="--api-key must be printable ASCII"):
            ServeConfig(api_key=key)
    assert ServeConfig(api_key="s3cret-0123").api_key == "s3cret-0123"


def test_a_response_sends_all_audio_already_made_and_times_out_only_waiting() -> None:
    """`--timeout` bounds the wait for a stream's next audio, never audio already made: with no time left, the
    queued pieces are all sent, and only then does the wait for more time out (a 504, or the stream cut)."""
    from types import SimpleNamespace

    from kokoro_opt.serve.openai_compat import ApiError
    from kokoro_opt.serve.speech import _chunks

    async def drain(items: list[Any], time_left: float) -> tuple[list[bytes], int | None]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        got: list[bytes] = []
        try:
            async for piece in _chunks(cast(Any, SimpleNamespace(queue=queue)), lambda: time_left):
                got.append(piece)
        except ApiError as exc:
            return got, exc.status
        return got, None

    assert asyncio.run(drain([b"a", b"b", b"c", None], 0.0)) == ([b"a", b"b", b"c"], None)  # made, so sent
    assert asyncio.run(drain([b"a", b"b"], 0.0)) == ([b"a", b"b"], 504)  # then nothing more came in time
    assert asyncio.run(drain([b"a", RuntimeError("boom")], 0.0)) == ([b"a"], 500)
