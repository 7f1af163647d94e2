"""Open any artifact kind with the runtime that runs it: the one place that decides."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.runtime.availability import is_coreml_artifact
from kokoro_opt.runtime.coreml import CoreMLSynthesizer
from kokoro_opt.runtime.session import SessionSettings
from kokoro_opt.runtime.synth import Speaker, SynthesisResult, Synthesizer
from kokoro_opt.voices import DEFAULT_VOICE

__all__ = ["Speaker", "SynthesisResult", "Synthesizer", "open_synthesizer", "synthesize"]


def open_synthesizer(artifact: Artifact | str | Path, settings: SessionSettings | None = None) -> Speaker:
    """ONNX Runtime for model.onnx / model.ort, Core ML for model.mlpackage.

    A folder given by its path is checked against its manifest first (~0.3 s per 250 MB), as `say` and `serve`
    check theirs: a changed or damaged one is a UserError, not speech from files nobody built. A Core ML
    artifact that cannot run here raises `availability.coreml_problem`'s UserError (naming the ONNX artifact
    to use instead) rather than reaching onnxruntime."""
    if isinstance(artifact, Artifact):  # opened, and checked where it was found (select.resolve_artifact)
        opened = artifact
    else:
        opened = open_artifact(artifact)
        opened.check_intact()
    if is_coreml_artifact(opened):
        return CoreMLSynthesizer(opened)
    return Synthesizer(opened, settings or SessionSettings())


def synthesize(
    artifact: Artifact | str | Path,
    text: str | None = None,
    *,
    phonemes: str | None = None,
    voice: str = DEFAULT_VOICE,
    speed: float = 1.0,
    on_chunk: Callable[[int, int], None] | None = None,
) -> SynthesisResult:
    """One-shot convenience: load the artifact, synthesize, return (audio, sample_rate, durations)."""
    return open_synthesizer(artifact).synthesize(text, phonemes=phonemes, voice=voice, speed=speed, on_chunk=on_chunk)
