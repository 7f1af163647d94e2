"""The synthesis engine: one loaded artifact, worker threads, a fair queue of text pieces.

By default one worker does all synthesis (and encoding): with 2 cores one ORT run using every intra-op thread beats
two runs fighting over them (benchmarks/concurrent_units.py: two whole-graph jobs at once took 1.03-1.04x the time of
the same two in turn). Windowed (`--windowed --workers 2`), two workers may run two streams' units at once on the same
sessions: fronts and windows are small graphs that leave cores idle (1.04-1.18x the throughput), so four streams
together underran less and finished sooner, at ~50 MB more memory and a later median first audio (docs/serving.md).
The event loop only moves bytes. Requests share the workers in this order: first chunks first (oldest request first),
so every new listener hears audio early; then *earliest playback deadline first*, where a stream's deadline is when
its listener runs out of audio (first byte time + seconds sent), so a stream about to underrun goes before one that is
ahead; windowed, a whole answer waits while its next unit would leave a listener without audio
(`WindowedJobs.defers`). A stream runs on one worker at a time. Admission is bounded, so first chunks cannot starve
running streams for long. Job size adapts to the same deadlines (see `plan.py` and `_budget`). How a worker decodes
what it picked is the engine's mode (modes.py): whole jobs, or windowed, where the unit of work is a job's front plus
its first window, or one more window, and window sizes follow the deadlines too (`plan.window_steps`): a new
listener's first window lasts while its next one runs and the others waiting get theirs, and a later one is cut short
when it would leave another listener without audio.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.runtime import open_synthesizer
from kokoro_opt.runtime.join import PAUSES, Joiner, boundary
from kokoro_opt.runtime.steps import SEAM_STEPS, spoken_steps
from kokoro_opt.runtime.synth import Speaker, Synthesizer
from kokoro_opt.runtime.windowed import STEP_SAMPLES, WindowedDecoder
from kokoro_opt.select import Selection
from kokoro_opt.serve.config import ServeConfig, edges_missing, windows_missing
from kokoro_opt.serve.encoders import Encoder
from kokoro_opt.serve.metrics import Metrics
from kokoro_opt.serve.modes import SAFETY, WholeJobs, WindowedJobs
from kokoro_opt.serve.plan import CostModel, Piece, frames_bound, make_pieces, spoken_tokens, take_job
from kokoro_opt.serve.stream import FIRST_SEND_WAIT, Stream, waits_for_first_send
from kokoro_opt.serve.warmup import warm_up

log = logging.getLogger("kokoro_opt.serve")

FIRST_JOB_BUDGET = 0  # a streaming request's first job: its first piece alone (see `_budget`)


class Engine:
    def __init__(self, selection: Selection, config: ServeConfig | None = None, metrics: Metrics | None = None) -> None:
        self.selection = selection
        self.config = config or ServeConfig.for_selection(selection)
        self.metrics = metrics
        self.synth: Speaker | None = None  # a Synthesizer (ONNX Runtime) or, on macOS, a CoreMLSynthesizer
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.cost = CostModel()  # a job's cost (windowed: front and per-job part), fitted at warm-up, then follows the load
        self.window_cost = CostModel()  # windowed: a window's cost by its steps
        self.cond = threading.Condition()
        self.streams: list[Stream] = []
        self._running: set[Stream] = set()  # streams a worker is running a job or window for
        self.most_running = 0  # the most units ever run at once (what `workers` allows, if the load asks)
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.space_id: int | None = None  # the vocabulary's space: where jobs are cut between words
        self.mode: WholeJobs | WindowedJobs = WholeJobs(self)  # how a worker decodes a job (modes.py)

    @property
    def windows(self) -> WindowedDecoder | None:
        """The windowed decoder, when the engine streams windowed."""
        return self.mode.decoder if isinstance(self.mode, WindowedJobs) else None

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Load, warm up and serve on the worker threads; `ready` is set once warm."""
        self._threads = [threading.Thread(target=self._main, name="kokoro-worker", daemon=True)]
        self._threads[0].start()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cond:
            self._stopping = True
            for stream in self._running:
                if stream.run_options is not None:
                    stream.run_options.terminate = True
            self.cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(deadline - time.monotonic(), 0.0))

    @property
    def workers(self) -> int:
        """Streams worked for at once (see the module docs): more than one only windowed."""
        return self.config.workers if self.windows is not None else 1

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as exc:
            self.error = exc
            if isinstance(exc, UserError):  # a file's fault, said in one line (the server then ends with it)
                log.error("loading the artifact failed: %s", exc)
            else:
                log.exception("loading the artifact failed")
            return
        self.ready.set()
        with self.cond:  # `stop` joins what is started before it: none after it
            for n in range(2, self.workers + 1) if not self._stopping else ():
                thread = threading.Thread(target=self._serve, name=f"kokoro-worker-{n}", daemon=True)
                thread.start()  # the sessions are shared: ONNX Runtime runs them concurrently
                self._threads.append(thread)
        self._serve()

    def _load(self) -> None:
        sel = self.selection
        started = time.perf_counter()  # what is served and why: `serve` said it before this thread began
        settings = self.config.session_settings(sel)  # threads split among the workers (windowed only)
        if self.config.windowed:  # windowed jobs never run the whole graph: never load it
            self.attach(Synthesizer(sel.artifact, settings, load=False))
        else:
            self.attach(open_synthesizer(sel.artifact, settings))
        took = time.perf_counter() - started
        log.info("loaded %s %s in %.1f s: %s", sel.artifact.name, sel.artifact.id, took, settings.describe())
        if self.config.warmup:
            warm_up(self)

    def attach(self, synth: Speaker) -> None:
        """Synthesize with this loaded model (`start` loads the selection's; kokoro-opt tune passes its cached ones)."""
        if self.config.cap_edges and not (isinstance(synth, Synthesizer) and synth.edges):
            raise UserError(edges_missing(getattr(synth, "artifact", None) and synth.artifact.name), "drop cap_edges")
        if self.config.windowed:
            if not isinstance(synth, Synthesizer):
                raise UserError(windows_missing(getattr(synth, "artifact", None) and synth.artifact.name), "drop windowed")
            WindowedDecoder.check(synth.artifact)  # the server's synth never loaded the whole graph (`_load`)
            decoder = WindowedDecoder.of_artifact(synth, runs_at_once=self.config.workers)
            if self.config.first_window_steps is not None:  # tuned or asked for: the artifact's size otherwise
                decoder.settings = replace(decoder.settings, first_steps=self.config.first_window_steps)
            self.mode = WindowedJobs(self, decoder)
        self.synth = synth
        self.space_id = synth.vocab.get(" ")
        # a job fed context is cut where its own tokens' frames lie: a model that gives no durations (kokoro-onnx's
        # graph) or a vocab without a space speaks every chunk alone
        cuttable = self.space_id is not None and (self.config.windowed or synth.gives_durations)
        self._context_words = self.config.context_words if cuttable else 0

    # ---- requests (called from the event loop) ------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.synth.sample_rate if self.synth else 24_000

    def plan(self, text: str, speed: float = 1.0) -> list[Piece]:
        """Text -> pieces, smaller for slow speech (`frames_bound`); CPU work (espeak): call it off the event loop."""
        assert self.synth is not None
        first = frames_bound(self.config.first_chunk_tokens, speed)
        pieces = max(first, frames_bound(self.config.pieces, speed))
        # a piece and its context in no more frames than the largest job (`frames_bound`)
        largest = frames_bound(self.config.chunk_tokens, speed)
        return make_pieces(text, self.synth.vocab, first, pieces, self._context_words, max(largest, pieces))

    def spoken_tokens(self, pieces: Sequence[Piece]) -> int:
        """The tokens a request's pieces speak, merged as jobs merge them (`plan.spoken_tokens`): what a 413 counts."""
        return spoken_tokens(pieces, self.space_id)

    def submit(
        self, pieces: Sequence[Piece | list[int]], pack: np.ndarray, speed: float, encoder: Encoder, streaming: bool
    ) -> Stream:
        return self.enqueue(Stream(pieces, pack, speed, encoder, streaming, self.new_joiner()))

    def enqueue(self, stream: Stream) -> Stream:
        """Queue a request made as a `Stream` (one whose sender says when its first audio is sent, `first_sent`)."""
        with self.cond:
            self.streams.append(stream)
            self.cond.notify()
        return stream

    def cancel(self, stream: Stream) -> None:
        """Drop the stream's queued pieces and abort its running job (ORT's terminate flag)."""
        with self.cond:
            if stream.finished or stream.cancelled:
                return
            stream.cancelled = True
            stream.cancelled_at = time.monotonic()
            dropped = len(stream.pieces)
            stream.pieces.clear()
            stream.job = None
            if stream in self.streams:
                self.streams.remove(stream)
            running = stream in self._running
            if running and stream.run_options is not None:
                stream.run_options.terminate = True
        if self.metrics:
            self.metrics.cancelled.inc()
            self.metrics.dropped.inc(dropped)
            if not running:  # no worker is busy with it: free at once (else `_serve` observes when its unit stops)
                self.metrics.cancel_release.observe(0.0)

    def queue_depth(self) -> int:
        with self.cond:
            return sum(len(s.pieces) for s in self.streams)

    def busy(self) -> bool:
        return bool(self._running)

    def retry_after(self, active: int, planning: Sequence[int] = ()) -> int:
        """Seconds until a slot likely frees: the smallest remaining work, shared fairly among `active`. `planning`: the
        input characters of requests still being cut into pieces (not yet streams), priced as that many tokens: with
        long inputs planning, Retry-After 1 sent clients back into the same 429s for seconds."""
        with self.cond:
            left = [sum(map(len, s.pieces)) for s in self.streams] + list(planning)
            seconds = self.mode.seconds_for(min(left, default=0)) * max(active, 1)
        return int(min(60, max(1, round(seconds))))

    # ---- the worker ---------------------------------------------------------------------------------

    def _budget(self, stream: Stream, now: float) -> int:
        """Tokens the next job may hold: what fits in the tightest streaming listener's buffered audio, and within the
        mode's bound for a listener (`job_seconds`: windowed, room for the others' next units)."""
        if stream.streaming and stream.jobs == 0:
            return FIRST_JOB_BUDGET  # just the first piece: the first audio is what users wait for
        largest = frames_bound(self.config.chunk_tokens, stream.speed)
        slack = [s.deadline() - now for s in self.streams if s.streaming and s.pieces]
        if not slack:
            return largest  # nobody is listening live: biggest jobs, best throughput
        seconds = min(SAFETY * min(slack), self.mode.job_seconds(stream, now) if stream.streaming else math.inf)
        return min(largest, self.cost.tokens_within(seconds, stream.speed))

    def _pick(self) -> tuple[Stream, Piece, bool] | None:
        """The stream to work for next and, unless it continues a windowed job, its next job."""
        runnable = [s for s in self.streams if (s.pieces or s.job) and s not in self._running]
        if not runnable:
            return None
        stream = min(runnable, key=Stream.urgency)
        if self.mode.defers(stream) and (listeners := [s for s in runnable if s.streaming]):
            stream = min(listeners, key=Stream.urgency)  # a whole answer waits while listeners' audio runs short
        stream.held_since = None  # its unit runs: the next is held afresh
        if stream.job is not None:
            return stream, stream.job[0], stream.job[1]
        piece, last = self.next_job(stream.pieces, self._budget(stream, time.monotonic()))
        stream.starting = True  # its front runs next: what the other worker prices it at (`WindowedJobs.next_unit_seconds`)
        return stream, piece, last

    def _serve(self) -> None:
        import onnxruntime as ort

        while True:
            with self.cond:
                job = None
                while not self._stopping and (job := self._pick()) is None:
                    self.cond.wait()
                if self._stopping or job is None:
                    return
                stream, piece, last = job
                stream.run_options = ort.RunOptions()
                self._running.add(stream)
                self.most_running = max(self.most_running, len(self._running))
            try:
                self.mode.step(stream, piece, last)
                self._let_first_audio_out(stream)  # still running: no other worker takes its next unit meanwhile
            except Exception as exc:
                if not stream.cancelled and not self._stopping:  # a job stopped fails by design (terminate flag)
                    log.exception("synthesis failed for request %d", stream.id)
                if not stream.cancelled:
                    self._finish(stream, exc)
            finally:
                with self.cond:
                    self._running.discard(stream)
                    stream.run_options = None
                    self.cond.notify_all()  # the stream's next unit may go to a waiting worker
                if stream.cancelled and self.metrics:
                    self.metrics.cancel_release.observe(time.monotonic() - stream.cancelled_at)

    def _let_first_audio_out(self, stream: Stream) -> None:
        """Once per stream, after the unit that made its first audio: wait until that audio is sent (FIRST_SEND_WAIT at
        most), unless another listener waits for its own (stream.py's `waits_for_first_send`)."""
        if stream.bytes_out and (sent := stream.first_sent) is not None:
            stream.first_sent = None
            with self.cond:
                wait = waits_for_first_send(stream, self.streams)
            sent.wait(FIRST_SEND_WAIT if wait else 0)

    # ---- one job: the worker's steps, which `first_audio` also runs on the caller's thread ------------

    def new_joiner(self) -> Joiner:
        """A request's joiner: trims each job's edge silence to a natural pause and crossfades the seams."""
        seam = 2 * SEAM_STEPS * STEP_SAMPLES  # jobs beside a cut with context each decode SEAM_STEPS past it
        return Joiner(self.sample_rate, self.config.crossfade_ms, self.config.trim_silence, seam)

    def next_job(self, pieces: deque[Piece], budget: int) -> tuple[Piece, bool]:
        """Pop a request's next job (its next piece, merged with more within `budget` tokens): (the job, last)."""
        job = take_job(pieces, budget, self.space_id)
        return job, not pieces

    def run_job(self, job: Piece, pack: np.ndarray, speed: float, run_options: Any = None) -> tuple[np.ndarray, float]:
        """Synthesize one job and account for it (cost model, metrics): (raw audio, compute seconds)."""
        started = time.perf_counter()
        audio = self.synthesize(job, pack, speed, run_options)
        compute = time.perf_counter() - started
        self._account(len(job), compute, len(audio) / self.sample_rate, speed)
        return audio, compute

    def join(
        self,
        joiner: Joiner,
        job: Piece,
        audio: np.ndarray,
        last: bool,
        speed: float,
        opens: bool = True,
        closes: bool = True,
    ) -> np.ndarray:
        """A job's audio (or one window of it: `opens` / `closes` the job) through its request's joiner, with
        the pause its final token calls for: what can be sent. A side where the job was fed context goes on
        from the job before it or into the job after it as one utterance does: untrimmed, overlapping it by the
        steps both were decoded past the cut, crossfaded (runtime/join.py)."""
        assert self.synth is not None
        pause = PAUSES[boundary(job.tokens, self.synth.symbols)] / speed
        return joiner.push(audio, last, pause, opens=opens, closes=closes, seams=(bool(job.behind), bool(job.ahead)))

    def first_audio(self, text: str, pack: np.ndarray, speed: float = 1.0) -> np.ndarray:
        """The audio a new streaming request for `text` sends first, made on the calling thread by the worker's
        own steps: planning, the first job (`FIRST_JOB_BUDGET`), synthesis, the joiner. Not queued, not for
        serving: it times first audio (kokoro-opt tune) on an engine whose worker thread is not started."""
        pieces = deque(self.plan(text))
        job, last = self.next_job(pieces, FIRST_JOB_BUDGET)
        return self.mode.first_audio(job, pack, speed, last)

    def synthesize(self, job: Piece, pack: np.ndarray, speed: float, run_options: Any) -> np.ndarray:
        """The audio of the job's own tokens, from one run over them and their context."""
        # Synthesizer.run_tokens, plus run options: a cancelled request's job stops within one graph node.
        synth = self.synth
        assert synth is not None
        if not isinstance(synth, Synthesizer):  # Core ML has no run options: a cancelled job finishes its chunk
            result = synth.run_tokens(job.feed, pack, speed)
        else:  # capped edges start the audio elsewhere: a job with context is cut at its own frames instead
            result = synth.run_tokens(job.feed, pack, speed, self.config.cap_edges and job.context == (0, 0), run_options)
        if job.context == (0, 0):
            return result.audio
        start, end = spoken_steps(result.durations, job.context, (0, len(result.audio) // STEP_SAMPLES))
        return result.audio[start * STEP_SAMPLES : end * STEP_SAMPLES]

    def _account(self, tokens: int, compute: float, audio_s: float, speed: float) -> None:
        with self.cond:
            self.cost.observe(tokens, speed, compute)
        if self.metrics:
            self.metrics.observe_job(compute, audio_s)

    def emit(self, stream: Stream, out: np.ndarray, last: bool) -> None:
        """Encode and send a unit's audio; the stream ends with its last."""
        data = stream.encoder.encode(out) + (stream.encoder.finish() if last else b"")
        with self.cond:  # another worker reads them to schedule (`deadline`, `_budget`)
            stream.jobs += 1
            if stream.first_out is None:
                stream.first_out = time.monotonic()
            stream.audio_out += len(out) / self.sample_rate
        if data:
            stream.bytes_out += len(data)
            stream.put(data)
        if last:
            self._finish(stream, None)

    def _finish(self, stream: Stream, error: BaseException | None) -> None:
        with self.cond:
            stream.finished = True
            stream.pieces.clear()
            if stream in self.streams:
                self.streams.remove(stream)
            # no longer counted as running once its listener can be told it ended: the next request may
            # be picked up by another worker before this one leaves its unit
            self._running.discard(stream)
        stream.put(error)
