"""Whether an artifact can run on this machine, and what to use instead when it cannot.

Core ML prediction needs macOS. Off macOS every command says so (serve refuses to start, evaluate
skips the artifact with the reason): no number is ever reported for a model that did not run.
"""

from __future__ import annotations

import platform
from pathlib import Path

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.errors import UserError
from kokoro_opt.store import Store, stage_chain, store_of


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


def runtime_problem(artifact: Artifact) -> UserError | None:
    """Why `artifact` cannot run on this machine (a Core ML artifact off macOS), or None.

    Serve and evaluate ask before loading anything: serve refuses to start, evaluate skips it."""
    return coreml_problem(artifact)
