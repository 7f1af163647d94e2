"""Open any artifact kind with the runtime that runs it: the one place that decides."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.runtime.availability import is_coreml_artifact
from kokoro_opt.runtime.coreml import CoreMLSynthesizer
from kokoro_opt.runtime.session import SessionSettings
from kokoro_opt.runtime.synth import SynthesisResult, Synthesizer


def open_synthesizer(artifact: Artifact | str | Path, settings: SessionSettings | None = None) -> Synthesizer | CoreMLSynthesizer:
    """ONNX Runtime for model.onnx / model.ort, Core ML for model.mlpackage.

    A Core ML artifact that cannot run here raises `availability.coreml_problem`'s UserError
    (naming the ONNX artifact to use instead) rather than reaching onnxruntime."""
    opened = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
    if is_coreml_artifact(opened):
        return CoreMLSynthesizer(opened)
    return Synthesizer(opened, settings or SessionSettings())


def synthesize(
    artifact: Artifact | str | Path,
    text: str | None = None,
    *,
    phonemes: str | None = None,
    voice: str = "jf_alpha",
    speed: float = 1.0,
    on_chunk: Callable[[int, int], None] | None = None,
) -> SynthesisResult:
    """One-shot convenience: load the artifact, synthesize, return (audio, sample_rate, durations)."""
    return open_synthesizer(artifact).synthesize(text, phonemes=phonemes, voice=voice, speed=speed, on_chunk=on_chunk)
