"""Windowed decoding at run time: the front once per sentence, the generator window by window.

The `windows` stage (kokoro_opt/passes/windows.py) cut the graphs and wrote them into the artifact
(`windows/`): `front` (text to the generator's per-step inputs), `job` (the generator's per-job part:
what depends on the style and statistics alone), `generator` (one window's audio) and `whole_generator`
(the generator with its own norms, as whole decoding runs it). It also stored what the generator
normalizes with (kokoro_opt/runtime/stats_predictor.py) and gated the result against whole-sentence
decoding. Nothing is cut when an artifact loads: the sessions read those files.

A window normalizes with predicted statistics, a percent or so off the utterance's own, and short
utterances hear it most. So a job of at most `finish_steps` steps sends its first window and then
*finishes*: one run of the whole generator over the utterance gives the rest exactly as whole decoding
does, while the listener hears the first window (docs/serving.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.runtime.feeds import model_feeds
from kokoro_opt.runtime.norm_stats import STATISTICS_HINT, STATS_FILE, StatsTable
from kokoro_opt.runtime.session import make_session
from kokoro_opt.runtime.stats_predictor import PREDICTOR_FILE, StatsPredictor
from kokoro_opt.runtime.steps import STEP_SAMPLES, speech_steps, spoken_steps, window_end
from kokoro_opt.voices import style_for

# The graphs' interface: the front's outputs (the generator's per-step inputs, then the durations), the
# statistics input, and where the windows stage puts the graphs in an artifact.
FRONT_OUTPUTS = ("features", "f0", "phase", "decoder_style", "durations")
STATS_INPUT = "norm_stats"
WINDOWS_DIR = "windows"
FRONT_GRAPH, JOB_GRAPH, GENERATOR_GRAPH, WHOLE_GENERATOR_GRAPH = "front", "job", "generator", "whole_generator"


@dataclass(frozen=True)
class WindowSettings:
    """How a job is cut into windows (generator steps of 12.5 ms), stored by the `windows` stage."""

    first_steps: int = 12
    steps: int = 80
    overlap_steps: int = 4
    # Context before a job's first window when the job starts its utterance: only the leading pad is there, which
    # nobody hears, so fewer steps than `overlap_steps` score the same and make the first sound sooner
    # (docs/measurements/2026-12-07-first-sound.md)
    lead_overlap_steps: int = 2
    lead_frames: int = 2
    trail_frames: int = 6
    finish_steps: int = 320  # jobs of at most this many steps finish with the whole generator (0: never)
    # Context each side of a window between a first window and its finish (serve/modes.py): with 4 steps
    # that seam cost phrases 0.1 PESQ-WB, with 8 nothing measurable (docs/measurements/2026-12-05-front-shapes.md)
    bridge_overlap_steps: int = 8

    @property
    def bridge_extra_steps(self) -> int:
        """Steps a bridge decodes beyond a window of the same size with the usual context."""
        return 2 * (self.bridge_overlap_steps - self.overlap_steps)

    @classmethod
    def of(cls, meta: dict[str, Any]) -> WindowSettings:
        """The settings an artifact's kokoro.json stores (checked when it is read: artifacts.checked_kokoro)."""
        known = set(cls.__dataclass_fields__)
        values = {k: int(v) for k, v in meta.items() if k in known}
        # an artifact built before `lead_overlap_steps` was gated with the usual overlap there: it keeps it
        values.setdefault("lead_overlap_steps", values.get("overlap_steps", cls.overlap_steps))
        return cls(**values)


@dataclass
class FrontOutput:
    """One utterance's front: the generator's inputs for every step, and the durations."""

    features: np.ndarray
    f0: np.ndarray
    phase: np.ndarray
    decoder_style: np.ndarray
    durations: np.ndarray

    @property
    def steps(self) -> int:
        return int(self.features.shape[2])

    def generator_feeds(self) -> dict[str, np.ndarray]:
        """The whole generator's feeds (whole_generator, the fused generator): the front's first four outputs."""
        return dict(zip(FRONT_OUTPUTS[:4], (self.features, self.f0, self.phase, self.decoder_style), strict=True))

    def phase_from(self, lo: int, hi: int) -> np.ndarray:
        """Steps [lo, hi) of the running phase, less whole turns per harmonic: the sines are the same, and
        the window interpolates small numbers instead of ones that grow with the utterance (1e5 rad by 10 s)."""
        span = self.phase[:, :, lo:hi].astype(np.float64)
        turns = np.floor(span[:, :, :1] / (2 * np.pi)) * (2 * np.pi)
        return np.ascontiguousarray(span - turns, dtype=np.float32)


@dataclass
class WindowedJob:
    """A job in progress: its front ran, steps [cursor, speech end) are still to decode."""

    front: FrontOutput
    stats: np.ndarray | None  # None: left out by `start(windows=False)`, the job only finishes
    speech: tuple[int, int]  # the steps decoded: the speech between the edge silences
    cursor: int = 0  # the next step to decode
    windows: int = 0  # windows decoded so far
    front_seconds: float = 0.0  # the front and the generator's per-job part: what cannot be interleaved
    compute: float = 0.0  # seconds spent so far (front and windows)
    samples: int = 0  # audio decoded so far
    opened: bool = True  # no window sent yet: the next one opens the job (the joiner trims its lead-in)
    constants: dict[str, np.ndarray] | None = None  # the generator's per-job tensors (hoisting.py)
    finish: bool = False  # short enough to finish with one whole-generator run (`WindowedDecoder.finish`)
    whole: np.ndarray | None = None  # the whole generator's audio, once the job finished with it
    bridged: bool = False  # its second window was a bridge to its finish (serve/modes.py)
    starts_utterance: bool = False  # its speech begins after the leading pad, not at a cut inside a sentence (`start`)
    extra_steps: int = 0  # context its last window decoded beyond the usual overlap: a bridge's more, a lean first window's less

    @property
    def done(self) -> bool:
        return self.cursor >= self.speech[1]

    @property
    def steps_left(self) -> int:
        return self.speech[1] - self.cursor

    @property
    def decoded_share(self) -> float:
        """The share of its speech steps decoded so far."""
        start, end = self.speech
        return (self.cursor - start) / max(end - start, 1)


@dataclass
class WindowGraphs:
    """The graphs windowed decoding runs, as files (an artifact's `windows/`, ONNX or ORT format) or
    serialized models (made in memory by the windows stage). `job` is None when the generator's per-job part
    could not be cut out: every window then computes it (slower, the same audio). `whole_generator` is None
    in artifacts built before jobs finished whole: their jobs are windows to the end."""

    front: Path | bytes
    generator: Path | bytes
    job: Path | bytes | None = None
    whole_generator: Path | bytes | None = None

    @classmethod
    def of_folder(cls, folder: Path) -> WindowGraphs:
        def find(name: str) -> Path | None:
            return next((p for p in (folder / f"{name}.ort", folder / f"{name}.onnx") if p.is_file()), None)

        front, generator = find(FRONT_GRAPH), find(GENERATOR_GRAPH)
        if front is None or generator is None:
            raise UserError(f"{folder} holds no windowed graphs", "rebuild the artifact with the windows stage")
        return cls(front, generator, find(JOB_GRAPH), find(WHOLE_GENERATOR_GRAPH))

    def save(self, folder: Path) -> list[str]:
        """Write the serialized graphs into `folder` as ONNX files; the names written."""
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name in (FRONT_GRAPH, JOB_GRAPH, GENERATOR_GRAPH, WHOLE_GENERATOR_GRAPH):
            graph = getattr(self, name)
            if graph is None:
                continue
            target = folder / f"{name}.onnx"
            if isinstance(graph, bytes):
                target.write_bytes(graph)
            else:
                target.write_bytes(Path(graph).read_bytes())
            written.append(target.name)
        return written


class Statistics(Protocol):
    """Where a job's norm_stats come from: a StatsPredictor (the windows stage's), or an older artifact's table."""

    @property
    def channels(self) -> int: ...

    def for_job(self, front: FrontOutput, pack: np.ndarray, packs: dict[str, np.ndarray]) -> np.ndarray: ...


def load_statistics(folder: Path) -> Statistics:
    """The statistics an artifact's `windows/` holds: the predictor, or the table of an artifact built before it."""
    if (folder / PREDICTOR_FILE).is_file():
        return StatsPredictor.load(folder / PREDICTOR_FILE)
    return StatsTable.load(folder / STATS_FILE)


class WindowedDecoder:
    """`start` runs a job's front and the generator's per-job part, `next_window` decodes one window, over the
    sessions of an artifact's windowed graphs (`WindowGraphs`). Statistics come from the artifact (`windows`
    stage)."""

    def __init__(
        self,
        synth: Any,
        graphs: WindowGraphs,
        statistics: Statistics | None = None,
        settings: WindowSettings | None = None,
        runs_at_once: int = 1,
        fused: Path | None = None,
    ) -> None:
        """`fused`: an artifact's fused/ folder; whole-generator runs (finishes) then go through it (runtime/fused.py)."""
        spinning = "in_run" if runs_at_once == 1 else "never"  # runs_at_once: threads running windows at once
        # never profiled: nothing ends them, and a profiled session writes a trace to the temporary folder when freed
        unprofiled = replace(synth.settings, enable_profiling=False)

        def session(graph: Path | bytes) -> Any:  # sessions that take turns share one arena
            return make_session(graph, unprofiled, spinning=spinning, shared_arena=True)

        self.synth = synth
        self.graphs = graphs
        self.statistics = statistics
        self.settings = settings or WindowSettings()
        self.front_session = session(graphs.front)
        self.constants_session = session(graphs.job) if graphs.job is not None else None
        self.constant_names: tuple[str, ...] = (
            tuple(o.name for o in self.constants_session.get_outputs()) if self.constants_session is not None else ()
        )
        self.generator_session = session(graphs.generator)
        self.fused = None
        if fused is not None:
            from kokoro_opt.runtime.fused import FusedGenerator

            speaker = getattr(synth, "loaded_fused", None)  # whole decoding's, when the synthesizer made one
            one_at_a_time = speaker is not None and runs_at_once == 1
            self.fused = speaker.generator if one_at_a_time else FusedGenerator(fused, unprofiled, spinning=spinning)
        whole = graphs.whole_generator if self.fused is None else None
        self.whole_session = session(whole) if whole is not None else None
        self._window_inputs = {i.name for i in self.generator_session.get_inputs()}
        self._front_inputs = [i.name for i in self.front_session.get_inputs()]
        if statistics is not None:
            self._check_channels(statistics)

    def _check_channels(self, statistics: Statistics) -> None:
        """Statistics for another generator's norms would fail in every request: refuse them when loading."""
        reader = self.constants_session or self.generator_session
        [wanted] = [i.shape[1] for i in reader.get_inputs() if i.name == STATS_INPUT]
        if statistics.channels != wanted:
            raise UserError(
                f"the windows stage's statistics cover {statistics.channels} norm channels; its graphs read {wanted}",
                STATISTICS_HINT,
            )

    @property
    def decodes_whole(self) -> bool:
        """Whether a job can finish with one whole-generator run (`whole_audio`): through the fused generator or
        the whole_generator graph."""
        return self.fused is not None or self.whole_session is not None

    @staticmethod
    def check(artifact: Any) -> None:
        """Refuse an artifact without the `windows` stage's graphs and statistics, naming the fix."""
        if not artifact.capabilities.windowed:
            raise UserError(
                f"{artifact.name} has no windows stage (no {WINDOWS_DIR}/{PREDICTOR_FILE})",
                "serve an artifact whose recipe ends with `- kind: windows`, or drop --windowed",
            )

    @classmethod
    def of_artifact(cls, synth: Any, runs_at_once: int = 1) -> WindowedDecoder:
        """The decoder over the graphs, statistics and settings the artifact's `windows` stage stored;
        `runs_at_once`: how many threads run its sessions at the same time (the server's workers)."""
        cls.check(synth.artifact)
        folder = synth.artifact.path / WINDOWS_DIR
        settings = WindowSettings.of(synth.artifact.kokoro["windows"])
        return cls(synth, WindowGraphs.of_folder(folder), load_statistics(folder), settings, runs_at_once, synth.fused_folder)

    def front(self, token_ids: list[int], style: np.ndarray, speed: float = 1.0, run_options: Any = None) -> FrontOutput:
        feeds = model_feeds(token_ids, style, speed, names=self._front_inputs)
        outputs = [np.asarray(x) for x in self.front_session.run(list(FRONT_OUTPUTS), feeds, run_options)]
        return FrontOutput(*outputs[:4], outputs[4].reshape(-1))

    def job_constants(self, front: FrontOutput, stats: np.ndarray, run_options: Any = None) -> dict[str, np.ndarray]:
        """The generator's per-job tensors (kokoro_opt/passes/hoisting.py); empty when not hoisting."""
        if self.constants_session is None:
            return {}
        feeds = {FRONT_OUTPUTS[3]: front.decoder_style, STATS_INPUT: stats}
        return dict(zip(self.constant_names, self.constants_session.run(None, feeds, run_options), strict=True))

    def window(
        self,
        front: FrontOutput,
        start: int,
        end: int,
        stats: np.ndarray,
        run_options: Any = None,
        constants: dict[str, np.ndarray] | None = None,
        overlap: int | None = None,
        before: int | None = None,
    ) -> np.ndarray:
        """Audio of steps [start, end), decoded with `overlap` (by default the settings') steps of context each
        side, or `before` steps of it before `start`; `constants` are the job's (`job_constants`), computed here
        when not given."""
        overlap = self.settings.overlap_steps if overlap is None else overlap
        lo, hi = _decoded_span(start, end, overlap if before is None else before, overlap, front.steps)
        feeds = {
            FRONT_OUTPUTS[0]: np.ascontiguousarray(front.features[:, :, lo:hi]),
            FRONT_OUTPUTS[1]: np.ascontiguousarray(front.f0[:, :, lo:hi]),
            FRONT_OUTPUTS[2]: front.phase_from(lo, hi),
            FRONT_OUTPUTS[3]: front.decoder_style,
            STATS_INPUT: stats,
            **(constants if constants is not None else self.job_constants(front, stats, run_options)),
        }
        feeds = {name: value for name, value in feeds.items() if name in self._window_inputs}
        audio = np.asarray(self.generator_session.run(None, feeds, run_options)[0], dtype=np.float32).reshape(-1)
        return audio[(start - lo) * STEP_SAMPLES : (end - lo) * STEP_SAMPLES] / self.synth.audio_gain

    def start(
        self,
        token_ids: list[int],
        pack: np.ndarray,
        speed: float = 1.0,
        run_options: Any = None,
        windows: bool = True,
        context: tuple[int, int] = (0, 0),
    ) -> WindowedJob:
        """Run a job's front and the generator's per-job part. `windows=False`: nobody hears the job before it
        ends, so one that can finish is only finished, and its per-job part (statistics and tables, ~5 ms) is
        left out. `context`: of `token_ids`, how many before and after are context, read but not spoken
        (serve/plan.Piece): the job's speech is then the other tokens' frames and steps.SEAM_STEPS past each cut
        (`spoken_steps`)."""
        if self.statistics is None:
            raise UserError("this windowed decoder has no statistics", "load it with WindowedDecoder.of_artifact")
        began = time.perf_counter()
        front = self.front(token_ids, style_for(pack, len(token_ids)), speed, run_options)
        s = self.settings
        speech = speech_steps(front.durations, token_ids, self.synth.symbols, s.lead_frames, s.trail_frames)
        start, end = spoken_steps(front.durations, context, speech)
        job = WindowedJob(front, None, (start, end), cursor=start, starts_utterance=context[0] == 0)
        job.finish = self.decodes_whole and front.steps <= s.finish_steps
        if windows or not job.finish:
            job.stats = self.statistics.for_job(front, pack, self.synth.packs)
            job.constants = self.job_constants(front, job.stats, run_options)
        job.front_seconds = job.compute = time.perf_counter() - began
        return job

    def next_window(
        self, job: WindowedJob, steps: int | None = None, run_options: Any = None, overlap: int | None = None
    ) -> np.ndarray:
        """Decode the job's next window: `steps` long, or by default the settings' first / later window size;
        `overlap`: steps of context each side, by default the settings' (before the first window of a job that
        starts its utterance, `lead_overlap_steps`)."""
        if job.stats is None:
            raise UserError("this job was started without windows", "finish it, or start it with windows=True")
        began = time.perf_counter()
        s = self.settings
        size = steps if steps is not None else (s.first_steps if job.windows == 0 else s.steps)
        a = job.cursor
        b = window_end(a, job.speech[1], size, s.steps // 4)
        after = s.overlap_steps if overlap is None else overlap
        before = s.lead_overlap_steps if job.windows == 0 and job.starts_utterance and overlap is None else after
        audio = self.window(job.front, a, b, job.stats, run_options, job.constants, after, before)
        lo, hi = _decoded_span(a, b, before, after, job.front.steps)
        usual_lo, usual_hi = _decoded_span(a, b, s.overlap_steps, s.overlap_steps, job.front.steps)
        job.extra_steps = (hi - lo) - (usual_hi - usual_lo)  # what the server's window cost model counts it as
        return _advance(job, b, began, audio)

    def whole_audio(self, front: FrontOutput, run_options: Any = None) -> np.ndarray:
        """The utterance's audio from one run of the whole generator on `front`, normalized with its own
        statistics: the model's audio, bit for bit, in an artifact whose graphs carry its shapes; or the fused
        generator's, the same within float noise (passes/fuse.py)."""
        feeds = front.generator_feeds()
        if self.fused is not None:
            audio = self.fused.run(feeds, run_options)
        elif self.whole_session is not None:
            audio = self.whole_session.run(None, feeds, run_options)[0]
        else:
            raise UserError("this artifact has no whole_generator graph", "rebuild it, or decode the job in windows")
        return np.asarray(audio, dtype=np.float32).reshape(-1) / self.synth.audio_gain

    def finish(self, job: WindowedJob, run_options: Any = None) -> np.ndarray:
        """The rest of a job, steps [cursor, speech end), from `whole_audio`."""
        began = time.perf_counter()
        a, b = job.cursor, job.speech[1]
        job.whole = self.whole_audio(job.front, run_options)
        return _advance(job, b, began, job.whole[a * STEP_SAMPLES : b * STEP_SAMPLES])

    def speak(self, token_ids: list[int], pack: np.ndarray, speed: float = 1.0) -> tuple[np.ndarray, WindowedJob]:
        """The whole speech span of one utterance as a lone listener hears it, joined: the first window, then
        the finish or the other windows."""
        job = self.start(token_ids, pack, speed)
        parts = [self.next_window(job)]
        while not job.done:
            parts.append(self.finish(job) if job.finish else self.next_window(job))
        return np.concatenate(parts), job


def _decoded_span(start: int, end: int, before: int, after: int, steps: int) -> tuple[int, int]:
    """The steps a window of [start, end) decodes with its context, within the job's `steps`."""
    return max(start - before, 0), min(end + after, steps)


def _advance(job: WindowedJob, end: int, began: float, audio: np.ndarray) -> np.ndarray:
    """Account `audio`, steps [cursor, end) decoded since `began`, to `job` (a window or its finish)."""
    job.cursor, job.windows = end, job.windows + 1
    job.compute += time.perf_counter() - began
    job.samples += len(audio)
    return audio
