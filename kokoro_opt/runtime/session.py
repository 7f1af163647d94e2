"""ONNX Runtime sessions as every runtime path makes them: settings, shared arena, memory handed back."""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

from kokoro_opt.errors import UserError
from kokoro_opt.machine import usable_cores

THREADS_ENV = "KOKORO_OPT_THREADS"
GraphLevel = Literal["disabled", "basic", "extended", "all"]  # ONNX Runtime's graph optimization levels (GRAPH_LEVELS)
ExecutionMode = Literal["sequential", "parallel"]


@dataclass(frozen=True)
class SessionSettings:
    """ONNX Runtime settings; tuning writes these next to an artifact (tuned.json)."""

    intra_op_num_threads: int = 0  # 0 = default_threads()
    inter_op_num_threads: int = 1
    execution_mode: ExecutionMode = "sequential"
    graph_optimization_level: GraphLevel = "all"
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    provider_options: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    enable_profiling: bool = False

    def describe(self) -> str:
        """These settings in words, for a log a person reads."""
        count = self.resolved().intra_op_num_threads
        threads = f"{count} thread{'s' * (count > 1)}" if count else "a thread per core"
        return (f"ONNX Runtime, {threads} a session, {self.execution_mode} execution, {self.graph_optimization_level} "
                f"graph optimizations, {', '.join(self.providers)}")  # fmt: skip

    def resolved(self) -> SessionSettings:
        """These settings with the threads a session really gets (KOKORO_OPT_THREADS where none are named)."""
        return replace(self, intra_op_num_threads=self.intra_op_num_threads or default_threads())


def profile_prefix() -> str:
    """Where a session's profile goes (`end_profiling` returns the file): the temporary folder, not the working one
    (a killed run would leave tens of MB there), under a name of its own (sessions made within one millisecond
    would otherwise write the same file)."""
    return str(Path(tempfile.gettempdir()) / f"kokoro-opt-profile-{uuid.uuid4().hex[:12]}")


def default_threads() -> int:
    """Threads of a session (and of torch) that no setting names: KOKORO_OPT_THREADS, else 0, every core.
    Processes sharing a machine (test workers, a build beside a server) otherwise each take every core,
    and their spinning thread pools wait on each other."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise UserError(
            f"{THREADS_ENV}={value!r} is not a number of threads", "set it to a whole number (0: every core) or unset it"
        )
    return int(value)


def shared_by(settings: SessionSettings, runs: int) -> SessionSettings:
    """`settings` for sessions that `runs` threads run at once (a windowed server's workers): the process's
    threads (as named, else its usable cores) split among the runs, so that each has its share rather than
    every run a pool over all of them that the other runs wait on (two workers on a 2-core AMD EPYC: eight streams
    played through in every run with a thread each, and ran short with one shared pool;
    docs/measurements/2026-11-29-capacity.md)."""
    if runs <= 1:
        return settings
    budget = settings.resolved().intra_op_num_threads or usable_cores()
    return replace(settings, intra_op_num_threads=max(1, budget // runs))


GRAPH_LEVELS: dict[GraphLevel, str] = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


Spinning = Literal["always", "in_run", "never"]


def make_session(
    model_file: Path | bytes,
    settings: SessionSettings = SessionSettings(),
    spinning: Spinning = "always",
    shared_arena: bool = False,
) -> Any:
    """A session over a model file, or a serialized model (a graph made in memory).

    For sessions that take turns (windowed decoding's front, per-job part and generator), `spinning="in_run"`:
    pool threads spin while a run lasts (between its ~1,600 small ops a sleeping thread costs a wake-up each)
    and stop when it returns, so an idle pool never holds the cores the next session needs. Where two runs
    share the cores at once (two workers), `"never"`: a spinning pool would take them from the other run.
    And `shared_arena=True`, since one arena for all of them holds the largest run's activations instead of
    each session's (measured: 622 -> 557 MB for the front and generator). Measurements:
    docs/measurements/2026-11-27-windowed-front.md (2026-12-04)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.resolved().intra_op_num_threads
    options.inter_op_num_threads = settings.inter_op_num_threads
    options.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL if settings.execution_mode == "parallel" else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_LEVELS[settings.graph_optimization_level])
    options.log_severity_level = 3
    # Every job has another length: a memory pattern planned for one shape only holds extra blocks.
    # Measured on int8-mixed (jobs of 30/80/200 tokens): peak resident memory +628 -> +448 MB, time +1-3%.
    options.enable_mem_pattern = False
    if settings.enable_profiling:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix()
    if spinning == "in_run":
        options.add_session_config_entry("session.force_spinning_stop", "1")
    elif spinning == "never":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if shared_arena:
        _register_shared_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
    providers, provider_options = _providers_here(settings)
    model = model_file if isinstance(model_file, bytes) else str(model_file)
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    # a file, not this code, is wrong: it does not parse, or parses and names an op, type or data ORT refuses
    refused = (
        state.InvalidProtobuf,
        state.InvalidGraph,
        state.NoSuchFile,
        state.Fail,
        state.NotImplemented,
        state.InvalidArgument,
    )
    try:
        session = ort.InferenceSession(model, options, providers=providers, provider_options=provider_options)
    except refused as exc:
        where = "the model given as bytes" if isinstance(model_file, bytes) else str(model_file)
        raise UserError(
            f"{where} does not load in ONNX Runtime ({type(exc).__name__}: {str(exc)[:200]})",
            "rebuild the artifact, or fetch it again (kokoro-opt fetch checks every file against its manifest); if it "
            f"loads elsewhere, check this ONNX Runtime ({ort.__version__}) and the session settings ({providers})",
        ) from None
    release_freed_memory()
    return session


def _providers_here(settings: SessionSettings) -> tuple[list[str], list[dict[str, Any]] | None]:
    """The settings' providers this ONNX Runtime has, each with its own options (None: none given); CPU when it has
    none of them. A provider missing here (a tuned setting made on another machine) is said once, not dropped unsaid."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    given = len(settings.provider_options) == len(settings.providers)
    pairs = list(zip(settings.providers, settings.provider_options if given else [{}] * len(settings.providers), strict=True))
    for name, _ in pairs:
        if name not in available:
            _say_missing(name)
    kept = [(name, options) for name, options in pairs if name in available] or [("CPUExecutionProvider", {})]
    return [name for name, _ in kept], [dict(options) for _, options in kept] if given else None


@cache
def _say_missing(provider: str) -> None:
    logging.getLogger("kokoro_opt").warning("%s is not available in this ONNX Runtime: its sessions run without it", provider)


@cache
def _register_shared_arena() -> None:
    """One CPU arena in ONNX Runtime's environment, for the sessions that ask for it (once per process)."""
    import onnxruntime as ort

    cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(0, -1, -1, -1))  # ORT's default arena settings


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc). Loading a session frees its graph copies and
    the weights it folded, but glibc keeps the pages: measured on int8-mixed, the session's resident
    memory drops from +379 MB to +222 MB. A no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)
