"""Synthesis over an ONNX Runtime session: text or phonemes in, 24 kHz audio out.

An artifact with the `fused` capability speaks through its front and fused generator (runtime/fused.py) instead
of model.onnx's session, where the fused generator's kernels build on this machine; otherwise, and for a
candidate graph or capped edges, through the session."""

from __future__ import annotations

import decimal
import logging
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.chunking import chunk_phonemes, chunk_text
from kokoro_opt.errors import UserError
from kokoro_opt.runtime.availability import runtime_problem
from kokoro_opt.runtime.edges import EDGE_INPUT, edge_keep
from kokoro_opt.runtime.feeds import model_feeds
from kokoro_opt.runtime.join import CROSSFADE_MS, PAUSES, Joiner, boundary
from kokoro_opt.runtime.session import SessionSettings, make_session
from kokoro_opt.text import CONTEXT_TOKENS
from kokoro_opt.voices import DEFAULT_VOICE, SAMPLE_RATE, blend_voice, style_for


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
    max_chunk_tokens: int = CONTEXT_TOKENS  # the most tokens `stream` gives one utterance: the model's context, or less
    gives_durations: bool = True  # whether `run_tokens` gives the model's durations: where each token's audio lies

    @property
    def voices(self) -> list[str]:
        return sorted(self.packs)

    @cached_property
    def symbols(self) -> dict[int, str]:
        """Token id -> phoneme symbol (the vocab inverted): edge capping and seams read the last symbols."""
        return {i: symbol for symbol, i in self.vocab.items()}

    def run_tokens(self, token_ids: list[int], voice: str | np.ndarray, speed: float = 1.0) -> SynthesisResult:
        raise NotImplementedError

    def stream(
        self,
        text: str | None = None,
        *,
        phonemes: str | None = None,
        voice: str = DEFAULT_VOICE,
        speed: float = 1.0,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> Iterator[SynthesisResult]:
        """The audio as it is made, a chunk at a time: whole sentences packed up to the model's 510-token context, as
        Kokoro's own pipeline does (only a longer sentence is split, at clauses, then words), each seam's silence
        cut to the pause its punctuation calls for and crossfaded (runtime/join.py), as the server joins jobs.
        `on_chunk(done, total)` after each chunk. The input is checked before the first chunk is asked for."""
        if (text is None) == (phonemes is None):
            raise UserError("give exactly one of text or phonemes")
        if not isinstance(speed, numbers.Real | decimal.Decimal) or isinstance(speed, bool):
            raise UserError(f"speed must be a number, not {type(speed).__name__}", "e.g. speed=1.2")
        try:  # compared as given: float() of 10**400 overflows, a signalling Decimal NaN refuses to compare
            in_range = 0.25 <= speed <= 4.0
        except ArithmeticError:
            in_range = False
        if not in_range:
            raise UserError(f"speed {speed!r} is out of range", "use a speed between 0.25 and 4.0")
        speed = float(speed)
        if not isinstance(voice, str):
            raise UserError(f"voice must be a name or a blend, not {type(voice).__name__}", "e.g. voice='alloy'")
        pack = blend_voice(voice, self.packs)
        if text is not None:  # no small first chunk: nothing is heard before a whole chunk is made
            chunks = chunk_text(text, self.vocab, first_chunk_tokens=None, chunk_tokens=self.max_chunk_tokens)
        else:
            chunks = chunk_phonemes(phonemes or "", self.vocab, self.max_chunk_tokens)
        if not chunks:
            raise UserError("nothing to say: the text is empty or has no pronounceable characters", "pass some words")

        def spoken() -> Iterator[SynthesisResult]:
            joiner = Joiner(self.sample_rate, CROSSFADE_MS)
            for done, chunk in enumerate(chunks, 1):
                result = self.run_tokens(chunk.token_ids, pack, speed)
                pause = PAUSES[boundary(chunk.token_ids, self.symbols)] / speed
                yield SynthesisResult(joiner.push(result.audio, done == len(chunks), pause), self.sample_rate, result.durations)
                if on_chunk is not None:
                    on_chunk(done, len(chunks))

        return spoken()

    def synthesize(
        self,
        text: str | None = None,
        *,
        phonemes: str | None = None,
        voice: str = DEFAULT_VOICE,
        speed: float = 1.0,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> SynthesisResult:
        """The whole input's audio: `stream`'s parts joined. Its durations are each chunk's, in order: the model's
        frames per token, before the seams' silences were trimmed from the audio (so they do not add up to it)."""
        parts = list(self.stream(text, phonemes=phonemes, voice=voice, speed=speed, on_chunk=on_chunk))
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
        settings: SessionSettings | None = None,
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
        self.settings = settings or SessionSettings()
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
        self._fused: Any = None  # FusedSpeaker, made on first use; False where the artifact cannot run fused here
        if load and self.fused is None:
            self._load()

    def _load(self) -> Any:
        # threads spin within a run only: a pool left spinning after it takes the cores from whatever runs next
        # (another artifact's session in an interleaved evaluation: measured 13% slower after the fp32 export's)
        session = make_session(self.model_file, self.settings, spinning="in_run")
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

    @cached_property
    def fused_folder(self) -> Path | None:
        """The artifact's fused/ folder when whole-generator runs can go through it here: the fused capability,
        this artifact's own graph, and kernels that build on this machine (else None: model.onnx or the whole
        generator graph, and the reason is logged once)."""
        if not (self.artifact.capabilities.fused and self.model_file == self.artifact.model_file):
            return None
        from kokoro_opt.runtime.fused import FUSED_DIR
        from kokoro_opt.runtime.glue import kernels_problem

        if (problem := kernels_problem()) is not None:
            logging.getLogger(__name__).warning("%s runs model.onnx: %s", self.artifact.name, problem)
            return None
        return self.artifact.path / FUSED_DIR

    @property
    def fused(self) -> Any:
        """The FusedSpeaker whole decoding runs through, or None (`fused_folder`)."""
        if self._fused is None:
            self._fused = False
            if (folder := self.fused_folder) is not None:
                from kokoro_opt.runtime.fused import FusedSpeaker
                from kokoro_opt.runtime.windowed import FRONT_OUTPUTS, WINDOWS_DIR, WindowGraphs

                front = WindowGraphs.of_folder(self.artifact.path / WINDOWS_DIR).front
                self._fused = FusedSpeaker(front, folder, FRONT_OUTPUTS, self.settings)
        return self._fused or None

    @property
    def gives_durations(self) -> bool:  # type: ignore[override]
        """kokoro-onnx's own graph has no durations output (`run_tokens` then gives none)."""
        return self.fused is not None or len(self.session.get_outputs()) > 1

    @property
    def loaded_fused(self) -> Any:
        """The FusedSpeaker if whole decoding already made one (a windowed decoder shares its generator)."""
        return self._fused or None

    def end_profiling(self) -> list[Path]:
        """The profiles of the sessions synthesis ran (SessionSettings.enable_profiling)."""
        if self.fused is not None:
            return self.fused.end_profiling()
        return [Path(self.session.end_profiling())]

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
        self,
        token_ids: list[int],
        voice: str | np.ndarray,
        speed: float = 1.0,
        cap_edges: bool = False,
        run_options: Any = None,
    ) -> SynthesisResult:
        """One utterance; `cap_edges` returns it without most of its edge silence (the durations stay whole);
        `run_options` can stop it within one graph node (a cancelled request)."""
        if not token_ids:
            raise UserError("nothing to say: the text has no pronounceable characters", "pass words, not only punctuation")
        pack = blend_voice(voice, self.packs) if isinstance(voice, str) else voice
        style = style_for(pack, len(token_ids))
        if not (cap_edges and self.edges) and self.fused is not None:
            audio, durations = self.fused.speak(model_feeds(token_ids, style, speed, names=self.fused.front_inputs), run_options)
            return SynthesisResult(audio / self.audio_gain, self.sample_rate, durations)
        feeds = self.feeds(token_ids, style, speed, cap_edges)
        outputs = self.session.run(None, feeds, run_options)
        audio = np.asarray(outputs[0], dtype=np.float32).reshape(-1) / self.audio_gain
        # kokoro-onnx's own graph has no durations output
        durations = np.asarray(outputs[1]).reshape(-1) if len(outputs) > 1 else np.zeros(0, dtype=np.int64)
        return SynthesisResult(audio, self.sample_rate, durations)
