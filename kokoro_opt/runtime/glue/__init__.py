"""The generator's chains between INT8 convolutions as native kernels (chains.c), built on the machine that runs them.

ONNX Runtime has no operator that normalizes, applies Snake and quantizes in one pass, and a native custom
operator needs its C API header, which no package index ships. So the fused generator (runtime/fused.py) runs
the convolutions in ONNX Runtime and these chains between them, called through ctypes. The library is compiled
on first use with the machine's C compiler (`CC`, else cc, gcc or clang) for this CPU, and kept in the user's
cache keyed by the source, the flags, the compiler and the CPU's features, so an edited kernel or another CPU
(a cache shared between machines) builds anew.
Without a compiler `library_path` raises a UserError naming the fix, and artifacts fall back to ONNX Runtime
alone (`kernels_problem`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.hashing import file_sha256
from kokoro_opt.machine import cpu_features
from kokoro_opt.paths import user_cache

SOURCE = Path(__file__).with_name("chains.c")
# -ffp-contract=off: no fused multiply-adds, so every machine computes the same floats (chains.c)
FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared")
# tried first: the library is built where it runs; then without, for compilers that know neither
TUNED = ("-march=native", "-fopenmp-simd")
SPLIT_MIN = 1 << 18  # channels x samples below which one thread does the whole chain (a hand-off costs ~50 us)


def cache_dir() -> Path:
    """Where built kernels are kept: `kernels/` in the user's kokoro-opt cache (paths.user_cache)."""
    return user_cache() / "kernels"


def compiler() -> str | None:
    named = os.environ.get("CC", "").split()
    candidates = [named[0]] if named else ["cc", "gcc", "clang"]
    return next((found for name in candidates if (found := shutil.which(name))), None)


def _build(cc: str, flags: tuple[str, ...], target: Path) -> subprocess.CompletedProcess[str]:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([cc, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode == 0:
            digest = Path(scratch) / "sha256"
            digest.write_text(file_sha256(built))
            os.replace(digest, _digest_of(target))  # the digest first: a library without its own is built again
            os.replace(built, target)  # atomic: another process may be building the same library
    return result


def _digest_of(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """Whether a cached library is the one built: a truncated file loads, and crashes the process at its first
    call (SIGBUS), which no exception handler sees."""
    try:
        return library.is_file() and _digest_of(library).read_text().strip() == file_sha256(library)
    except OSError:
        return False


def require_compiler() -> str:
    """The C compiler the kernels are built with; a UserError naming the fixes where there is none."""
    cc = compiler()
    if cc is None:
        raise UserError(
            "the fused generator needs a C compiler to build its kernels and none was found (cc, gcc, clang)",
            "install one (apt install gcc, xcode-select --install), set CC, or build a recipe without the `fuse` stage "
            "(one that `extends:` int8-mixed.yaml and lists its `stages:` but that one)",
        )
    return cc


@cache
def library_path() -> Path:
    """The compiled library, built on first use (UserError without a working C compiler)."""
    return build_library()


def build_library() -> Path:
    """The library, built unless this machine's cache holds it (UserError without a working C compiler): the
    `fuse` stage's machine check, before a build runs its first stage."""
    cc = require_compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    errors = ""
    for flags in ((*FLAGS, *TUNED), FLAGS):
        # -march=native builds for this CPU's features: another CPU sharing the cache (a network home) must not load it
        made_for = cpu_features() if "-march=native" in flags else platform.machine()
        key = hashlib.sha256("\0".join((SOURCE.read_text(), *flags, version, made_for)).encode()).hexdigest()
        target = cache_dir() / f"chains-{key[:16]}{'.dll' if os.name == 'nt' else '.so'}"
        if _intact(target):
            return target
        result = _build(cc, flags, target)
        if result.returncode == 0:
            return target
        errors = result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"]
    raise UserError(f"{cc} could not build the fused generator's kernels: {errors[0]}", "set CC to a working C compiler")


def kernels_problem() -> str | None:
    """Why the kernels cannot run here, or None."""
    try:
        Kernels.load()
    except (UserError, OSError) as exc:
        return str(exc)
    return None


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Affine(ctypes.Structure):
    """chains.c's Affine: a chain's per-channel constants and the utterance's norm scale and bias."""

    _fields_ = [(name, _P) for name in ("scale", "bias", "gain", "shift", "qscale", "qzero")] + [
        (name, _F) for name in ("eps", "c1", "a", "b")
    ]


class _Branches(ctypes.Structure):
    """chains.c's Branches: a stage's three branches, summed and divided (Kernels.branch_sum)."""

    _fields_ = [("q", _P * 3), ("x", _P * 3), ("scale", _P * 3), ("zero", _P * 3), ("divisor", _F)]


_SIGNATURES = {
    "level_chain": [_P, _I, _I, _I, _P, _P, _P, _P],
    "float_chain": [_P, _I, _I, _I, _P, _P],
    "residual_chain": [_P, _P, _I, _I, _I, _P, _P, _P, _P, _P],
    "branch_sum": [_P, _I, _I, _I, _P],
}


def per_channel(value: np.ndarray | float, channels: int) -> np.ndarray:
    """`value` as `channels` contiguous float32s: itself when it already is (a chain's per-channel constant,
    a norm's scale), else a per-tensor constant repeated (~4 us: callers keep the ones they pass every run)."""
    array = np.asarray(value, dtype=np.float32).reshape(-1)
    if array.size == channels and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(np.broadcast_to(array, (channels,)))


def _address(array: np.ndarray, dtype: type = np.float32) -> int:
    """Where the kernel reads or writes `array`. It reads the number of elements it is given in `dtype`: anything
    else (a plan is a file) would read or write past the array's end, so it is refused here, before the call."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        kind = "C-contiguous" if array.flags.c_contiguous else "non-contiguous"
        raise ValueError(f"a chain was given a {kind} {array.dtype} array where it reads C-contiguous {np.dtype(dtype)}")
    return array.__array_interface__["data"][0]


@dataclass(frozen=True)
class KernelCall:
    """One chain's kernel, its arguments before and after the channel range it runs over, and what they point to
    (`keep`: arrays and structs passed by address, held until the call has run)."""

    name: str
    channels: int
    size: int
    before: list
    after: list
    keep: tuple = ()


class Kernels:
    """The compiled chains, run over channel ranges on `parts` threads (ctypes releases the GIL)."""

    def __init__(self, library: ctypes.CDLL, parts: int) -> None:
        self.library = library
        for name, arguments in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, None
        self.parts = max(1, parts)
        self._pool = ThreadPoolExecutor(self.parts - 1, thread_name_prefix="kokoro-chains") if self.parts > 1 else None

    @classmethod
    @cache
    def load(cls, parts: int = 2) -> Kernels:
        return cls(ctypes.CDLL(str(library_path())), parts)

    def run(self, calls: list[KernelCall]) -> None:
        """The calls in order. Every chain is per channel (a channel's output reads that channel's input alone), so
        calls over the same channels are split once: each thread runs them all in turn over its own channels, one
        hand-off (~50 us) for all of them."""
        if len({c.channels for c in calls}) > 1:
            for call in calls:
                self.run([call])
            return
        functions = [(getattr(self.library, c.name), c.before, c.after) for c in calls]

        def over(lo: int, hi: int) -> None:
            for function, before, after in functions:
                function(*before, lo, hi, *after)

        channels = calls[0].channels if calls else 0
        if self._pool is None or sum(c.size for c in calls) < SPLIT_MIN:
            over(0, channels)
            return
        bounds = [channels * k // self.parts for k in range(self.parts + 1)]
        futures: list[Future] = []
        try:
            futures += (self._pool.submit(over, lo, hi) for lo, hi in pairwise(bounds[1:]))
            over(0, bounds[1])
        finally:  # even on Ctrl-C: the pool's threads write into this run's arrays, which leaving would free
            _wait_out(futures)
        for future in futures:
            future.result()


def _wait_out(futures: list[Future]) -> None:
    """Wait for every future, through interrupts (each ~ms away), then raise the first interrupt."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def level_call(q: np.ndarray, chain: ChainArgs, out: np.ndarray) -> KernelCall:
    """A chain over a convolution's uint8 levels `q` into `out`'s levels."""
    channels, samples = q.shape
    return KernelCall("level_chain", channels, q.size, [_address(q, np.uint8), samples], chain.level_args(out), (chain, q, out))


def float_call(x: np.ndarray, chain: ChainArgs, out: np.ndarray) -> KernelCall:
    """A chain over a float tensor `x` into `out`'s levels."""
    channels, samples = x.shape
    return KernelCall("float_chain", channels, x.size, [_address(x), samples], chain.float_args(out), (chain, x, out))


def residual_call(prev: np.ndarray, q: np.ndarray, chain: ChainArgs, x_new: np.ndarray, out: np.ndarray) -> KernelCall:
    """x_new = prev + the levels `q` as floats, then a chain over x_new into `out`'s levels."""
    channels, samples = prev.shape
    before = [_address(prev), _address(q, np.uint8), samples]
    keep = (chain, prev, q, x_new, out)
    return KernelCall("residual_chain", channels, prev.size, before, chain.residual_args(x_new, out), keep)


def branch_sum_call(levels: list[np.ndarray], streams: list[np.ndarray], scales: list[np.ndarray],
                    zeros: list[np.ndarray], divisor: float, out: np.ndarray) -> KernelCall:  # fmt: skip
    """out = mean of (levels[j] - zeros[j]) * scales[j] + streams[j]; `out` may be one of `streams`."""
    channels, samples = out.shape
    held = [per_channel(v, channels) for v in (*scales, *zeros)]
    branches = _Branches((_P * 3)(*(_address(v, np.uint8) for v in levels)), (_P * 3)(*map(_address, streams)),
                         (_P * 3)(*map(_address, held[:3])), (_P * 3)(*map(_address, held[3:])), divisor)  # fmt: skip
    keep = (branches, *held, *levels, *streams, out)
    return KernelCall("branch_sum", channels, out.size, [ctypes.byref(branches), samples], [_address(out)], keep)


class ChainConstants:
    """A chain's constants as its kernel reads them, made once: the next convolution's quantization, the grid of its
    uint8 input (a level or residual chain's), the eps and polynomial, and a gain of 1 and a shift of 0 for the chains
    that apply none after their norm."""

    def __init__(
        self,
        channels: int,
        eps: float,
        poly: tuple[float, float, float],
        qscale: np.ndarray,
        qzero: np.ndarray,
        levels: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.channels, self.eps, self.poly = channels, float(eps), poly
        self.arrays = [per_channel(v, channels) for v in (qscale, qzero, *(levels or (1.0, 0.0)), 1.0, 0.0)]
        self.quantize, self.levels, self.no_post = (tuple(map(_address, self.arrays[k : k + 2])) for k in (0, 2, 4))


class ChainArgs:
    """One chain's arguments for one utterance: its norm's scale and bias (AdaIN folded in), the gain and shift
    applied after a norm three branches share, and its constants; holds every array it passes by address until the
    call returns."""

    def __init__(
        self,
        constants: ChainConstants,
        norm_scale: np.ndarray,
        norm_bias: np.ndarray,
        post: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.constants = constants
        self.arrays = [per_channel(v, constants.channels) for v in (norm_scale, norm_bias, *(post or ()))]
        addresses = [_address(v) for v in self.arrays]
        post_addresses = addresses[2:] or constants.no_post
        self.affine = _Affine(*addresses[:2], *post_addresses, *constants.quantize, constants.eps, *constants.poly)

    def level_args(self, out: np.ndarray) -> list:
        return [*self.constants.levels, ctypes.byref(self.affine), _address(out, np.uint8)]

    def float_args(self, out: np.ndarray) -> list:
        return [ctypes.byref(self.affine), _address(out, np.uint8)]

    def residual_args(self, x_new: np.ndarray, out: np.ndarray) -> list:
        return [*self.constants.levels, _address(x_new), ctypes.byref(self.affine), _address(out, np.uint8)]
