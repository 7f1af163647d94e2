"""Running a Core ML artifact: front.onnx on ONNX Runtime, the decoder on Core ML. macOS only.

Core ML prediction needs macOS. Off macOS every command says so (serve refuses to start, evaluate
skips the artifact with the reason): no number is ever reported for a model that did not run, and
ONNX Runtime is never handed model.mlpackage (it fails with a protobuf error naming neither).
`availability.coreml_problem` says why, and which ONNX artifact to use instead; `CoreMLSynthesizer` raises it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.runtime.availability import coreml_problem
from kokoro_opt.runtime.feeds import model_feeds
from kokoro_opt.runtime.session import make_session
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

        meta = self.artifact.kokoro
        self.vocab, self.sample_rate = meta["vocab"], int(meta.get("sample_rate", 24_000))  # as checked_kokoro allows
        self.packs = self.artifact.voice_packs()
        self.front = make_session(self.artifact.path / "front.onnx")  # its refusals as one line, as every session's
        self.decoder = ct.models.MLModel(
            str(self.artifact.path / "model.mlpackage"), compute_units=getattr(ct.ComputeUnit, compute_units)
        )
        self.max_frames = decoder_frame_limit(self.decoder.get_spec())
        # an utterance the decoder takes whole, at ~8 frames a token: a longer one is cut in two without its seam trimmed
        self.max_chunk_tokens = max(1, min(self.max_frames // 8, self.max_chunk_tokens))

    def run_tokens(self, token_ids: list[int], voice: str | np.ndarray, speed: float = 1.0) -> SynthesisResult:
        pack = blend_voice(voice, self.packs) if isinstance(voice, str) else voice
        style = style_for(pack, len(token_ids))
        feeds = model_feeds(token_ids, style, speed)
        asr, f0, noise, durations = self.front.run(None, feeds)
        if asr.shape[-1] > self.max_frames and len(token_ids) > 1:  # slow speech of a long job: two utterances
            cut = split_point(token_ids, self.vocab.get(" "))
            halves = [self.run_tokens(part, pack, speed) for part in (token_ids[:cut], token_ids[cut:])]
            audio = np.concatenate([h.audio for h in halves])
            return SynthesisResult(audio, self.sample_rate, np.concatenate([h.durations for h in halves]))
        audio = self.decoder.predict({"asr": asr, "f0": f0, "noise": noise, "style": style})["audio"]
        return SynthesisResult(
            np.asarray(audio, dtype=np.float32).reshape(-1), self.sample_rate, np.asarray(durations).reshape(-1)
        )


def decoder_frame_limit(spec: Any) -> int:
    """The most frames the converted decoder takes: the upper bound of its `asr` input's flexible length, which
    the coreml stage sets to max_tokens x 8 (room for speech at speed 1; slower speech of a long job has more)."""
    asr = next(item for item in spec.description.input if item.name == "asr")
    return int(asr.type.multiArrayType.shapeRange.sizeRanges[-1].upperBound)


def split_point(token_ids: list[int], space_id: int | None) -> int:
    """Where a job too long for the decoder is cut in two: the word boundary nearest its middle, else the middle."""
    middle = len(token_ids) // 2
    spaces = [i for i, token in enumerate(token_ids) if token == space_id and 0 < i < len(token_ids) - 1]
    return min(spaces, key=lambda i: abs(i - middle)) if spaces else middle
