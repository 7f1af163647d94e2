"""The synthesis engine: one loaded artifact, one worker thread, a fair queue of text pieces.

With 2 cores one ORT run using every intra-op thread beats two runs fighting over them, so a single
worker does all synthesis (and encoding) and the event loop only moves bytes. Requests share the
worker in this order: first chunks first (oldest request first), so every new listener hears audio
early; then *earliest playback deadline first*, where a stream's deadline is when its listener runs
out of audio (first byte time + seconds sent), so a stream about to underrun goes before one that is
ahead. Admission is bounded, so first chunks cannot starve running streams for long. Job size adapts
to the same deadlines (see `plan.py` and `_budget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.runtime import open_synthesizer
from kokoro_opt.select import Selection
from kokoro_opt.serve.encoders import Encoder
from kokoro_opt.serve.join import PAUSES, Joiner, boundary
from kokoro_opt.serve.metrics import Metrics
from kokoro_opt.serve.plan import CostModel, make_pieces, take_job
from kokoro_opt.synth import Speaker, Synthesizer, release_freed_memory
from kokoro_opt.text import CONTEXT_TOKENS
from kokoro_opt.voices import style_for
from kokoro_opt.windowed import WindowedDecoder, WindowedJob

log = logging.getLogger("kokoro_opt.serve")

SAFETY = 0.7  # a job may use this share of the tightest listener's buffered audio: estimates are rough
FIRST_JOB_BUDGET = 0  # a streaming request's first job: its first piece alone (see `_budget`)
_WARMUP_TEXT = "Warming up, so that the first listener never waits for a cold start."


@dataclass(frozen=True)
class ServeConfig:
    first_chunk_tokens: int = 40  # the first job: small, so first audio comes fast
    chunk_tokens: int = 200  # the largest later job (merged pieces), at most 510
    piece_tokens: int | None = None  # sentences are packed into pieces up to this; None = 2 x first_chunk_tokens
    crossfade_ms: float = 10.0
    trim_silence: bool = True  # cut Kokoro's ~0.9 s of silence at each seam to a natural pause (join.py)
    cap_edges: bool = False  # the decoder skips most of that silence (an artifact with the edges stage)
    windowed: bool = False  # front once per job, generator in windows (an artifact with the windows stage)
    max_queue: int = 4  # admitted requests (chunking, waiting or streaming); more get 429
    request_timeout: float = 300.0
    max_input_chars: int = 4096  # OpenAI's limit
    max_body_bytes: int = 64 * 1024
    api_key: str | None = None
    default_voice: str | None = None  # None: the OpenAI default 'alloy', mapped
    warmup: bool = True

    def __post_init__(self) -> None:
        for name in ("first_chunk_tokens", "chunk_tokens", "max_queue", "max_input_chars", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1", "use a positive number")
        if not self.first_chunk_tokens <= self.chunk_tokens <= CONTEXT_TOKENS:
            raise UserError(
                f"chunk sizes {self.first_chunk_tokens}/{self.chunk_tokens} are out of order",
                f"use first_chunk_tokens <= chunk_tokens <= {CONTEXT_TOKENS}",
            )
        if self.crossfade_ms < 0 or self.request_timeout <= 0:
            raise UserError("crossfade_ms must be >= 0 and request_timeout > 0")

    @property
    def pieces(self) -> int:
        return min(self.piece_tokens or 2 * self.first_chunk_tokens, self.chunk_tokens)

    @classmethod
    def for_selection(cls, selection: Selection, **overrides: Any) -> ServeConfig:
        """Tuned chunking from the selection, then explicit (non-None) overrides on top."""
        known = set(cls.__dataclass_fields__)
        tuned = {k: v for k, v in selection.chunking.items() if k in known}
        config = cls(**{**tuned, **{k: v for k, v in overrides.items() if v is not None}})
        if config.cap_edges and not selection.artifact.kokoro.get("edges"):
            raise UserError(edges_missing(selection.artifact.name), "serve an artifact built with it, or drop --cap-edges")
        if config.windowed and not selection.artifact.kokoro.get("windows"):
            raise UserError(windows_missing(selection.artifact.name), "serve an artifact built with it, or drop --windowed")
        if config.windowed and config.cap_edges:  # windows decode only the speech already, with its real context
            raise UserError("--windowed and --cap-edges both skip the edge silence", "use one of them (--windowed)")
        return config


def edges_missing(artifact: str | None) -> str:
    return f"cap_edges needs an ONNX artifact built with the edges stage; {artifact or 'this artifact'} has none"


def windows_missing(artifact: str | None) -> str:
    return f"windowed needs an ONNX artifact built with the windows stage; {artifact or 'this artifact'} has none"


class Stream:
    """One request in the engine. The worker thread owns the synthesis state; the loop reads `queue`."""

    _ids = itertools.count(1)

    def __init__(
        self, pieces: list[list[int]], pack: np.ndarray, speed: float, encoder: Encoder, streaming: bool, joiner: Joiner
    ) -> None:
        self.id = next(self._ids)
        self.pieces: deque[list[int]] = deque(pieces)
        self.pack, self.speed, self.encoder, self.streaming, self.joiner = pack, speed, encoder, streaming, joiner
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_out: float | None = None
        self.audio_out = 0.0  # seconds of audio handed out
        self.jobs = 0
        self.cancelled = False
        self.finished = False
        self.run_options: Any = None
        self.job: tuple[list[int], bool, WindowedJob] | None = None  # a windowed job with windows still to decode

    def deadline(self) -> float:
        return self.arrival if self.first_out is None else self.first_out + self.audio_out

    def put(self, item: bytes | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Engine:
    def __init__(self, selection: Selection, config: ServeConfig | None = None, metrics: Metrics | None = None) -> None:
        self.selection = selection
        self.config = config or ServeConfig.for_selection(selection)
        self.metrics = metrics
        self.synth: Speaker | None = None  # a Synthesizer (ONNX Runtime) or, on macOS, a CoreMLSynthesizer
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.cost = CostModel()  # calibrated at warm-up, then follows the machine's load
        self._cond = threading.Condition()
        self._streams: list[Stream] = []
        self._running: Stream | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._space: int | None = None
        self.windows: WindowedDecoder | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Load, warm up and serve on the worker thread; `ready` is set once warm."""
        self._thread = threading.Thread(target=self._main, name="kokoro-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            if self._running is not None and self._running.run_options is not None:
                self._running.run_options.terminate = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as exc:
            self.error = exc
            log.exception("loading the artifact failed")
            return
        self.ready.set()
        self._serve()

    def _load(self) -> None:
        sel = self.selection
        log.info("serving artifact %s (%s) at %s: %s", sel.artifact.id, sel.artifact.name, sel.artifact.path, sel.reason)
        started = time.perf_counter()
        self.attach(open_synthesizer(sel.artifact, sel.settings))
        log.info("loaded in %.1f s (session settings: %s)", time.perf_counter() - started, sel.settings)
        if self.config.warmup:
            self._warm_up()

    def attach(self, synth: Speaker) -> None:
        """Synthesize with this loaded model (`start` loads the selection's; kokoro-opt tune passes its cached ones)."""
        if self.config.cap_edges and not (isinstance(synth, Synthesizer) and synth.edges):
            raise UserError(edges_missing(getattr(synth, "artifact", None) and synth.artifact.name), "drop cap_edges")
        if self.config.windowed:
            if not isinstance(synth, Synthesizer):
                raise UserError(windows_missing(getattr(synth, "artifact", None) and synth.artifact.name), "drop windowed")
            WindowedDecoder.check(synth.artifact)
            synth.session = None  # windowed jobs never run the whole graph: free its weights before the split's
            release_freed_memory()
            self.windows = WindowedDecoder.of_artifact(synth)
        self.synth = synth
        self._space = synth.vocab.get(" ")

    def _warm_up(self) -> None:
        """Load espeak, run both job sizes (the first run of a session is slow), fit the cost model."""
        synth = self.synth
        assert synth is not None
        started = time.perf_counter()
        pieces = self.plan(_WARMUP_TEXT)
        pack = synth.packs[synth.voices[0]]
        flat = [t for p in pieces for t in p] or [self._space or 1]
        timings: dict[int, float] = {}
        for size in (self.config.first_chunk_tokens, self.config.first_chunk_tokens, self.config.chunk_tokens):
            tokens = (flat * (size // len(flat) + 1))[:size]
            t0 = time.perf_counter()
            self._synthesize(tokens, pack, 1.0, None)
            timings[size] = time.perf_counter() - t0  # the repeated small size keeps its second, warm timing
        small, large = self.config.first_chunk_tokens, self.config.chunk_tokens
        self.cost.calibrate((small, timings[small]), (large, timings[large]))
        log.info(
            "warmed up in %.1f s; a job costs %.0f ms + %.1f ms per token",
            time.perf_counter() - started,
            1000 * self.cost.fixed,
            1000 * self.cost.per_token,
        )

    # ---- requests (called from the event loop) ------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.synth.sample_rate if self.synth else 24_000

    def plan(self, text: str) -> list[list[int]]:
        """Text -> token pieces; CPU work (espeak): call it off the event loop."""
        assert self.synth is not None
        return make_pieces(text, self.synth.vocab, self.config.first_chunk_tokens, self.config.pieces)

    def submit(self, pieces: list[list[int]], pack: np.ndarray, speed: float, encoder: Encoder, streaming: bool) -> Stream:
        stream = Stream(pieces, pack, speed, encoder, streaming, self.new_joiner())
        with self._cond:
            self._streams.append(stream)
            self._cond.notify()
        return stream

    def cancel(self, stream: Stream) -> None:
        """Drop the stream's queued pieces and abort its running job (ORT's terminate flag)."""
        with self._cond:
            if stream.finished or stream.cancelled:
                return
            stream.cancelled = True
            dropped = len(stream.pieces)
            stream.pieces.clear()
            stream.job = None
            if stream in self._streams:
                self._streams.remove(stream)
            if self._running is stream and stream.run_options is not None:
                stream.run_options.terminate = True
        if self.metrics:
            self.metrics.cancelled.inc()
            self.metrics.dropped.inc(dropped)

    def queue_depth(self) -> int:
        with self._cond:
            return sum(len(s.pieces) for s in self._streams)

    def busy(self) -> bool:
        return self._running is not None

    def retry_after(self, active: int) -> int:
        """Seconds until a slot likely frees: the smallest remaining work, shared fairly among `active`."""
        with self._cond:
            left = [sum(map(len, s.pieces)) for s in self._streams]
        seconds = self.cost.predict(min(left, default=0)) * max(active, 1)
        return int(min(60, max(1, round(seconds))))

    # ---- the worker ---------------------------------------------------------------------------------

    def _budget(self, stream: Stream, now: float) -> int:
        """Tokens the next job may hold: what fits in the tightest streaming listener's buffered audio."""
        if stream.streaming and stream.jobs == 0:
            return FIRST_JOB_BUDGET  # just the first piece: the first audio is what users wait for
        slack = [s.deadline() - now for s in self._streams if s.streaming and s.pieces]
        if not slack:
            return self.config.chunk_tokens  # nobody is listening live: biggest jobs, best throughput
        return min(self.config.chunk_tokens, self.cost.tokens_within(SAFETY * min(slack), stream.speed))

    def _pick(self) -> tuple[Stream, list[int], bool] | None:
        """The stream to work for next and, unless it continues a windowed job, its next job."""
        runnable = [s for s in self._streams if s.pieces or s.job]
        if not runnable:
            return None
        stream = min(runnable, key=lambda s: (not (s.streaming and s.jobs == 0), s.deadline(), s.id))
        if stream.job is not None:
            return stream, stream.job[0], stream.job[1]
        tokens, last = self.next_job(stream.pieces, self._budget(stream, time.monotonic()))
        return stream, tokens, last

    def _serve(self) -> None:
        import onnxruntime as ort

        while True:
            with self._cond:
                job = None
                while not self._stopping and (job := self._pick()) is None:
                    self._cond.wait()
                if self._stopping or job is None:
                    return
                stream, tokens, last = job
                stream.run_options = ort.RunOptions()
                self._running = stream
            try:
                if self.windows is not None:
                    self._window_step(stream, tokens, last)
                else:
                    audio, compute = self.run_job(tokens, stream.pack, stream.speed, stream.run_options)
                    log.debug("request %d: job of %d tokens in %.2f s (last=%s)", stream.id, len(tokens), compute, last)
                    if not stream.cancelled:
                        self._emit(stream, self.join(stream.joiner, tokens, audio, last, stream.speed), last)
            except Exception as exc:
                if not stream.cancelled:  # a cancelled job fails by design (terminate flag)
                    log.exception("synthesis failed for request %d", stream.id)
                    self._finish(stream, exc)
            finally:
                with self._cond:
                    self._running = None
                    stream.run_options = None

    def _window_step(self, stream: Stream, tokens: list[int], last: bool) -> None:
        """One unit of windowed work: a job's front and first window, or its next window. Each window is
        sent as soon as it is decoded, and other streams may be served between two windows of a job."""
        assert self.windows is not None
        if stream.job is None:
            stream.job = (tokens, last, self.windows.start(tokens, stream.pack, stream.speed, stream.run_options))
        job = stream.job[2]
        audio = self.windows.next_window(job, stream.run_options)
        closes = job.done
        if closes:
            stream.job = None
            self._account(tokens, job.compute, job.samples / self.sample_rate, stream.speed)
        if not stream.cancelled:
            out = self.join(stream.joiner, tokens, audio, last and closes, stream.speed, opens=job.opened, closes=closes)
            job.opened = False
            self._emit(stream, out, last and closes)

    # ---- one job: the worker's steps, which `first_audio` also runs on the caller's thread ------------

    def new_joiner(self) -> Joiner:
        """A request's joiner: trims each job's edge silence to a natural pause and crossfades the seams."""
        return Joiner(self.sample_rate, self.config.crossfade_ms, self.config.trim_silence)

    def next_job(self, pieces: deque[list[int]], budget: int) -> tuple[list[int], bool]:
        """Pop a request's next job (its next piece, merged with more within `budget` tokens): (tokens, last)."""
        tokens = take_job(pieces, budget, self._space)
        return tokens, not pieces

    def run_job(self, tokens: list[int], pack: np.ndarray, speed: float, run_options: Any = None) -> tuple[np.ndarray, float]:
        """Synthesize one job and account for it (cost model, metrics): (raw audio, compute seconds)."""
        started = time.perf_counter()
        audio = self._synthesize(tokens, pack, speed, run_options)
        compute = time.perf_counter() - started
        self._account(tokens, compute, len(audio) / self.sample_rate, speed)
        return audio, compute

    def join(self, joiner: Joiner, tokens: list[int], audio: np.ndarray, last: bool, speed: float,
             opens: bool = True, closes: bool = True) -> np.ndarray:
        """A job's audio (or one window of it: `opens` / `closes` the job) through its request's joiner, with
        the pause its final token calls for: what can be sent."""
        assert self.synth is not None
        return joiner.push(audio, last, PAUSES[boundary(tokens, self.synth.symbols)] / speed, opens=opens, closes=closes)

    def first_audio(self, text: str, pack: np.ndarray, speed: float = 1.0) -> np.ndarray:
        """The audio a new streaming request for `text` sends first, made on the calling thread by the worker's
        own steps: planning, the first job (`FIRST_JOB_BUDGET`), synthesis, the joiner. Not queued, not for
        serving: it times first audio (kokoro-opt tune) on an engine whose worker thread is not started."""
        pieces = deque(self.plan(text))
        tokens, last = self.next_job(pieces, FIRST_JOB_BUDGET)
        if self.windows is not None:
            job = self.windows.start(tokens, pack, speed)
            audio = self.windows.next_window(job)
            return self.join(self.new_joiner(), tokens, audio, last and job.done, speed, closes=job.done)
        audio, _ = self.run_job(tokens, pack, speed)
        return self.join(self.new_joiner(), tokens, audio, last, speed)

    def _synthesize(self, tokens: list[int], pack: np.ndarray, speed: float, run_options: Any) -> np.ndarray:
        # Synthesizer.run_tokens, plus run options: a cancelled request's job stops within one graph node.
        synth = self.synth
        assert synth is not None
        if not isinstance(synth, Synthesizer):  # Core ML has no run options: a cancelled job finishes its chunk
            return synth.run_tokens(tokens, pack, speed).audio
        if self.windows is not None:  # warm-up: the windowed path, whole
            return self.windows.speak(tokens, pack, speed)[0]
        feeds = synth.feeds(tokens, style_for(pack, len(tokens)), speed, self.config.cap_edges)
        audio = synth.session.run(None, feeds, run_options)[0]
        return np.asarray(audio, dtype=np.float32).reshape(-1) / synth.audio_gain

    def _account(self, tokens: list[int], compute: float, audio_s: float, speed: float) -> None:
        self.cost.observe(len(tokens), speed, compute)
        if self.metrics:
            self.metrics.observe_job(compute, audio_s)

    def _emit(self, stream: Stream, out: np.ndarray, last: bool) -> None:
        data = stream.encoder.encode(out) + (stream.encoder.finish() if last else b"")
        stream.jobs += 1
        if stream.first_out is None:
            stream.first_out = time.monotonic()
        stream.audio_out += len(out) / self.sample_rate
        if data:
            stream.put(data)
        if last:
            self._finish(stream, None)

    def _finish(self, stream: Stream, error: BaseException | None) -> None:
        with self._cond:
            stream.finished = True
            stream.pieces.clear()
            if stream in self._streams:
                self._streams.remove(stream)
        stream.put(error)
