"""The fused generator: the whole generator as ONNX Runtime segments with native chains between them.

The `fuse` stage (passes/fuse.py) writes `fused/`: the segments, `plan.json` (the order of segments and chains,
what each reads and makes, when a tensor can go) and `constants.npz` (each chain's quantization constants).
Its audio is the whole generator's up to each chain's own rounding: a level rounding the other way now and
then, which the generator carries as it carries any float noise (the stage's gate measures it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError, read_arrays
from kokoro_opt.machine import usable_cores
from kokoro_opt.runtime.fused_plan import (
    CONSTANTS_FILE,
    PLAN_FILE,
    PLAN_HINT,
    BranchSum,
    FusedPlan,
    NormChain,
    SegmentStep,
    own_constants,
)
from kokoro_opt.runtime.glue import (
    ChainArgs,
    ChainConstants,
    KernelCall,
    Kernels,
    branch_sum_call,
    float_call,
    level_call,
    per_channel,
    residual_call,
)
from kokoro_opt.runtime.session import SessionSettings, make_session

FUSED_DIR = "fused"
__all__ = ["CONSTANTS_FILE", "FUSED_DIR", "PLAN_FILE", "FusedGenerator", "FusedSpeaker"]


class FusedGenerator:
    """Runs a `fused/` folder: feeds as the whole generator's (features, f0, phase, decoder_style), same output."""

    def __init__(self, folder: Path, settings: SessionSettings | None = None, spinning: Any = "in_run") -> None:
        settings = settings or SessionSettings()
        self.folder = folder
        self.constants = read_arrays(folder / CONSTANTS_FILE, PLAN_HINT)
        self.plan = FusedPlan.read(folder, self.constants)
        self._held: dict[tuple[str, int], np.ndarray] = {}  # constants as the kernels read them (_constant)
        self._chains: dict[tuple[str, int], ChainConstants] = {}  # each chain's (_chain_constants)
        threads = settings.resolved().intra_op_num_threads  # 0: ONNX Runtime takes every core, a chain up to 4
        self.kernels = Kernels.load(threads if threads > 0 else min(usable_cores(), 4))
        self.chain_seconds = 0.0  # time in the native chains: a profile's row beside ONNX Runtime's operators
        segments = self.plan.segments()
        for name in segments:  # the plan names files of its own folder only (its schema); they must be there
            if not (folder / name).is_file():
                raise UserError(f"{folder / PLAN_FILE} names {name!r}, not a segment of {folder}", PLAN_HINT)
        self.sessions = {name: make_session(folder / name, settings, spinning=spinning, shared_arena=True) for name in segments}

    def run(self, feeds: dict[str, np.ndarray], run_options: Any = None) -> np.ndarray:
        env = dict(feeds)
        for step in self.plan.steps:
            if isinstance(step, SegmentStep):
                made = self.sessions[step.segment].run(step.outputs, {i: env[i] for i in step.inputs}, run_options)
                env.update(zip(step.outputs, made, strict=True))
            else:
                began = time.perf_counter()
                self.kernels.run([self._call(chain, env) for chain in step.chains])  # the step's chains, one hand-off
                self.chain_seconds += time.perf_counter() - began
            for name in step.release:
                env.pop(name, None)
        return env[self.plan.outputs[0]]

    def _call(self, chain: NormChain | BranchSum, env: dict[str, np.ndarray]) -> KernelCall:
        """The kernel call of one chain, its outputs placed in `env` (made when the step's calls run)."""
        try:
            return self._branch_sum_call(chain, env) if isinstance(chain, BranchSum) else self._chain_call(chain, env)
        except ValueError as exc:  # what the plan (a file) routes where the kernels cannot read it
            raise UserError(f"{self.folder / PLAN_FILE}: {chain.name}: {exc}", PLAN_HINT) from None

    def _value(self, env: dict[str, np.ndarray], name: str) -> np.ndarray:
        return env[name].reshape(-1) if name in env else self._constant(name, 0)

    def _constant(self, name: str, channels: int) -> np.ndarray:
        """A constant as the kernels read it (`channels` float32s; 0: as stored), made on first use and kept."""
        key = (name, channels)
        if key not in self._held:
            value = self.constants[name]
            self._held[key] = per_channel(value, channels) if channels else value.reshape(-1)
        return self._held[key]

    def _chain_constants(self, spec: NormChain, channels: int) -> ChainConstants:
        """The chain's constants for `channels` channels, made on first use and kept."""
        key = (spec.name, channels)
        if key not in self._chains:
            held = {constant.rsplit(".", 1)[1]: self._constant(constant, channels) for constant in own_constants(spec)}
            levels = (held["scale"], held["zero"]) if spec.kind != "float" else None
            self._chains[key] = ChainConstants(channels, spec.eps, spec.poly, held["qscale"], held["qzero"], levels)
        return self._chains[key]

    def _chain_call(self, spec: NormChain, env: dict[str, np.ndarray]) -> KernelCall:
        scale = self._value(env, spec.norm_scale)
        post = None
        if spec.post_gain and spec.post_shift:
            post = (self._value(env, spec.post_gain), self._value(env, spec.post_shift))
        args = ChainArgs(self._chain_constants(spec, scale.size), scale, self._value(env, spec.norm_bias), post)
        source = env[spec.x]
        shape = source.shape
        if source.ndim != 3 or (spec.q is not None and env[spec.q].shape != shape):
            raise ValueError(f"inputs of shapes {source.shape} and {env[spec.q or spec.x].shape}")
        flat = (int(np.prod(shape[:-1])), shape[-1])
        if scale.size != flat[0]:  # the kernels read one constant per row: the plan (a file) must not say otherwise
            raise ValueError(f"{scale.size} channel constants for {flat[0]} channels")
        out = np.empty(shape, np.uint8)
        env[spec.out] = out
        if spec.kind == "level":
            return level_call(source.reshape(flat), args, out.reshape(flat))
        if spec.kind == "float":
            return float_call(source.reshape(flat), args, out.reshape(flat))
        assert spec.q is not None and spec.x_new is not None  # a residual chain has both (NormChain's schema)
        x_new = _overwritable(spec, source)
        levels = env[spec.q].reshape(flat)
        env[spec.x_new] = x_new
        return residual_call(source.reshape(flat), levels, args, x_new.reshape(flat), out.reshape(flat))

    def _branch_sum_call(self, spec: BranchSum, env: dict[str, np.ndarray]) -> KernelCall:
        name = spec.name
        streams = [env[x] for x in spec.x]
        shape = streams[0].shape
        if any(v.shape != shape for v in [*streams, *(env[q] for q in spec.q)]):
            raise ValueError("branches of different shapes")
        flat = (int(np.prod(shape[:-1])), shape[-1])
        out = _overwritable(spec, streams[0])
        channels = flat[0]
        env[spec.out] = out
        return branch_sum_call([env[q].reshape(flat) for q in spec.q], [x.reshape(flat) for x in streams],
                               [self._constant(f"{name}.scale{j}", channels) for j in range(3)],
                               [self._constant(f"{name}.zero{j}", channels) for j in range(3)],
                               spec.divisor, out.reshape(flat))  # fmt: skip


def _overwritable(spec: NormChain | BranchSum, stream: np.ndarray) -> np.ndarray:
    """Where a residual stream's sum goes: over the stream itself when nothing else reads it (the plan's `in_place`;
    the kernels read each sample before they write it), else a new array."""
    if spec.in_place and stream.flags.writeable and stream.flags.c_contiguous:
        return stream
    return np.empty(stream.shape, np.float32)


class FusedSpeaker:
    """Whole decoding of a fused artifact: its front graph (windows/front), then the fused generator, in place of
    model.onnx. `outputs`: the front's outputs, the generator's four inputs then the durations."""

    def __init__(
        self, front: Path | bytes, folder: Path, outputs: tuple[str, ...], settings: SessionSettings | None = None
    ) -> None:
        settings = settings or SessionSettings()
        self.front = make_session(front, settings, spinning="in_run", shared_arena=True)
        self.front_inputs = [i.name for i in self.front.get_inputs()]
        self.outputs = list(outputs)
        self.generator = FusedGenerator(folder, settings)

    def speak(self, feeds: dict[str, np.ndarray], run_options: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """(audio, durations) as model.onnx gives them for the same feeds."""
        made = self.front.run(self.outputs, {k: feeds[k] for k in self.front_inputs}, run_options)
        audio = self.generator.run(dict(zip(self.outputs[:4], made[:4], strict=True)), run_options)
        return np.asarray(audio, dtype=np.float32).reshape(-1), np.asarray(made[4]).reshape(-1)

    def end_profiling(self) -> list[Path]:
        return [Path(s.end_profiling()) for s in (self.front, *self.generator.sessions.values())]
