"""Windowed decoding at run time: the front once per sentence, the generator window by window.

The graphs come from kokoro_opt/decoder_windows.py; the statistics the generator normalizes with come
from the `windows` stage (passes/windows.py), which measured them on calibration utterances and gated
the result against whole-sentence decoding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kokoro_opt.decoder_windows import FRONT_OUTPUTS, STATS_INPUT, STEP_SAMPLES, moments_model, split
from kokoro_opt.edge_capping import final_silence_tokens
from kokoro_opt.errors import UserError
from kokoro_opt.feeds import model_feeds
from kokoro_opt.hoisting import hoist
from kokoro_opt.voices import style_for

log = logging.getLogger(__name__)

STEPS_PER_FRAME = 2  # the decoder's last frame-rate block upsamples by 2 before the generator


def stats_from_moments(mean: np.ndarray, var: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """norm_stats (2, C): the mean and 1/sqrt(var + eps)."""
    return np.stack([mean, 1.0 / np.sqrt(np.maximum(var, 0.0) + eps)]).astype(np.float32)


def pooled(moments: list[tuple[float, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(mean, var) of utterances pooled, from (weight, mean, var) each: weight by frames, as one long input."""
    total = sum(w for w, _, _ in moments)
    mean = sum(w * m.astype(np.float64) for w, m, _ in moments) / total
    second = sum(w * (v.astype(np.float64) + m.astype(np.float64) ** 2) for w, m, v in moments) / total
    return mean, second - mean * mean


def window_end(start: int, end: int, size: int, sliver: int) -> int:
    """Where a window of about `size` steps from `start` stops: a rest shorter than `sliver` steps is folded in."""
    stop = min(start + max(size, 1), end)
    return end if end - stop < sliver else stop


def window_spans(start: int, end: int, first: int, size: int) -> list[tuple[int, int]]:
    """[a, b) spans covering steps [start, end): a short first window for the first sound, then `size`-step
    ones; a last window shorter than a quarter of `size` is folded into the one before."""
    spans: list[tuple[int, int]] = []
    while start < end:
        stop = window_end(start, end, first if not spans else size, size // 4)
        spans.append((start, stop))
        start = stop
    return spans


def speech_steps(
    durations: np.ndarray, token_ids: list[int], symbols: dict[int, str], lead_frames: int, trail_frames: int
) -> tuple[int, int]:
    """Generator steps [start, end) worth decoding: from `lead_frames` before the leading pad ends to
    `trail_frames` into the final pause (the rest is silence the server trims anyway)."""
    total = int(np.sum(durations))
    speech_end = total - int(np.sum(durations[-final_silence_tokens(token_ids, symbols) :]))
    start = max(int(durations[0]) - lead_frames, 0)
    end = min(max(speech_end + trail_frames, start + 1), total)
    return STEPS_PER_FRAME * start, STEPS_PER_FRAME * end


@dataclass(frozen=True)
class WindowSettings:
    """How a job is cut into windows (generator steps of 12.5 ms), stored by the `windows` stage."""

    first_steps: int = 12
    steps: int = 80
    overlap_steps: int = 4
    lead_frames: int = 2
    trail_frames: int = 6

    @classmethod
    def of(cls, meta: dict[str, Any]) -> WindowSettings:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: int(v) for k, v in meta.items() if k in known})


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
    stats: np.ndarray
    speech: tuple[int, int]  # the steps decoded: the speech between the edge silences
    cursor: int = 0  # the next step to decode
    windows: int = 0  # windows decoded so far
    front_seconds: float = 0.0  # the front and the generator's per-job part: what cannot be interleaved
    compute: float = 0.0  # seconds spent so far (front and windows)
    samples: int = 0  # audio decoded so far
    opened: bool = True  # no window sent yet: the next one opens the job (the joiner trims its lead-in)
    constants: dict[str, np.ndarray] | None = None  # the generator's per-job tensors (hoisting.py)

    @property
    def done(self) -> bool:
        return self.cursor >= self.speech[1]

    @property
    def steps_left(self) -> int:
        return self.speech[1] - self.cursor


def _serialized(graphs: Any, index: int) -> bytes:
    """Graph `index` of a (front, generator, ...) list as bytes, dropping the proto from the list."""
    data = graphs[index].SerializeToString()
    graphs[index] = None
    return data


class WindowedDecoder:
    """An artifact's graph split in memory (`split`): `start` runs the front and the generator's per-job
    part (`hoist`), `next_window` decodes one window. Statistics come from the artifact's table (`windows`
    stage). `lookup_tables` and `hoisting` exist to measure what each saves (benchmarks/generator_variants.py)."""

    def __init__(
        self,
        synth: Any,
        table: StatsTable | None = None,
        settings: WindowSettings | None = None,
        *,
        lookup_tables: bool = True,
        hoisting: bool = True,
    ) -> None:
        import onnx

        from kokoro_opt.synth import make_session

        model = onnx.load(str(synth.model_file))
        graphs = split(model, lookup_tables)
        del model
        self.channels = graphs[2]
        self.synth = synth
        self.table = table
        self.settings = settings or WindowSettings()
        # the front's session before the generator is cut again: the front holds most of the weights
        self.front_session = make_session(_serialized(graphs, 0), synth.settings, spinning=False, shared_arena=True)
        self.constants_session: Any = None
        self.constant_names: tuple[str, ...] = ()
        if hoisting:
            try:
                hoisted = hoist(graphs[1], list(FRONT_OUTPUTS[:3]), [FRONT_OUTPUTS[3], STATS_INPUT])
            except KeyError as exc:  # still correct, only slower: every window computes its per-job part
                log.warning("the generator's per-job part stays in its windows: %s not found", exc)
            else:
                graphs[1] = hoisted.window
                self.constant_names = hoisted.names
                self.constants_session = make_session(
                    hoisted.constants.SerializeToString(), synth.settings, spinning=False, shared_arena=True
                )
                del hoisted
        self.generator_session = make_session(_serialized(graphs, 1), synth.settings, spinning=False, shared_arena=True)
        self._window_inputs = {i.name for i in self.generator_session.get_inputs()}
        self._front_inputs = [i.name for i in self.front_session.get_inputs()]
        self._moments: Any = None

    @staticmethod
    def check(artifact: Any) -> None:
        """Refuse an artifact without the `windows` stage's statistics, naming the fix."""
        if not artifact.kokoro.get("windows") or not (artifact.path / STATS_FILE).exists():
            raise UserError(
                f"{artifact.name} has no windows stage (no {STATS_FILE})",
                "serve an artifact whose recipe ends with `- kind: windows`, or drop --windowed",
            )

    @classmethod
    def of_artifact(cls, synth: Any, **variant: bool) -> WindowedDecoder:
        """The decoder with the statistics and settings the artifact's `windows` stage stored; `variant`:
        `lookup_tables` / `hoisting` (see the class)."""
        cls.check(synth.artifact)
        artifact = synth.artifact
        return cls(synth, StatsTable.load(artifact.path / STATS_FILE), WindowSettings.of(artifact.kokoro["windows"]), **variant)

    def front(self, token_ids: list[int], style: np.ndarray, speed: float = 1.0, run_options: Any = None) -> FrontOutput:
        feeds = model_feeds(token_ids, style, speed, names=self._front_inputs)
        outputs = [np.asarray(x) for x in self.front_session.run(list(FRONT_OUTPUTS), feeds, run_options)]
        return FrontOutput(*outputs[:4], outputs[4].reshape(-1))

    def job_constants(self, front: FrontOutput, stats: np.ndarray, run_options: Any = None) -> dict[str, np.ndarray]:
        """The generator's per-job tensors (kokoro_opt/hoisting.py); empty when not hoisting."""
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
    ) -> np.ndarray:
        """Audio of steps [start, end), decoded with the overlap's steps of context each side; `constants`
        are the job's (`job_constants`), computed here when not given."""
        overlap = self.settings.overlap_steps
        lo, hi = max(start - overlap, 0), min(end + overlap, front.steps)
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

    def start(self, token_ids: list[int], pack: np.ndarray, speed: float = 1.0, run_options: Any = None) -> WindowedJob:
        if self.table is None:
            raise UserError("this windowed decoder has no statistics table", "load it with WindowedDecoder.of_artifact")
        began = time.perf_counter()
        front = self.front(token_ids, style_for(pack, len(token_ids)), speed, run_options)
        s = self.settings
        start, end = speech_steps(front.durations, token_ids, self.synth.symbols, s.lead_frames, s.trail_frames)
        stats = self.table.stats(self.table.weights(pack, self.synth.packs), float(np.sum(front.durations)))
        job = WindowedJob(front, stats, (start, end), cursor=start, constants=self.job_constants(front, stats, run_options))
        job.front_seconds = job.compute = time.perf_counter() - began
        return job

    def next_window(self, job: WindowedJob, steps: int | None = None, run_options: Any = None) -> np.ndarray:
        """Decode the job's next window: `steps` long, or by default the settings' first / later window size."""
        began = time.perf_counter()
        s = self.settings
        size = steps if steps is not None else (s.first_steps if job.windows == 0 else s.steps)
        a = job.cursor
        b = window_end(a, job.speech[1], size, s.steps // 4)
        audio = self.window(job.front, a, b, job.stats, run_options, job.constants)
        job.cursor, job.windows = b, job.windows + 1
        job.compute += time.perf_counter() - began
        job.samples += len(audio)
        return audio

    def speak(self, token_ids: list[int], pack: np.ndarray, speed: float = 1.0) -> tuple[np.ndarray, WindowedJob]:
        """The whole speech span of one utterance, window by window (what a stream hears, joined)."""
        job = self.start(token_ids, pack, speed)
        parts = []
        while not job.done:
            parts.append(self.next_window(job))
        return np.concatenate(parts), job

    def exact_moments(self, token_ids: list[int], style: np.ndarray, speed: float = 1.0) -> tuple[float, np.ndarray, np.ndarray]:
        """(frames, mean, var) of every generator norm's input over this whole utterance (what the table pools)."""
        from kokoro_opt.synth import make_session

        if self._moments is None:  # only the windows stage measures: serving never builds this graph
            import onnx

            graph = moments_model(onnx.load(str(self.synth.model_file)))[0]
            self._moments = make_session(graph.SerializeToString(), self.synth.settings)
        return utterance_moments(self._moments, self.synth.feeds(token_ids, style, speed))


def utterance_moments(session: Any, feeds: dict[str, np.ndarray]) -> tuple[float, np.ndarray, np.ndarray]:
    """(frames, mean, var) of each measured norm's input over one utterance, from a `moments_model` session."""
    outputs = [np.asarray(x) for x in session.run(None, feeds)]
    return float(np.sum(outputs[1])), np.concatenate(outputs[2::2]), np.concatenate(outputs[3::2])


STATS_FILE = "norm_stats.npz"
NEIGHBOURS = 16  # calibration utterances pooled per bucket (measured: 8 / 16 / 24 by frames, docs/serving.md)


@dataclass
class StatsTable:
    """Per voice, the generator norms' input moments pooled over calibration utterances of about each length.

    Indexed by frames because the statistics follow an utterance's length (its share of edge silence
    above all): pooled over every calibration sentence, 12 short phrases scored PESQ 2.0 against their
    whole decoding; pooled over the 16 of nearest length, 3.9 (docs/serving.md)."""

    voices: list[str]
    frames: np.ndarray  # (B,) bucket centres, ascending
    mean: np.ndarray  # (V, B, C)
    var: np.ndarray  # (V, B, C)
    # (the packs it was computed from, their Gram matrix): see `weights`
    _gram: tuple[tuple[np.ndarray, ...], np.ndarray] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def pool(
        cls, samples: dict[str, list[tuple[float, np.ndarray, np.ndarray]]], buckets: int = 12, neighbours: int = NEIGHBOURS
    ) -> StatsTable:
        """From (frames, mean, var) per calibration utterance and voice."""
        voices = sorted(samples)
        lengths = np.array([f for f, _, _ in samples[voices[0]]], dtype=np.float64)
        grid = np.unique(np.round(np.geomspace(lengths.min(), lengths.max(), buckets)))
        mean = np.zeros((len(voices), len(grid), len(samples[voices[0]][0][1])), dtype=np.float32)
        var = np.zeros_like(mean)
        for v, voice in enumerate(voices):
            rows = samples[voice]
            for b, centre in enumerate(grid):
                near = sorted(rows, key=lambda r: abs(np.log(r[0] / centre)))[:neighbours]
                mean[v, b], var[v, b] = pooled(near)
        return cls(voices, grid.astype(np.float32), mean, var)

    def save(self, path: Any) -> None:
        np.savez(path, voices=np.array(self.voices), frames=self.frames, mean=self.mean, var=self.var)

    @classmethod
    def load(cls, path: Any) -> StatsTable:
        with np.load(path) as data:
            return cls([str(v) for v in data["voices"]], data["frames"], data["mean"], data["var"])

    def weights(self, pack: np.ndarray, packs: dict[str, np.ndarray]) -> np.ndarray:
        """How much of each voice a pack is (a blend is a weighted sum of packs): least squares, exact for blends.
        Solved from the normal equations, with the packs' Gram matrix kept while the same packs are passed: an
        lstsq over the stacked packs took ~4 ms of every job's first audio (5 voices, AMD EPYC) and a 5 MB copy."""
        given = tuple(packs[v] for v in self.voices)
        columns = [np.asarray(p).reshape(-1) for p in given]
        if self._gram is None or any(a is not b for a, b in zip(self._gram[0], given, strict=True)):
            basis = np.stack(columns, axis=1).astype(np.float64)
            self._gram = (given, basis.T @ basis)
        target = np.asarray(pack).reshape(-1)
        moments = np.array([c @ target for c in columns], dtype=np.float64)
        return np.linalg.lstsq(self._gram[1], moments, rcond=None)[0]  # not solve: two equal packs make it singular

    def stats(self, weights: np.ndarray, frames: float) -> np.ndarray:
        """norm_stats for a voice mix and an utterance of `frames` frames: its nearest bucket, moments mixed."""
        b = int(np.argmin(np.abs(np.log(self.frames / max(frames, 1.0)))))
        mean = np.einsum("v,vc->c", weights, self.mean[:, b].astype(np.float64))
        second = np.einsum("v,vc->c", weights, self.var[:, b].astype(np.float64) + self.mean[:, b].astype(np.float64) ** 2)
        return stats_from_moments(mean, second - mean * mean)
