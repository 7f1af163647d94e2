"""Running a Core ML artifact: front.onnx on ONNX Runtime, the decoder on Core ML. macOS only.

On other systems `coreml_problem` says why (and which ONNX artifact to use instead):
`CoreMLSynthesizer` raises it, serve refuses to start, and the evaluation skips the artifact with
that reason: no number is ever reported for a model that did not run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.coreml_support import (  # noqa: F401  (re-exported)
    converted_from,
    coreml_problem,
    coreml_unavailable_reason,
    is_coreml_artifact,
)
from kokoro_opt.feeds import model_feeds
from kokoro_opt.synth import Speaker, SynthesisResult
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
