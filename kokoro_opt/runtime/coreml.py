"""Running a Core ML artifact: front.onnx on ONNX Runtime, the decoder on Core ML. macOS only.

Core ML prediction needs macOS. Off macOS every command says so (serve refuses to start, evaluate
skips the artifact with the reason): no number is ever reported for a model that did not run, and
ONNX Runtime is never handed model.mlpackage (it fails with a protobuf error naming neither).
`availability.coreml_problem` says why, and which ONNX artifact to use instead; `CoreMLSynthesizer` raises it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.runtime.availability import coreml_problem
from kokoro_opt.runtime.feeds import model_feeds
from kokoro_opt.runtime.synth import Speaker, SynthesisResult
from kokoro_opt.voices import blend_voice, style_for


class CoreMLSynthesizer(Speaker):
    """Same contract as synth.Synthesizer (`run_tokens`, `synthesize`), for split Core ML artifacts."""

    def __init__(self, artifact: Artifact | str | Path, compute_units: str = "ALL") -> None:
        self.artifact = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
        problem = coreml_problem(self.artifact)
        if problem is not None:
            raise problem
        import coremltools as ct
        import onnxruntime as ort

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
        feeds = model_feeds(token_ids, style, speed)
        asr, f0, noise, durations = self.front.run(None, feeds)
        audio = self.decoder.predict({"asr": asr, "f0": f0, "noise": noise, "style": style})["audio"]
        return SynthesisResult(
            np.asarray(audio, dtype=np.float32).reshape(-1), self.sample_rate, np.asarray(durations).reshape(-1)
        )
