"""The two ways a worker decodes the job it picked: whole jobs, or a job's front and then its windows.

The engine (engine.py) owns the streams, the queue, the scheduling and the cost models; a mode turns one
picked unit of work into audio sent, times a job at warm-up, and makes a request's first audio for `tune`.
Both take the engine they serve (typed `Any`: engine.py imports this module, and the import graph has no cycle,
not even for type checking: tests/test_store.py).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from kokoro_opt.runtime.windowed import STEP_SAMPLES, WindowedDecoder, WindowedJob
from kokoro_opt.serve.plan import Piece, bridge_steps, queue_seconds, smallest_heard_window, window_steps
from kokoro_opt.serve.stream import new_listeners

log = logging.getLogger("kokoro_opt.serve")

SAFETY = 0.7  # a job may use this share of the tightest listener's buffered audio: estimates are rough
# A finish (the whole generator over a job) per step against a window's (the window cost model) before any
# finish was timed: whole generator 0.65-0.85 ms per step, windows ~0.55 (AMD EPYC); then what finishes take
FINISH_RATIO = 1.5
# A short phrase's steps, edge silence included ("Checkbox checked.": 150): what the warm-up prices a lone
# listener's bridge for (`phrase_bridge_steps`)
PHRASE_STEPS = 120
# A finish decodes its whole job again: a job that went on in usual windows past its first window and bridge
# finishes only while no more than this share of it was sent (under load such late finishes, 120-230 ms for the
# last 38-116 steps, left other streams short)
LATE_FINISH_SHARE = 0.5
# Seconds a whole answer's unit is held back for listeners at most (`WindowedJobs.defers`)
MAX_HOLD = 2.0


class WholeJobs:
    """Each job through the whole graph; its audio is sent when the job is done."""

    name = "whole"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def defers(self, stream: Any) -> bool:
        """Never: a job nobody hears is already sized to the tightest listener's buffered audio (`Engine._budget`)."""
        return False

    def job_seconds(self, stream: Any, now: float) -> float:
        """No bound besides the tightest listener's buffered audio (`Engine._budget`): a job is one unit."""
        return math.inf

    def seconds_for(self, tokens: int) -> float:
        """Seconds the synthesis of `tokens` more takes (Retry-After): the job cost model."""
        return self.engine.cost.predict(tokens)

    def step(self, stream: Any, job: Piece, last: bool) -> None:
        engine = self.engine
        audio, compute = engine.run_job(job, stream.pack, stream.speed, stream.run_options)
        log.debug("request %d: job of %d tokens in %.2f s (last=%s)", stream.id, len(job), compute, last)
        if not stream.cancelled:
            engine.emit(stream, engine.join(stream.joiner, job, audio, last, stream.speed), last)

    def time_job(self, tokens: list[int], pack: np.ndarray) -> tuple[float, dict[int, float]]:
        """Seconds one job of `tokens` takes (warm-up), and no windows."""
        started = time.perf_counter()
        self.engine.synthesize(Piece(tokens), pack, 1.0, None)
        return time.perf_counter() - started, {}

    def first_audio(self, job: Piece, pack: np.ndarray, speed: float, last: bool) -> np.ndarray:
        audio, _ = self.engine.run_job(job, pack, speed)
        return self.engine.join(self.engine.new_joiner(), job, audio, last, speed)


class WindowedJobs:
    """A job's front and first window, then one more window per unit: each window is sent as soon as it is
    decoded, and other streams may be served between two windows of a job. Window sizes follow the
    listeners' deadlines (`plan.window_steps`). A short job (`WindowedJob.finish`) sends its first window
    and then the rest from one whole-generator run, when that run fits before every listener needs audio
    (else it goes on in windows); a request nobody hears before it ends is that run alone."""

    name = "windowed"

    def __init__(self, engine: Any, decoder: WindowedDecoder) -> None:
        self.engine, self.decoder = engine, decoder
        self.finish_ratio = FINISH_RATIO
        self.warm_finish: tuple[int, float] | None = None  # (steps, seconds) of a finish timed at warm-up
        self.seconds_per_token: float | None = None  # a whole job's compute (front, windows, finish) per token

    def finish_seconds(self, job: WindowedJob) -> float:
        """What `job`'s finish is priced at: the window cost of its steps, scaled by what finishes took (from the
        first price on, the finish timed at warm-up: the window cost model is fitted by then)."""
        return self.finish_seconds_of(job.front.steps)

    def finish_seconds_of(self, steps: int) -> float:
        """What a finish of `steps` generator steps is priced at (`finish_seconds`)."""
        window_cost = self.engine.window_cost
        if self.warm_finish is not None:
            timed, seconds = self.warm_finish
            self.finish_ratio, self.warm_finish = seconds / max(window_cost.predict(timed), 1e-6), None
        return self.finish_ratio * window_cost.predict(steps)

    def window_steps(self, stream: Any) -> int:
        """`plan.window_steps` for this stream, with the other listeners priced by the cost models (call it
        holding the engine's lock)."""
        engine, settings = self.engine, self.decoder.settings
        waiting = new_listeners(engine.streams, stream)
        # A first window lasts while this stream's next window runs (alone: the smallest a heard stream
        # gets), and while every other new listener gets its front and first window.
        own_next = settings.steps if waiting else smallest_heard_window(settings.first_steps, settings.steps)
        cover = engine.window_cost.predict(own_next)
        if waiting:  # their fronts and first windows, shared among the workers
            fronts = [self.front_seconds(s) for s in waiting]
            cover += self.starts_seconds(fronts) / engine.workers
        fit = self.fit_seconds(stream)
        return window_steps(
            settings.first_steps,
            settings.steps,
            streaming=stream.streaming,
            heard=stream.first_out is not None,
            cover_seconds=cover,
            step_seconds=STEP_SAMPLES / engine.sample_rate,
            safety=SAFETY,
            fit_steps=engine.window_cost.tokens_within(fit),
        )

    def starts_seconds(self, fronts: list[float]) -> float:
        """Seconds until listeners waiting for their first audio all have it, by their fronts' prices: each first
        window priced at the size it will get, lasting while the ones after it start (first windows go first, in
        turn). Priced at the smallest first window, a burst of eight left its first listeners 40-80 ms short."""
        engine, settings = self.engine, self.decoder.settings
        step = STEP_SAMPLES / engine.sample_rate
        later, alone = 0.0, smallest_heard_window(settings.first_steps, settings.steps)  # seconds of the starts after it
        for front in reversed(fronts):
            own = engine.window_cost.predict(settings.steps if later else alone)
            first = window_steps(settings.first_steps, settings.steps, streaming=True, heard=False,
                                 cover_seconds=own + later / engine.workers, step_seconds=step, safety=SAFETY)  # fmt: skip
            later += front + engine.window_cost.predict(first)
        return later

    def step(self, stream: Any, piece: Piece, last: bool) -> None:
        engine = self.engine
        if stream.job is None:
            job = self.decoder.start(piece.feed, stream.pack, stream.speed, stream.run_options, stream.streaming, piece.context)
            stream.job, stream.starting = (piece, last, job), False
            if job.stats is not None:  # the front model prices a front with its per-job part
                with engine.cond:  # two workers observe
                    engine.cost.observe(len(piece), stream.speed, job.front_seconds)
            if not stream.streaming:
                with engine.cond:
                    if self.defers(stream):  # its finish waits while the listeners' audio runs short (`defers`)
                        return
        job = stream.job[2]
        spent, first = job.compute, job.cursor  # the job times its own windows
        overlap = None
        with engine.cond:
            finishing = self.finishes(stream, job)
            if finishing:
                priced, steps = self.finish_seconds(job), 0
            elif self.bridges(stream, job):
                priced, steps = 0.0, self.bridge_steps(stream, job)
                overlap, job.bridged = self.decoder.settings.bridge_overlap_steps, True
            else:
                priced, steps = 0.0, self.window_steps(stream)
        if finishing:
            audio = self.decoder.finish(job, stream.run_options)
            with engine.cond:  # the window cost model stays the windows'
                seen = (job.compute - spent) / max(priced, 1e-6)
                self.finish_ratio *= 0.7 + 0.3 * min(max(seen, 0.2), 5.0)
        else:
            audio = self.decoder.next_window(job, steps, stream.run_options, overlap)
            with engine.cond:  # context beyond the usual (a bridge's, a lean first window's) counted as steps
                engine.window_cost.observe(job.cursor - first + job.extra_steps, 1.0, job.compute - spent)
        closes = job.done
        if closes:
            stream.job = None
            with engine.cond:  # what `seconds_for` prices the rest of a queue with
                per = job.compute / max(len(piece), 1)
                held = self.seconds_per_token
                self.seconds_per_token = per if held is None else 0.7 * held + 0.3 * per
            if engine.metrics:
                engine.metrics.observe_job(job.compute, job.samples / engine.sample_rate)
        if not stream.cancelled:
            out = engine.join(stream.joiner, piece, audio, last and closes, stream.speed, opens=job.opened, closes=closes)
            job.opened = False
            engine.emit(stream, out, last and closes)

    def finishes(self, stream: Any, job: WindowedJob) -> bool:
        """Whether `job`'s next unit is its finish (call it holding the engine's lock): at once for a request
        nobody hears before it ends; for a listener after the first window, when the whole-generator run is
        priced to end before this and every other listener's buffered audio runs out; after usual windows too,
        while no more than LATE_FINISH_SHARE of the job was sent."""
        if not job.finish:
            return False
        if not stream.streaming:
            return True
        late = job.windows > (2 if job.bridged else 1)
        if job.windows == 0 or (late and job.decoded_share > LATE_FINISH_SHARE):
            return False
        return self.finish_seconds(job) <= self.fit_seconds(stream)

    def defers(self, stream: Any) -> bool:
        """Whether a request nobody hears before it ends waits for the listeners (call it holding the engine's lock):
        while its next unit (a job's front; then the whole-generator run that finishes the job, or its next window
        when it cannot finish) is priced to end after some listener, served after it with its next unit each, runs
        out of audio (`others_seconds`). A whole answer's deadline is its arrival, so it would otherwise go before every
        heard listener with an unpriced finish of up to a whole chunk; held back, it goes as soon as their buffers
        cover it (they grow with every window), when no listener has a unit to run (`Engine._pick`), or after
        MAX_HOLD seconds: past capacity the listeners' buffers never grow, and it goes in arrival order again."""
        if stream.streaming:
            return False
        now = time.monotonic()
        if stream.job is None:
            price = self.front_seconds(stream)
        elif self.finishes(stream, job := stream.job[2]):
            price = self.finish_seconds(job)
        else:
            price = self.engine.window_cost.predict(self.window_steps(stream))
        if price <= self.others_seconds(stream, now):
            return False
        if stream.held_since is None:  # cleared when its unit is picked (`Engine._pick`)
            stream.held_since = now
        return now - stream.held_since < MAX_HOLD

    def seconds_for(self, tokens: int) -> float:
        """Seconds the synthesis of `tokens` more takes (Retry-After): what whole jobs took per token, front, windows
        and finish together; the front's cost model alone (a fraction of it) until a job was done."""
        if self.seconds_per_token is None:
            return self.engine.cost.predict(tokens)
        return tokens * self.seconds_per_token

    def bridges(self, stream: Any, job: WindowedJob, now: float | None = None) -> bool:
        """Whether `job`'s next unit is a bridge (call it holding the engine's lock, after `finishes` said no):
        right after the first window of a job that finishes, when its own listener's audio is what runs short, lasts
        while the bridge runs (or the bridge comes sooner than a usual window would), and the other listeners' would last
        while the bridge and then the finish run. Held back by them, or by a bridge later than a usual window, the job
        goes on in windows of the usual size instead (and may finish later: `finishes`). `now`: when the listeners'
        buffers are read (`fit_seconds`)."""
        if not (job.finish and job.windows == 1 and stream.streaming):
            return False
        finish = self.finish_seconds(job)
        now = time.monotonic() if now is None else now
        buffered = stream.deadline() - now
        if SAFETY * buffered >= finish:
            return False
        # the others' audio must last while the bridge runs too: else the finish no longer fits after it, and the
        # job goes on in windows after a bridge of a few steps (~13 ms for 3-4 steps) that bought nothing
        steps = self._bridge(finish, buffered)
        bridge = self.engine.window_cost.predict(steps + self.decoder.settings.bridge_extra_steps)
        # its own audio comes only once it is decoded: when that is after this listener's runs out, the usual window
        # goes instead if it comes sooner (a lone listener on one-thread workers got 58-80 steps after a 13-step
        # first window where 40 would have come in time, and ~40 ms of silence)
        late = bridge > SAFETY * buffered
        if late and bridge > self.engine.window_cost.predict(self.window_steps(stream)):
            return False
        return finish + bridge <= self.others_seconds(stream, now)

    def bridge_steps(self, stream: Any, job: WindowedJob) -> int:
        """Steps of the window between `job`'s first window and its finish, when the finish does not fit yet
        (call it holding the engine's lock): the fewest after which it does, for this listener
        (`plan.bridge_steps`). Decoded with wider context: its seams then cost nothing measurable, where a
        first window grown to last while the finish runs made the first sound ~10 ms later
        (docs/measurements/2026-12-05-front-shapes.md)."""
        return self._bridge(self.finish_seconds(job), stream.deadline() - time.monotonic())

    def phrase_bridge_steps(self) -> int:
        """The bridge a lone listener's short phrase (`PHRASE_STEPS`) gets on this machine, by the cost models
        (call it after warm-up): 0 when its finish fits right after the first window (`finishes`)."""
        settings = self.decoder.settings
        if not self.decoder.decodes_whole or settings.finish_steps < PHRASE_STEPS:
            return 0
        finish, first_audio = self.finish_seconds_of(PHRASE_STEPS), settings.first_steps * STEP_SAMPLES / self.engine.sample_rate
        return 0 if finish <= SAFETY * first_audio else self._bridge(finish, first_audio)

    def _bridge(self, finish_seconds: float, buffered_seconds: float) -> int:
        """`plan.bridge_steps` with this machine's window costs (a bridge's wider context counted as steps)."""
        engine, settings = self.engine, self.decoder.settings
        return bridge_steps(
            finish_seconds,
            buffered_seconds,
            STEP_SAMPLES / engine.sample_rate,
            lambda steps: engine.window_cost.predict(steps + settings.bridge_extra_steps),
            most=settings.steps,
            safety=SAFETY,
        )

    def say_phrase_bridge(self) -> None:
        """Warn when this machine is too slow for a lone listener's phrase to finish whole soon after its first
        window (call it after warm-up): bridges of 9-33 steps put served phrases below the windows gate, 3-16 kept
        them within it (docs/measurements/2026-12-05-intel-xeon.md)."""
        first = self.decoder.settings.first_steps
        if (bridge := self.phrase_bridge_steps()) > first:
            log.warning(
                "on this machine a short phrase's finish needs a %d-step bridge after its %d-step first window: that "
                "much more of each phrase is decoded with predicted statistics, below the windows gate's quality; "
                "--no-windowed serves every job whole",
                bridge,
                first,
            )

    def fit_seconds(self, stream: Any, now: float | None = None) -> float:
        """Seconds this stream's next unit may take: every other heard listener, served after it in deadline
        order with its next unit, and its own listener still hear audio in time (`plan.queue_seconds`)."""
        now = time.monotonic() if now is None else now
        return min(self.others_seconds(stream, now), SAFETY * (stream.deadline() - now))

    def others_seconds(self, stream: Any, now: float) -> float:
        """Seconds a unit for `stream` may take so that every other heard listener, served after it in deadline
        order with its next unit, still hears audio in time (`plan.queue_seconds`)."""
        others = [s for s in self.engine.streams if s.streaming and s.first_out is not None and s is not stream]
        return queue_seconds([s.deadline() - now for s in others], [self.next_unit_seconds(s) for s in others], SAFETY)

    def next_unit_seconds(self, stream: Any) -> float:
        """What a heard listener's next unit is priced at (call it holding the engine's lock): the smallest window
        a heard listener gets (not a first window: six listeners after a burst each got 40 steps where 12 were
        priced, and the last of them ran dry), after the front of its next piece when its job is done and no
        worker is starting the next one. Listeners who start together reach their next jobs together: a 158-token
        front and then four 67-token ones in a row left the last three 38-102 ms short (capacity log, 2026-12-07)."""
        if stream.job is not None or stream.starting or not stream.pieces:
            return self.heard_window_seconds()
        return self.front_seconds(stream) + self.heard_window_seconds()

    def front_seconds(self, stream: Any) -> float:
        """What the front of a stream's next piece (with its per-job part) is priced at."""
        return self.engine.cost.predict(len(stream.pieces[0]) if stream.pieces else 0, stream.speed)

    def heard_window_seconds(self) -> float:
        """The price of the smallest window a listener already hearing audio gets."""
        settings = self.decoder.settings
        return self.engine.window_cost.predict(smallest_heard_window(settings.first_steps, settings.steps))

    def job_seconds(self, stream: Any, now: float) -> float:
        """Seconds a heard listener's next job's front may take (`Engine._budget`): its first window after it, and
        every other heard listener's next unit, still in time (`fit_seconds`)."""
        return self.fit_seconds(stream, now) - self.heard_window_seconds()

    def time_job(self, tokens: list[int], pack: np.ndarray) -> tuple[float, dict[int, float]]:
        """A job's front (and per-job part: it cannot be interleaved), and each window's seconds by its steps; a
        job that can finish also times its finish (`finish_seconds`)."""
        job = self.decoder.start(tokens, pack)
        windows = {}
        while not job.done:
            spent, first = job.compute, job.cursor
            self.decoder.next_window(job)
            windows[job.cursor - first + job.extra_steps] = job.compute - spent
        if job.finish:
            started = time.perf_counter()
            self.decoder.whole_audio(job.front)
            self.warm_finish = (job.front.steps, time.perf_counter() - started)
        return job.front_seconds, windows

    def first_audio(self, piece: Piece, pack: np.ndarray, speed: float, last: bool) -> np.ndarray:
        job = self.decoder.start(piece.feed, pack, speed, context=piece.context)
        audio = self.decoder.next_window(job)
        return self.engine.join(self.engine.new_joiner(), piece, audio, last and job.done, speed, closes=job.done)
