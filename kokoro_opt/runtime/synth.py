"""Synthesis over an ONNX Runtime session: text or phonemes in, 24 kHz audio out."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.edge_capping import EDGE_INPUT, edge_keep
from kokoro_opt.errors import UserError
from kokoro_opt.feeds import model_feeds
from kokoro_opt.voices import SAMPLE_RATE, blend_voice, style_for


@dataclass(frozen=True)
class SessionSettings:
    """ONNX Runtime settings; tuning writes these next to an artifact (tuned.json)."""

    intra_op_num_threads: int = 0  # 0 = ORT's default (all cores)
    inter_op_num_threads: int = 1
    execution_mode: str = "sequential"  # or "parallel"
    graph_optimization_level: str = "all"  # disabled | basic | extended | all
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    provider_options: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    enable_profiling: bool = False


GRAPH_LEVELS = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def make_session(
    model_file: Path | bytes, settings: SessionSettings = SessionSettings(), spinning: bool = True, shared_arena: bool = False
) -> Any:
    """A session over a model file, or a serialized model (a graph made in memory). For sessions that take
    turns (windowed decoding): `spinning=False`, since an idle pool's spinning threads would take the
    cores from the one running, and `shared_arena=True`, since one arena for all of them holds the largest
    run's activations instead of each session's (measured: 622 -> 557 MB for the front and generator)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.intra_op_num_threads
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
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if shared_arena:
        _register_shared_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
    available = set(ort.get_available_providers())
    providers = [p for p in settings.providers if p in available] or ["CPUExecutionProvider"]
    provider_options = list(settings.provider_options) if len(settings.provider_options) == len(providers) else None
    model = model_file if isinstance(model_file, bytes) else str(model_file)
    session = ort.InferenceSession(model, options, providers=providers, provider_options=provider_options)
    release_freed_memory()
    return session


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


@dataclass
class SynthesisResult:
    audio: np.ndarray
    sample_rate: int
    durations: np.ndarray

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate


class Speaker:
    """Text or phonemes -> audio over a subclass's `run_tokens`: one text path for every runtime."""

    vocab: dict[str, int]
    packs: dict[str, np.ndarray]
    sample_rate: int

    @property
    def voices(self) -> list[str]:
        return sorted(self.packs)

    @cached_property
    def symbols(self) -> dict[int, str]:
        """Token id -> phoneme symbol (the vocab inverted): edge capping and seams read the last symbols."""
        return {i: symbol for symbol, i in self.vocab.items()}

    def run_tokens(self, token_ids: list[int], voice: str | np.ndarray, speed: float = 1.0) -> SynthesisResult:
        raise NotImplementedError

    def synthesize(
        self, text: str | None = None, *, phonemes: str | None = None, voice: str = "jf_alpha", speed: float = 1.0
    ) -> SynthesisResult:
        """Whole input, split at sentence/clause boundaries under the 510-token context, joined."""
        from kokoro_opt.text import chunk_phonemes, chunk_text

        if (text is None) == (phonemes is None):
            raise UserError("give exactly one of text or phonemes")
        if not 0.25 <= speed <= 4.0:
            raise UserError(f"speed {speed} is out of range", "use a speed between 0.25 and 4.0")
        pack = blend_voice(voice, self.packs)
        chunks = chunk_text(text, self.vocab) if text is not None else chunk_phonemes(phonemes or "", self.vocab)
        if not chunks:
            raise UserError("nothing to say: the text is empty or has no pronounceable characters", "pass some words")
        parts = [self.run_tokens(chunk.token_ids, pack, speed) for chunk in chunks]
        return SynthesisResult(
            np.concatenate([p.audio for p in parts]),
            self.sample_rate,
            np.concatenate([p.durations for p in parts]),
        )


class Synthesizer(Speaker):
    """One loaded artifact: a session, its voices and vocab. Reuse it; loading takes ~1 s."""

    def __init__(
        self,
        artifact: Artifact | str | Path,
        settings: SessionSettings = SessionSettings(),
        model_file: Path | None = None,
        load: bool = True,
    ) -> None:
        """`model_file` runs another graph (a candidate variant) with this artifact's voices and vocab. With
        `load=False` the whole graph's session is made on first use: a windowed server never makes it."""
        self.artifact = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
        meta = self.artifact.kokoro
        self.vocab: dict[str, int] = meta["vocab"]
        self.sample_rate = int(meta.get("sample_rate", SAMPLE_RATE))
        self.audio_gain = float(meta.get("audio_gain", 1.0))
        self.packs = self.artifact.voice_packs()
        self.settings = settings
        model = model_file or self.artifact.model_file
        if model.suffix == ".mlpackage":  # ORT would fail with INVALID_PROTOBUF, naming neither the cause nor the fix
            raise runtime_problem(self.artifact) or UserError(
                f"{model} is a Core ML model, not an ONNX Runtime one", "load it with kokoro_opt.runtime.open_synthesizer"
            )
        self.model_file = model
        self._session: Any = None
        self._inputs: list[str] = []  # read from the graph when its session is first made, kept after it is freed
        # (lead, trail) frames the decoder keeps when asked to cap the edges (passes/edges.py); None: no edges stage
        self._edges: tuple[int, int] | None = None
        if load:
            self._load()

    def _load(self) -> Any:
        session = make_session(self.model_file, self.settings)
        self._inputs = [i.name for i in session.get_inputs()]
        overridable = {i.name for i in session.get_overridable_initializers()}
        edges = self.artifact.kokoro.get("edges") if EDGE_INPUT in overridable else None
        self._edges = (int(edges["lead_frames"]), int(edges["trail_frames"])) if edges else None
        self._session = session
        return session

    @property
    def session(self) -> Any:
        return self._session if self._session is not None else self._load()

    @session.setter
    def session(self, session: Any) -> None:
        """None frees the whole graph's weights (a windowed server runs the split graphs instead)."""
        self._session = session

    @property
    def edges(self) -> tuple[int, int] | None:
        if not self._inputs:
            self._load()
        return self._edges

    def feeds(self, token_ids: list[int], style: np.ndarray, speed: float, cap_edges: bool = False) -> dict[str, np.ndarray]:
        """The session's feeds; with `cap_edges` (and an edges stage) the decoder skips most edge silence."""
        if not self._inputs:
            self._load()
        feeds = model_feeds(token_ids, style, speed, names=self._inputs)
        if cap_edges and self.edges:
            feeds[EDGE_INPUT] = edge_keep(*self.edges, token_ids, self.symbols)
        return feeds

    def run_tokens(
        self, token_ids: list[int], voice: str | np.ndarray, speed: float = 1.0, cap_edges: bool = False
    ) -> SynthesisResult:
        """One utterance; `cap_edges` returns it without most of its edge silence (the durations stay whole)."""
        if not token_ids:
            raise UserError("nothing to say: the text has no pronounceable characters", "pass words, not only punctuation")
        pack = blend_voice(voice, self.packs) if isinstance(voice, str) else voice
        feeds = self.feeds(token_ids, style_for(pack, len(token_ids)), speed, cap_edges)
        outputs = self.session.run(None, feeds)
        audio = np.asarray(outputs[0], dtype=np.float32).reshape(-1) / self.audio_gain
        # kokoro-onnx's own graph has no durations output
        durations = np.asarray(outputs[1]).reshape(-1) if len(outputs) > 1 else np.zeros(0, dtype=np.int64)
        return SynthesisResult(audio, self.sample_rate, durations)


def runtime_problem(artifact: Artifact) -> UserError | None:
    """Why `artifact` cannot run on this machine (a Core ML artifact off macOS), or None.

    Serve and evaluate ask before loading anything: serve refuses to start, evaluate skips it."""
    from kokoro_opt.coreml_support import coreml_problem

    return coreml_problem(artifact)
