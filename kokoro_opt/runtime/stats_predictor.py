"""A windowed job's generator-norm statistics, predicted from what its front already computed.

Each of the generator's InstanceNorms normalizes over the whole utterance, which a window has not decoded
yet. The `windows` stage measures, on calibration utterances, every norm's exact input mean and variance
beside a summary of the same utterance's front (per-channel moments of the generator's input, F0 and
voicing, length, the style vector), and fits a ridge regression from one to the other (reduced rank, so
the artifact carries ~5 MB). A job's statistics are then one small product of its front summary: ~0.5 ms.

Measured on int8-mixed, windowed vs whole decoding on the gate's utterances (docs/measurements/
2026-12-04-stats-predictor.md): the per-voice, per-length table scored PESQ 3.88 on sentences and 2.94 on
the worst phrase, and moved the 4-12 kHz band up to 6.1 dB; predicted statistics score 4.35-4.37 and
3.1-4.0 (across torch's kernel paths), and 2.1-2.5 dB. The statistics must be within ~1% of exact for the
last: the median error here is 0.7% of a channel's deviation for the mean and 1.0% for the deviation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError, read_arrays
from kokoro_opt.runtime.norm_stats import STATISTICS_HINT, stats_from_moments

PREDICTOR_FILE = "norm_predictor.npz"
F0_EDGES = np.geomspace(60.0, 600.0, 13)  # Hz: the share of steps voiced in each band
VOICED_HZ = 10.0
LEAKY_SLOPE = 0.1  # the generator's first op is LeakyReLU(0.1) of its input
ALPHA = 100.0  # ridge penalty on standardized summaries (measured: 10 to 1000 within 0.0005 of each other)
RANK = 128  # of the fitted map (measured: median errors 0.73% / 1.06% at 128, 0.69% / 1.02% at full rank)


def front_summary(front: Any) -> np.ndarray:
    """What the predictor reads of a front (runtime/windowed.py `FrontOutput`): its features (1, C, steps),
    F0 in Hz per step and the decoder's style vector."""
    x = np.asarray(front.features[0], dtype=np.float64)
    leaky = np.where(x > 0, x, LEAKY_SLOPE * x)
    f0 = np.asarray(front.f0, dtype=np.float64).reshape(-1)
    voiced = f0 > VOICED_HZ
    share = float(voiced.mean())
    log_f0 = np.log(f0[voiced]) if voiced.any() else np.zeros(1)
    steps = x.shape[1]
    scalars = [share, float(log_f0.mean()) * share, float((log_f0**2).mean()) * share, np.log(steps), 1.0 / steps]
    bands = np.histogram(f0[voiced], bins=F0_EDGES)[0] / steps
    style = np.asarray(front.decoder_style, dtype=np.float64).reshape(-1)
    return np.concatenate([x.mean(1), leaky.mean(1), (leaky * leaky).mean(1), scalars, style, bands])


@dataclass
class StatsPredictor:
    """Ridge regression from `front_summary` to every generator norm's input mean and log-variance."""

    x_mean: np.ndarray  # (F,)
    x_scale: np.ndarray  # (F,)
    project: np.ndarray  # (F, K): standardized summary to the map's K directions
    expand: np.ndarray  # (K, 2C): those directions to standardized means and log-variances
    y_mean: np.ndarray  # (2C,)
    y_scale: np.ndarray  # (2C,)
    _maps: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._maps = (self.project.astype(np.float32), self.expand.astype(np.float32))

    @classmethod
    def fit(
        cls, summaries: np.ndarray, means: np.ndarray, variances: np.ndarray, alpha: float = ALPHA, rank: int = RANK
    ) -> StatsPredictor:
        """From N utterances' `front_summary` (N, F) and their norms' exact input moments (N, C) each."""
        x = np.asarray(summaries, dtype=np.float64)
        y = np.concatenate([means, np.log(np.maximum(variances, 1e-12))], axis=1).astype(np.float64)
        x_mean, y_mean = x.mean(0), y.mean(0)
        x_scale, y_scale = _scale(x.std(0)), _scale(y.std(0))
        xs, ys = (x - x_mean) / x_scale, (y - y_mean) / y_scale
        weights = np.linalg.solve(xs.T @ xs + alpha * np.eye(xs.shape[1]), xs.T @ ys)
        # reduced rank: the fitted values' leading directions carry the map (reduced-rank regression)
        directions = np.linalg.svd(xs @ weights, full_matrices=False)[2][: min(rank, *xs.shape, ys.shape[1])]
        return cls(
            x_mean.astype(np.float32),
            x_scale.astype(np.float32),
            (weights @ directions.T).astype(np.float16),
            directions.astype(np.float16),
            y_mean.astype(np.float32),
            y_scale.astype(np.float32),
        )

    def moments(self, summary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, var) of every norm's input for one utterance's summary."""
        xs = ((np.asarray(summary, dtype=np.float64) - self.x_mean) / self.x_scale).astype(np.float32)
        # einsum, not `@`: BLAS's threads spin on after a product and took the cores from the window that
        # follows (first window 16 -> 28 ms, AMD EPYC); einsum's own loop takes 0.2 ms on one
        project, expand = self._maps
        y = np.einsum("k,kc->c", np.einsum("f,fk->k", xs, project), expand) * self.y_scale + self.y_mean
        channels = len(y) // 2
        return y[:channels].astype(np.float64), np.exp(y[channels:].astype(np.float64))

    def for_job(self, front: Any, pack: np.ndarray, packs: dict[str, np.ndarray]) -> np.ndarray:
        """norm_stats for a job (runtime/windowed.py); the voice is in the front's style vector."""
        mean, var = self.moments(front_summary(front))
        return stats_from_moments(mean, var)

    def save(self, path: Any) -> None:
        np.savez(path, **{name: getattr(self, name) for name in STORED})

    @property
    def channels(self) -> int:
        """How many norm channels it predicts statistics for."""
        return self.expand.shape[1] // 2

    @classmethod
    def load(cls, path: Path, hint: str = STATISTICS_HINT) -> StatsPredictor:
        """The predictor a `windows` stage saved; a file that is not one (it may come with a fetched artifact) is
        one UserError naming what is wrong, never a shape error in a request."""
        arrays = read_arrays(path, hint, STORED)
        problem = _shape_problem(arrays)
        if problem:
            raise UserError(f"{path} is not a statistics predictor: {problem}", hint)
        return cls(**{name: arrays[name] for name in STORED})


STORED = ("x_mean", "x_scale", "project", "expand", "y_mean", "y_scale")


def _shape_problem(arrays: dict[str, np.ndarray]) -> str | None:
    """What makes the stored arrays not one predictor: shapes that do not chain, or values that are not finite."""
    for name in STORED:
        if not np.issubdtype(arrays[name].dtype, np.floating) or not np.isfinite(arrays[name]).all():
            return f"'{name}' is not all finite floats"
    project, expand = arrays["project"], arrays["expand"]
    if project.ndim != 2 or expand.ndim != 2 or expand.shape[1] % 2:
        return f"'project' {project.shape} and 'expand' {expand.shape} are not matrices to (mean, log-variance)"
    (features, rank), outputs = project.shape, expand.shape[1]
    wanted = {"x_mean": (features,), "x_scale": (features,), "expand": (rank, outputs)}
    wanted |= {"y_mean": (outputs,), "y_scale": (outputs,)}
    for name, shape in wanted.items():
        if arrays[name].shape != shape:
            return f"'{name}' is {arrays[name].shape}, where 'project' {project.shape} needs {shape}"
    return None


def _scale(std: np.ndarray) -> np.ndarray:
    return np.where(std > 1e-8, std, 1.0)  # a constant column (a band no voice reaches) stays as it is
