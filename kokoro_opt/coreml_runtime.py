"""Running a Core ML artifact: front.onnx on ONNX Runtime, the decoder on Core ML. macOS only.

On other systems `CoreMLSynthesizer` raises a UserError naming the reason, and the evaluation
skips the artifact with that reason: no number is ever reported for a model that did not run.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.errors import UserError
from kokoro_opt.synth import SynthesisResult
from kokoro_opt.voices import blend_voice, style_for


def coreml_unavailable_reason() -> str | None:
    if platform.system() != "Darwin":
        return f"Core ML prediction needs macOS (this is {platform.system()}); the artifact was converted and its spec validated"
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return "coremltools is not installed: pip install 'kokoro-opt[coreml]'"
    return None


def is_coreml_artifact(artifact: Artifact) -> bool:
    return (artifact.path / "model.mlpackage").exists()


class CoreMLSynthesizer:
    """Same `run_tokens` contract as synth.Synthesizer, for split Core ML artifacts."""

    def __init__(self, artifact: Artifact | str | Path, compute_units: str = "ALL") -> None:
        reason = coreml_unavailable_reason()
        if reason:
            raise UserError(reason, "evaluate Core ML artifacts on a Mac")
        import coremltools as ct
        import onnxruntime as ort

        self.artifact = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
        meta = self.artifact.kokoro
        self.vocab, self.sample_rate = meta["vocab"], int(meta["sample_rate"])
        self.packs = self.artifact.voice_packs()
        self.front = ort.InferenceSession(str(self.artifact.path / "front.onnx"), providers=["CPUExecutionProvider"])
        self.decoder = ct.models.MLModel(
            str(self.artifact.path / "model.mlpackage"), compute_units=getattr(ct.ComputeUnit, compute_units)
        )

    def run_tokens(self, token_ids: list[int], voice: str | np.ndarray, speed: float = 1.0) -> SynthesisResult:
        pack = blend_voice(voice, self.packs) if isinstance(voice, str) else voice
        style = style_for(pack, len(token_ids))
        feeds = {
            "input_ids": np.array([[0, *token_ids, 0]], dtype=np.int64),
            "style": style,
            "speed": np.array([speed], np.float32),
        }
        asr, f0, noise, durations = self.front.run(None, feeds)
        audio = self.decoder.predict({"asr": asr, "f0": f0, "noise": noise, "style": style})["audio"]
        return SynthesisResult(
            np.asarray(audio, dtype=np.float32).reshape(-1), self.sample_rate, np.asarray(durations).reshape(-1)
        )
