"""Windowed decoding as the server runs it: a job's windows joined like the job whole, a server streaming a
windowed artifact, short jobs finished whole, disconnects between windows, the default streaming mode, and two
workers."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.runtime.join import PAUSES, Joiner
from tests import test_fuse, test_windows

pytestmark = pytest.mark.slow  # servers and several builds: not in make test-fast

# the same tiny artifacts as test_windows.py's (built once: the store caches them by key)
plain, windowed = test_windows.plain, test_windows.windowed
fused_artifact = test_fuse.fused_artifact  # the flagship's kind: finishes run through the fused generator


@pytest.mark.parametrize("cuts", [(7000, 15000, 21000), (7000, 29500, 33000)], ids=["speech-to-the-end", "silent-last-parts"])
@pytest.mark.parametrize("pause", ["word", "sentence"])
def test_a_job_in_windows_joins_like_the_job_whole(cuts: tuple[int, ...], pause: str) -> None:
    """The joiner trims a windowed job only where it opens and closes: the job's samples as pushed whole, up to
    where the end is cut (found on a 10 ms grid, so within one 10 ms frame). When the speech ends before the
    closing part, the silence after it is held back, then cut to the pause like the whole job's (measured:
    a silent last window left 0.41 s of dead air inside a sentence)."""
    rate = 24_000
    rng = np.random.default_rng(1)
    speech = (0.3 * rng.normal(size=rate)).astype(np.float32)
    job = np.concatenate([np.zeros(rate // 5, np.float32), speech, 1e-5 * speech[: rate // 3]])  # then -90 dB
    whole = Joiner(rate, 10.0).push(job, last=False, pause=PAUSES[pause])
    parts, joiner = [], Joiner(rate, 10.0)
    bounds = [0, *cuts, len(job)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        parts.append(joiner.push(job[a:b], last=False, pause=PAUSES[pause], opens=i == 0, closes=b == len(job)))
    joined = np.concatenate(parts)
    assert abs(len(joined) - len(whole)) <= rate // 100
    n = min(len(joined), len(whole))
    np.testing.assert_array_equal(joined[:n], whole[:n])


@pytest.fixture(scope="module")
def windowed_served(windowed):
    """A real server streaming the tiny windowed artifact: (its URL, its engine)."""
    from kokoro_opt.serve import ServeConfig
    from tests.serve_helpers import serving_with_engine

    with serving_with_engine(windowed, ServeConfig(max_queue=4, first_chunk_tokens=20, chunk_tokens=120, windowed=True)) as both:
        yield both


@pytest.fixture(scope="module")
def windowed_url(windowed_served) -> str:
    return windowed_served[0]


def test_a_server_streams_a_windowed_artifact_and_blends(windowed_url) -> None:
    """A blend streams windowed, and reaches synthesis: its whole answer is neither voice's (the two differ from it
    by 0.04 and 0.15 of its norm on the tiny model, float noise by ~1e-5)."""
    import httpx

    def speak(voice: str, stream: bool) -> np.ndarray:
        body = {"model": "kokoro", "input": "Hello there. How are you today? Fine, thanks.", "voice": voice}
        body |= {"response_format": "pcm", "stream": stream}
        with httpx.stream("POST", f"{windowed_url}/v1/audio/speech", json=body, timeout=120) as response:
            assert response.status_code == 200
            return np.frombuffer(b"".join(c for c in response.iter_bytes() if c), dtype=np.int16).astype(np.float32)

    blend = "tiny_0(2)+tiny_1(1)"
    streamed, whole = speak(blend, True), speak(blend, False)
    assert len(streamed) > 24_000 // 2 and np.abs(streamed).max() > 0

    def distance(a: np.ndarray, b: np.ndarray) -> float:  # relative, over the shorter; a length change counts
        n = min(len(a), len(b))
        return float(np.linalg.norm(a[:n] - b[:n]) / np.linalg.norm(b[:n])) + abs(len(a) - len(b)) / len(b)

    assert all(distance(whole, speak(voice, False)) > 0.01 for voice in ("tiny_0", "tiny_1"))


def test_a_disconnect_stops_a_windowed_job_between_windows(windowed_served) -> None:
    import httpx

    from tests.serve_helpers import held_after_first_job, metric
    from tests.test_serve_load import LONG, assert_nothing_left_running, body, idle, wait_for

    url, engine = windowed_served
    before = {name: metric(url, name) for name in ("kokoro_cancelled_total", "kokoro_dropped_pieces_total",
                                                   "kokoro_cancel_release_seconds_count")}  # fmt: skip
    with held_after_first_job(engine):  # held after its first window: the client leaves mid-job, however fast
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body(LONG), timeout=120) as r:
            assert r.status_code == 200
            pieces = r.iter_raw()
            next(pieces)
        wait_for(lambda: metric(url, "kokoro_cancelled_total") == before["kokoro_cancelled_total"] + 1, 60)
    wait_for(lambda: idle(url), 60)
    assert metric(url, "kokoro_dropped_pieces_total") > before["kokoro_dropped_pieces_total"]  # LONG's other pieces
    # the worker said when the unit it was in let go of the cancelled request (docs/serving.md: metrics)
    wait_for(lambda: metric(url, "kokoro_cancel_release_seconds_count") == before["kokoro_cancel_release_seconds_count"] + 1, 60)
    assert_nothing_left_running(url)  # nothing of LONG picked up again


def test_serving_windowed_without_the_stage_is_refused(plain) -> None:
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig

    with pytest.raises(UserError, match="windows stage"):
        ServeConfig.for_selection(resolve_artifact(str(plain.path)), windowed=True)


def test_serve_streams_windowed_where_the_artifact_can_unless_told_not_to(windowed, plain) -> None:
    """The artifact decides by default (its capability: the windows stage passed its gate); --no-windowed and
    --cap-edges serve whole jobs; whatever has no windows stage serves whole jobs."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig

    streams = resolve_artifact(str(windowed.path))
    assert streams.artifact.capabilities.windowed and ServeConfig.for_selection(streams).windowed
    assert not ServeConfig.for_selection(streams, windowed=False).windowed
    assert not ServeConfig.for_selection(resolve_artifact(str(plain.path))).windowed
    from kokoro_opt.serve.config import mode_reason  # the startup line says why

    assert mode_reason(streams.artifact, None, True).startswith(" (by default: random weights")
    assert mode_reason(streams.artifact, False, False) == " (--no-windowed)"
    tuned = ServeConfig.for_selection(streams, first_window_steps=20)
    assert tuned.first_window_steps == 20 and "streaming windowed" in tuned.mode() and "workers" not in tuned.mode()
    assert "2 workers" in ServeConfig.for_selection(streams, workers=2).mode()  # the startup line says so
    with pytest.raises(UserError, match="--first-window-steps must be 4 to 400"):
        ServeConfig(first_window_steps=2)
    with pytest.raises(UserError, match="drop --first-window-steps"):  # whole jobs have no first window to size
        ServeConfig.for_selection(streams, windowed=False, first_window_steps=20)
    capped = ServeConfig(cap_edges=True)
    assert (capped.mode_name, ServeConfig().mode_name) == ("whole-capped", "whole")  # each has its own capacity
    assert mode_reason(streams.artifact, None, False, cap_edges=True).startswith(" (--cap-edges")


def test_a_windowed_artifact_fetched_without_its_build_record_streams_windowed(windowed, tmp_path: Path) -> None:
    """A push may leave build.json out (remote.py): the artifact's own files say it streams windowed, and the
    start-up line says what it cannot quote."""
    from kokoro_opt.artifacts import link_or_copy, open_artifact
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.config import mode_reason

    folder = tmp_path / windowed.name / windowed.id
    link_or_copy(windowed.path, folder)
    (folder / "build.json").unlink()
    fetched = open_artifact(folder)
    assert fetched.build.stages == [] and ServeConfig.for_selection(Selection(fetched)).windowed
    assert "no build record" in mode_reason(fetched, None, True)
    assert mode_reason(fetched, None, False) == " (windowed on request, --windowed)"
    # a record another machine wrote: the start line quotes its numbers only
    hostile = {"stages": [{"stage": "windows", "gate": {"pesq_mean": "4.4", "judged": "no"}, "below_default_budget": [1]}]}
    (folder / "build.json").write_text(json.dumps(hostile))
    fetched = open_artifact(folder)
    assert mode_reason(fetched, None, True).endswith("measured within its default budget; --no-windowed for whole jobs)")
    assert mode_reason(fetched, None, False) == " (windowed on request, --windowed: 1)"
    hostile["stages"][0]["gate"] = "x"
    (folder / "build.json").write_text(json.dumps(hostile))
    assert "within its default budget" in mode_reason(open_artifact(folder), None, True)


def test_a_short_job_finishes_whole_when_the_run_fits_before_anyone_runs_dry() -> None:
    """A short windowed job (`WindowedJob.finish`) sends a first window like any job's, then its whole-generator
    run once that run fits before this and every other listener runs dry. When only its own listener's audio is
    short and the others can wait, one bridge window goes first: the fewest steps after which the finish fits,
    decoded with wider context; the finish then follows it. Held back by other listeners, the job goes on in
    usual windows and may finish later, until half of it was sent: a finish decodes again what they sent. A
    request nobody hears before it ends is that run alone. A first window grown to last while the finish runs
    made the first sound ~10 ms later, and every later listener's when several started together
    (docs/measurements/2026-12-05-front-shapes.md); late finishes under load made the streams after them run
    dry (docs/measurements/2026-11-29-capacity.md)."""
    import asyncio
    from types import SimpleNamespace
    from typing import Any, cast

    from kokoro_opt.runtime.windowed import STEP_SAMPLES, WindowSettings
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.modes import SAFETY, WindowedJobs
    from tests.test_serve_units import SR, _FakeEncoder

    settings = WindowSettings()
    step = STEP_SAMPLES / SR
    bridge_context = 2 * (settings.bridge_overlap_steps - settings.overlap_steps)  # a bridge's wider context

    async def decisions() -> dict[str, Any]:
        engine = Engine(cast(Selection, None), ServeConfig())
        mode = WindowedJobs(engine, cast(Any, SimpleNamespace(settings=settings)))
        engine.mode = mode
        engine.window_cost.calibrate((12, 0.012), (80, 0.05))  # 200 steps of windows: ~0.12 s; the finish ~0.18 s
        pack = np.zeros((510, 1, 256), np.float32)
        listener = engine.submit([[1] * 10], pack, 1.0, _FakeEncoder(), True)
        quiet = engine.submit([[1] * 10], pack, 1.0, _FakeEncoder(), False)
        job = SimpleNamespace(finish=True, windows=0, bridged=False, decoded_share=0.06, front=SimpleNamespace(steps=200))
        listener.job = ([1] * 10, True, job)
        out: dict[str, Any] = {"first window": mode.window_steps(listener), "run": mode.finish_seconds(job)}
        job.finish = False
        out["first window of a long job"] = mode.window_steps(listener)
        job.finish = True
        out["before the first window"] = mode.finishes(listener, job)
        out["not streaming"] = mode.finishes(quiet, job)
        # Buffers are read against the clock: every "yes" below has seconds of margin, and every "no" only grows
        # more certain as a stalled CI worker lets the buffers run down.
        job.windows = 1
        now = time.monotonic()
        listener.first_out, listener.audio_out = now, 3.0
        out["3 s buffered"] = mode.finishes(listener, job)
        out["bridges, 3 s buffered"] = mode.bridges(listener, job)
        listener.audio_out = 0.1
        out["0.1 s buffered"] = mode.finishes(listener, job)
        out["bridge"] = mode.bridge_steps(listener, job)  # reads the clock: its buffer is 0.1 s less the time since
        out["bridge, buffer read after"] = mode._bridge(out["run"], listener.deadline() - time.monotonic())
        out["fewest bridge, 0.1 s buffered"] = mode._bridge(out["run"], 0.1)
        out["bridges, 0.1 s buffered"] = mode.bridges(listener, job)
        out["cost"] = lambda steps: engine.window_cost.predict(steps + bridge_context)
        listener.audio_out = 3.0
        other = engine.submit([[1] * 10], pack, 1.0, _FakeEncoder(), True)
        other.first_out, other.audio_out = now, 0.1
        out["another listener 0.1 s from running dry"] = mode.finishes(listener, job)
        listener.audio_out = 0.1
        out["bridges, both 0.1 s from running dry"] = mode.bridges(listener, job)
        other.audio_out = 3.0
        out["bridges, the other listener 3 s ahead"] = mode.bridges(listener, job)
        listener.audio_out = 0.02  # read at `now`: 20 ms left, less than any bridge takes, however long a stall
        out["bridges, 20 ms buffered"] = mode.bridges(listener, job, now=now)
        out["fewest bridge, 20 ms buffered"] = mode._bridge(out["run"], 0.02)
        out["window instead, 20 ms buffered"] = mode.window_steps(listener)
        job.front.steps = 400  # a finish twice as long: the bridge before it outgrows the usual window
        out["bridges, 20 ms buffered, a long finish"] = mode.bridges(listener, job, now=now)
        out["fewest bridge, 20 ms buffered, a long finish"] = mode._bridge(mode.finish_seconds(job), 0.02)
        job.front.steps = 200
        listener.audio_out = 0.1
        # the other's audio lasts while the finish runs, not while the bridge runs first
        half_bridge = out["cost"](mode.bridge_steps(listener, job)) / 2
        other.audio_out = (out["run"] + mode.next_unit_seconds(other) + half_bridge) / SAFETY + (time.monotonic() - now)
        out["bridges, the other listener's audio lasting the finish alone"] = mode.bridges(listener, job)
        other.audio_out = 3.0
        job.windows, job.decoded_share, listener.audio_out, other.audio_out = 2, 0.4, 3.0, 3.0
        out["a window later, 40% sent, both 3 s ahead"] = mode.finishes(listener, job)
        job.decoded_share = 0.6
        out["60% sent, both 3 s ahead"] = mode.finishes(listener, job)
        job.bridged = True
        out["60% sent, the last window its bridge"] = mode.finishes(listener, job)
        job.finish = False
        out["a long job"] = mode.finishes(listener, job)
        return out

    out = asyncio.run(decisions())
    assert out["first window"] == out["first window of a long job"] == settings.first_steps
    assert out["not streaming"] and out["3 s buffered"] and not out["bridges, 3 s buffered"]
    refused = ("before the first window", "0.1 s buffered", "another listener 0.1 s from running dry", "a long job")
    assert not any(out[k] for k in refused)

    def lasts(steps: int) -> bool:  # 0.1 s buffered: the bridge and then the finish run before it runs out
        return out["run"] + out["cost"](steps) <= SAFETY * (0.1 + steps * step)

    fewest = out["fewest bridge, 0.1 s buffered"]
    assert 0 < fewest < settings.steps and lasts(fewest) and not lasts(fewest - 1), fewest
    # however long the worker stalled, the bridge it chose lies between those for the buffer before and after
    assert fewest <= out["bridge"] <= out["bridge, buffer read after"]
    assert out["bridges, 0.1 s buffered"] and not out["bridges, both 0.1 s from running dry"]  # the other can't wait
    # with 20 ms left every unit comes late: the bridge goes while it comes sooner than the usual window would
    window = out["window instead, 20 ms buffered"]
    assert (
        out["cost"](out["fewest bridge, 20 ms buffered"]) < out["cost"](window - bridge_context)
        and out["bridges, 20 ms buffered"]
    )
    long_bridge = out["fewest bridge, 20 ms buffered, a long finish"]
    assert out["cost"](long_bridge) > out["cost"](window - bridge_context) and not out["bridges, 20 ms buffered, a long finish"]
    assert out["bridges, the other listener 3 s ahead"]
    assert not out["bridges, the other listener's audio lasting the finish alone"]  # a bridge it would not follow
    assert out["a window later, 40% sent, both 3 s ahead"] and not out["60% sent, both 3 s ahead"]
    assert out["60% sent, the last window its bridge"]  # a short phrase's bridge: the finish it was made for


def test_a_whole_answer_waits_while_a_listener_would_run_dry() -> None:
    """A request nobody hears before it ends (`stream: false`) has its arrival as deadline, so it came before every
    heard listener, and windowed its next unit is a front or a whole-generator run of up to a chunk that nothing
    priced. It now waits while that unit (a front, a finish, or a window of a job too long to finish) would leave a
    listener, served after it, without audio; it goes once their buffers cover it, when no listener has a unit to
    run (the worker never idles), or after MAX_HOLD seconds (past capacity buffers never grow). Whole jobs need no
    such wait: a job nobody hears is sized to the tightest listener's buffer (`Engine._budget`)."""
    import asyncio
    from types import SimpleNamespace
    from typing import Any, cast

    from kokoro_opt.runtime.windowed import WindowSettings
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.modes import MAX_HOLD, WholeJobs, WindowedJobs
    from kokoro_opt.serve.plan import Piece
    from tests.test_serve_units import _FakeEncoder

    async def picks() -> dict[str, Any]:
        engine = Engine(cast(Selection, None), ServeConfig())
        engine.mode = WindowedJobs(engine, cast(Any, SimpleNamespace(settings=WindowSettings())))
        engine.window_cost.calibrate((12, 0.012), (80, 0.05))  # a 200-step finish: ~0.18 s
        pack = np.zeros((510, 1, 256), np.float32)
        listener = engine.submit([[1] * 10] * 3, pack, 1.0, _FakeEncoder(), True)
        quiet = engine.submit([[1] * 10], pack, 1.0, _FakeEncoder(), False)
        listener.jobs, listener.first_out, listener.audio_out = 1, time.monotonic(), 0.1
        out: dict[str, Any] = {}

        def picked() -> str:
            chosen = engine._pick()
            assert chosen is not None
            return "listener" if chosen[0] is listener else "quiet"

        def restore() -> None:  # `_pick` pops the job it chose
            listener.pieces.extendleft([Piece([1] * 10)] * (3 - len(listener.pieces)))
            quiet.pieces.extendleft([Piece([1] * 10)] * (1 - len(quiet.pieces)))

        # Buffers are read against the clock: a stalled worker only makes 0.1 s shorter, 30 s holds for minutes.
        out["front, listener 0.1 s from running dry"] = picked()
        restore()
        listener.audio_out = 30.0
        out["front, listener 30 s ahead"] = picked()
        restore()
        quiet.job = ([1] * 10, True, SimpleNamespace(finish=True, front=SimpleNamespace(steps=200)))
        out["finish, listener 30 s ahead"] = picked()
        restore()
        listener.audio_out = 0.1
        out["finish, listener 0.1 s from running dry"] = picked()
        restore()
        quiet.held_since = time.monotonic() - MAX_HOLD - 1.0
        out[f"finish, listener 0.1 s from running dry, held {MAX_HOLD + 1:g} s already"] = picked()
        restore()
        quiet.held_since = None
        quiet.job[2].finish, quiet.job[2].front.steps = False, 2400  # too long to finish: its next unit is a window
        listener.audio_out = 1.0
        out["a 2 x 80-step window of a long job, listener 1 s ahead"] = picked()
        restore()
        quiet.job[2].finish, quiet.job[2].front.steps = True, 2400  # had it been priced as a finish of all of it
        out["a finish of 2400 steps, listener 1 s ahead"] = picked()
        restore()
        listener.audio_out = 0.1
        engine._running.add(listener)
        out["finish, the listener's unit already running"] = picked()
        engine._running.discard(listener)
        engine.mode = WholeJobs(engine)
        quiet.job = None
        out["whole jobs, listener 0.1 s from running dry"] = picked()
        return out

    out = asyncio.run(picks())
    assert out == {
        "front, listener 0.1 s from running dry": "listener",
        "front, listener 30 s ahead": "quiet",
        "finish, listener 30 s ahead": "quiet",
        "finish, listener 0.1 s from running dry": "listener",
        f"finish, listener 0.1 s from running dry, held {MAX_HOLD + 1:g} s already": "quiet",  # past capacity
        "a 2 x 80-step window of a long job, listener 1 s ahead": "quiet",
        "a finish of 2400 steps, listener 1 s ahead": "listener",
        "finish, the listener's unit already running": "quiet",
        "whole jobs, listener 0.1 s from running dry": "quiet",
    }


def test_retry_after_prices_the_queue_with_what_whole_windowed_jobs_took() -> None:
    """Windowed, the job cost model prices a job's front only (~80 ms for a first piece on 2 cores): a 429's
    Retry-After was 1 s whatever the queue. It is priced with what whole jobs took per token, once one was done."""
    import asyncio
    from types import SimpleNamespace
    from typing import Any, cast

    from kokoro_opt.runtime.windowed import WindowSettings
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.modes import WindowedJobs
    from tests.test_serve_units import _FakeEncoder

    async def retry_after() -> tuple[int, int]:
        engine = Engine(cast(Selection, None), ServeConfig())
        engine.mode = WindowedJobs(engine, cast(Any, SimpleNamespace(settings=WindowSettings())))
        engine.cost.calibrate((10, 0.05), (100, 0.1))  # a front: 44 ms + 0.6 ms a token
        engine.submit([[1] * 100] * 3, np.zeros((510, 1, 256), np.float32), 1.0, _FakeEncoder(), True)
        before = engine.retry_after(2)
        engine.mode.seconds_per_token = 0.01  # a whole job: 10 ms a token
        planning = Engine(cast(Selection, None), ServeConfig())  # admitted requests not yet cut into pieces
        planning.mode = engine.mode
        assert planning.retry_after(2) == 1  # nothing known: a slot frees as soon as a response is sent
        assert planning.retry_after(2, [4000, 3000]) == 60  # 3,000 characters shared by two: 60 s at most
        return before, engine.retry_after(2)

    assert asyncio.run(retry_after()) == (1, 6)  # 300 tokens left, shared by two requests: 0.42 s -> 1 s; 6 s


def test_a_burst_of_new_listeners_prices_each_first_window_at_the_size_it_gets() -> None:
    """Eight listeners starting together: the first one's first window must last while the other seven start, and
    each of their first windows grows to last while the ones after it start. Priced at the smallest first window,
    the first listeners of a burst of eight ran 40-80 ms dry (26 underruns in 6 runs against 7 now)."""
    from types import SimpleNamespace
    from typing import Any, cast

    from kokoro_opt.runtime.windowed import WindowSettings
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.modes import WindowedJobs

    engine = Engine(cast(Selection, None), ServeConfig())
    settings = WindowSettings()
    mode = WindowedJobs(engine, cast(Any, SimpleNamespace(settings=settings)))
    engine.window_cost.calibrate((12, 0.016), (80, 0.05))  # ~9.6 ms a window and 0.5 ms a step, as on 2 cores
    first = engine.window_cost.predict(settings.first_steps)
    assert mode.starts_seconds([0.045]) == pytest.approx(0.045 + first)  # the last to start: the smallest window
    seven = mode.starts_seconds([0.045] * 7)
    assert seven > 7 * (0.045 + first) + 0.02  # the earlier ones' windows are larger: 20 ms and more of them
    # and no more than if each of the seven had the largest window
    assert seven < 7 * (0.045 + engine.window_cost.predict(settings.steps))


@pytest.mark.parametrize("kind", ["windowed", "fused_artifact"])
def test_the_server_finishes_short_jobs_with_the_whole_generator(kind: str, request: pytest.FixtureRequest) -> None:
    """A request nobody hears before it ends: each short job is one whole-generator run, no window. A listener:
    a finish, when it comes, follows a first window (which run comes then is the scheduler's, by the load:
    tests/test_serve_units.py). Both carry the audio through. The same with a fused generator, which runs
    every finish in place of the whole_generator graph."""
    import asyncio

    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.encoders import make_encoder
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.modes import FINISH_RATIO

    artifact = request.getfixturevalue(kind)
    engine = Engine(resolve_artifact(str(artifact.path)), ServeConfig(first_chunk_tokens=20, chunk_tokens=120, windowed=True))
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.synth is not None, engine.error
        assert (engine.mode.decoder.fused is not None) == (kind == "fused_artifact")
        finished: list[int] = []  # windows each job had sent before its finish
        finish = engine.windows.finish

        def counted(job, *args, **kwargs):
            finished.append(job.windows)
            return finish(job, *args, **kwargs)

        engine.windows.finish = counted
        pack = engine.synth.packs["tiny_0"]

        async def collect(streaming: bool) -> bytes:
            encoder = make_encoder("pcm", engine.sample_rate, streaming)
            stream = engine.submit(engine.plan("Hello there."), pack, 1.0, encoder, streaming)
            parts = []
            while (item := await asyncio.wait_for(stream.queue.get(), 120)) is not None:
                assert isinstance(item, bytes), item
                parts.append(item)
            return b"".join(parts)

        priced = engine.mode.finish_ratio  # warm-up's finish set it first
        whole = asyncio.run(collect(False))
        assert finished == [0]
        assert engine.mode.finish_ratio not in (priced, FINISH_RATIO)  # each finish prices the next by what it took
        assert engine.mode.seconds_per_token > 0  # a whole job's compute per token: what Retry-After prices
        finished.clear()
        heard = asyncio.run(collect(True))
        assert all(windows >= 1 for windows in finished)
    finally:
        engine.stop()
    assert len(whole) > 24_000 // 4 and len(heard) > 24_000 // 4


def _served_alone_and_together(windowed) -> tuple[list[bytes], list[bytes], int]:
    """Two non-streaming requests on a 2-worker engine: each served alone, then both at once."""
    import asyncio

    from kokoro_opt.machine import usable_cores
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.encoders import make_encoder
    from kokoro_opt.serve.engine import Engine

    texts = ("Hello there. How are you today? Fine, thanks.", "The lamp was lit at dusk, and its beam swept the sea.")
    engine = Engine(
        resolve_artifact(str(windowed.path)), ServeConfig(first_chunk_tokens=20, chunk_tokens=120, windowed=True, workers=2)
    )
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.synth is not None, engine.error
        options = engine.windows.front_session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"  # two workers: no spinning
        # and, where nothing names the threads, each run its share of the cores rather than a pool over all of them
        assert options.intra_op_num_threads == max(1, usable_cores() // 2)
        pack = engine.synth.packs["tiny_0"]

        async def collect(stream) -> bytes:
            parts = []
            while (item := await asyncio.wait_for(stream.queue.get(), 120)) is not None:
                assert isinstance(item, bytes), item
                parts.append(item)
            return b"".join(parts)

        def request(text: str):  # non-streaming: the same windows whatever the load (plan.window_steps)
            return engine.submit(engine.plan(text), pack, 1.0, make_encoder("pcm", engine.sample_rate, False), False)

        async def serve(together: bool) -> list[bytes]:
            if not together:
                return [await collect(request(t)) for t in texts]
            return list(await asyncio.gather(*(collect(request(t)) for t in texts)))

        alone = asyncio.run(serve(False))
        most_alone = engine.most_running
        # the two requests' first jobs start only together: one worker alone would break the barrier
        met, start, calls = threading.Barrier(2, timeout=60), engine.windows.start, itertools.count()

        def start_together(*args, **kwargs):
            if next(calls) < 2:
                met.wait()
            return start(*args, **kwargs)

        engine.windows.start = start_together
        together = asyncio.run(serve(True))
    finally:
        engine.stop()
    assert most_alone == 1
    return alone, together, engine.most_running


def test_two_workers_serve_two_requests_at_once_with_the_same_audio(windowed, monkeypatch: pytest.MonkeyPatch) -> None:
    """--workers 2 (windowed) runs two requests' windows at once on the shared sessions, and each request's
    audio is what it is served alone (where one worker ran one unit at a time)."""
    from kokoro_opt.runtime.session import THREADS_ENV, SessionSettings, shared_by

    monkeypatch.delenv(THREADS_ENV, raising=False)  # what a user's server gets: no thread count named
    # a count tuned.json or KOKORO_OPT_THREADS names is the process's, split among the workers too
    assert shared_by(SessionSettings(intra_op_num_threads=4), 2).intra_op_num_threads == 2
    assert shared_by(SessionSettings(intra_op_num_threads=1), 2).intra_op_num_threads == 1
    assert shared_by(SessionSettings(), 1) == SessionSettings()  # one worker: as named, or every core
    alone, together, most = _served_alone_and_together(windowed)
    assert most == 2
    for solo, shared in zip(alone, together, strict=True):
        a, b = (np.frombuffer(x, dtype=np.int16).astype(np.int32) for x in (solo, shared))
        assert len(a) == len(b) > 24_000 // 2 and np.abs(a - b).max() <= 1  # the same windows: at most 1 LSB apart


def test_more_workers_need_windowed_serving(plain) -> None:
    from kokoro_opt.serve import ServeConfig
    from tests.test_build import run_cli

    result = run_cli("serve", "--artifact", str(plain.path), "--workers", "2")  # refused before it binds a port
    assert result.returncode == 2 and "--workers 2 needs windowed serving" in result.stderr, result.stderr
    assert "--windowed" in result.stderr and "Traceback" not in result.stderr
    for count in (0, 3):  # 3 and more: not measured
        with pytest.raises(UserError, match="workers must be 1 to 2"):
            ServeConfig(workers=count, windowed=True)
    assert ServeConfig(workers=2, windowed=True).workers == 2


def test_serve_warns_when_this_machine_bridges_a_phrase_longer_than_its_first_window(caplog) -> None:
    """What the warm-up measured (a window's and a finish's cost) says how long a lone listener's phrase is bridged
    before its finish. Bridges longer than the first window put served phrases below the windows gate on a slower
    machine (docs/measurements/2026-12-05-intel-xeon.md), so serve says so and names --no-windowed."""
    import logging
    from types import SimpleNamespace
    from typing import Any, cast

    from kokoro_opt.runtime.windowed import WindowSettings
    from kokoro_opt.select import Selection
    from kokoro_opt.serve import ServeConfig
    from kokoro_opt.serve.engine import Engine
    from kokoro_opt.serve.modes import PHRASE_STEPS, WindowedJobs

    def mode(seconds_per_step: float, decodes_whole: bool = True, finish_per_step: float | None = None) -> WindowedJobs:
        engine = Engine(cast(Selection, None), ServeConfig())
        engine.window_cost.calibrate((12, 12 * seconds_per_step), (80, 80 * seconds_per_step))
        made = WindowedJobs(engine, cast(Any, SimpleNamespace(settings=WindowSettings(), decodes_whole=decodes_whole)))
        # a finish costs what windows of its steps do, unless told otherwise
        made.warm_finish = (PHRASE_STEPS, PHRASE_STEPS * (finish_per_step or seconds_per_step))
        return made

    # windows at 1 ms a step; a phrase's finish of 0.08 s fits in 0.7 x the first window's 150 ms of audio
    assert mode(0.001, finish_per_step=0.08 / PHRASE_STEPS).phrase_bridge_steps() == 0
    bridges = [mode(0.001, finish_per_step=finish / PHRASE_STEPS).phrase_bridge_steps() for finish in (0.11, 0.15, 0.2)]
    assert 0 < bridges[0] < bridges[1] < bridges[2] <= 80

    caplog.set_level(logging.WARNING, logger="kokoro_opt.serve")
    fast, slow = mode(0.0008), mode(0.0016)
    assert fast.phrase_bridge_steps() <= 12 < slow.phrase_bridge_steps()
    assert mode(0.0016, decodes_whole=False).phrase_bridge_steps() == 0  # no finish: nothing to bridge to
    fast.say_phrase_bridge()
    assert not caplog.records
    slow.say_phrase_bridge()
    assert "-step bridge after its 12-step first window" in caplog.text and "--no-windowed" in caplog.text
