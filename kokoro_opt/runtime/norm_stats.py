"""InstanceNorm statistics for windowed decoding: their (2, C) layout, and the per-voice, per-length table the
`windows` stage stored before it fitted a predictor (kokoro_opt/runtime/stats_predictor.py). Artifacts built
then still load it; benchmarks/norm_stats_reach.py compares groups of norms with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError, read_arrays


def stats_from_moments(mean: np.ndarray, var: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """norm_stats (2, C): the mean and 1/sqrt(var + eps)."""
    return np.stack([mean, 1.0 / np.sqrt(np.maximum(var, 0.0) + eps)]).astype(np.float32)


def pooled(moments: list[tuple[float, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(mean, var) of utterances pooled, from (weight, mean, var) each: weight by frames, as one long input."""
    total = sum(w for w, _, _ in moments)
    mean = sum(w * m.astype(np.float64) for w, m, _ in moments) / total
    second = sum(w * (v.astype(np.float64) + m.astype(np.float64) ** 2) for w, m, v in moments) / total
    return mean, second - mean * mean


STATS_FILE = "norm_stats.npz"
STATISTICS_HINT = "rebuild the artifact's windows stage, or fetch the artifact again"
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

    @property
    def channels(self) -> int:
        """How many norm channels it holds statistics for."""
        return self.mean.shape[2]

    @classmethod
    def load(cls, path: Path, hint: str = STATISTICS_HINT) -> StatsTable:
        """The table an older `windows` stage saved; a file that is not one is one UserError naming what is wrong."""
        data = read_arrays(path, hint, ("voices", "frames", "mean", "var"))
        voices, frames, mean, var = data["voices"], data["frames"], data["mean"], data["var"]
        numbers = all(np.issubdtype(a.dtype, np.floating) and np.isfinite(a).all() for a in (frames, mean, var))
        lists = voices.ndim == frames.ndim == 1  # before len(): a 0-d array has none
        shape = (len(voices), len(frames), mean.shape[-1] if mean.ndim == 3 else -1) if lists else None
        if not (numbers and lists and mean.shape == var.shape == shape and (frames > 0).all() and (var >= 0).all()):
            wanted = f"finite, variances not below 0, ({voices.size} voices, {frames.size} lengths, C)"
            raise UserError(f"{path} is not a statistics table: 'mean' {mean.shape}, 'var' {var.shape} must be {wanted}", hint)
        return cls([str(v) for v in voices], frames, mean, var)

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

    def for_job(self, front: Any, pack: np.ndarray, packs: dict[str, np.ndarray]) -> np.ndarray:
        """norm_stats for a job (runtime/windowed.py): its voice mix, at its length."""
        return self.stats(self.weights(pack, packs), float(np.sum(front.durations)))

    def stats(self, weights: np.ndarray, frames: float) -> np.ndarray:
        """norm_stats for a voice mix and an utterance of `frames` frames: its nearest bucket, moments mixed."""
        b = int(np.argmin(np.abs(np.log(self.frames / max(frames, 1.0)))))
        mean = np.einsum("v,vc->c", weights, self.mean[:, b].astype(np.float64))
        second = np.einsum("v,vc->c", weights, self.var[:, b].astype(np.float64) + self.mean[:, b].astype(np.float64) ** 2)
        return stats_from_moments(mean, second - mean * mean)
