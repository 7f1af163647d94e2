"""Running a Core ML artifact: front.onnx on ONNX Runtime, the decoder on Core ML. macOS only.

Core ML prediction needs macOS. Off macOS every command says so (serve refuses to start, evaluate
skips the artifact with the reason): no number is ever reported for a model that did not run, and
ONNX Runtime is never handed model.mlpackage (it fails with a protobuf error naming neither).
`coreml_problem` says why, and which ONNX artifact to use instead; `CoreMLSynthesizer` raises it.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.errors import UserError
from kokoro_opt.runtime.feeds import model_feeds
from kokoro_opt.runtime.synth import Speaker, SynthesisResult
from kokoro_opt.store import Store, stage_chain, store_of
from kokoro_opt.voices import blend_voice, style_for


def coreml_unavailable_reason() -> str | None:
    if platform.system() != "Darwin":
        return f"Core ML artifacts run on macOS only (prediction needs macOS; this is {platform.system()})"
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return "coremltools is not installed: pip install 'kokoro-opt[coreml]'"
    return None


def is_coreml_artifact(artifact: Artifact) -> bool:
    return (artifact.path / "model.mlpackage").exists()


def converted_from(artifact: Artifact, root: Path | None = None) -> Path | None:
    """The ONNX artifact a Core ML artifact was converted from (the stage before `coreml`), if still on disk.

    A recipe build with that id is preferred (its recipe folder when it is that recipe's newest build:
    the shortest thing to type), else the stage's own output in the store's cache.
    """
    chain = stage_chain(artifact)
    kinds = [entry.kind for entry in chain]
    if "coreml" not in kinds or kinds.index("coreml") == 0:
        return None
    source = chain[kinds.index("coreml") - 1]
    store = Store(root) if root is not None else store_of(artifact)
    builds = [a.path for a in store.artifacts() if a.id == source.key]
    if builds:
        newest = builds[-1]
        return newest.parent if open_artifact(newest.parent).path == newest else newest
    stage = store.stage(source.kind, source.key)
    return stage.path if stage is not None else None


def coreml_problem(artifact: Artifact) -> UserError | None:
    """Why this Core ML artifact cannot run here, with the ONNX artifact to use instead; None if it can
    (or is no Core ML artifact). ONNX Runtime must never be handed model.mlpackage: it fails with a
    protobuf error that names neither the cause nor the fix."""
    if not is_coreml_artifact(artifact):
        return None
    reason = coreml_unavailable_reason()
    if reason is None:
        return None
    source = converted_from(artifact)
    instead = (
        f"the ONNX artifact it was converted from: {source}"
        if source is not None
        else "an ONNX artifact, e.g. artifacts/fp32 or artifacts/int8-mixed"
    )
    return UserError(f"{artifact.name} {artifact.id[:8]} is a Core ML artifact: {reason}", f"use {instead}")


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
