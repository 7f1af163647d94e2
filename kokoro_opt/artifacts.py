"""An artifact folder, and how one is written: atomically, under a lock, with file hashes.

An artifact folder is self-contained: the model file, `voices.npz`, `kokoro.json` (vocab, sample
rate, weights provenance) and `manifest.json`. Where folders live is the store's business
(store.py); this module knows one folder at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.hashing import file_sha256

MANIFEST = "manifest.json"
MODEL_FILES = ("model.onnx", "model.ort", "model.mlpackage")


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("kokoro-opt", "torch", "onnx", "onnxruntime", "kokoro", "onnxslim", "coremltools"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str), encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise builders of the same folder (two `kokoro-opt build` runs, DVC, a test and a user)."""
    import fcntl

    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_folder(final: Path, fill: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `fill(tmp)` in a temporary sibling, write its manifest, rename into place.

    A folder with a manifest is complete by construction; anything else (a killed build's
    temporary folder) is never read and gets cleaned up by the next build of that folder.
    """
    if (final / MANIFEST).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.parent / f".lock-{final.name}"):
        if (final / MANIFEST).is_file():  # another process finished it while we waited
            return final
        for stale in final.parent.glob(f".{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            manifest = fill(tmp)
            manifest["files"] = file_hashes(tmp)
            write_json_atomic(tmp / MANIFEST, manifest)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def link_or_copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target, copy_function=_link_file)
    else:
        _link_file(source, target)


def _link_file(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@dataclass(frozen=True)
class Artifact:
    """A built, self-contained model folder."""

    path: Path
    manifest: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.manifest["id"])

    @property
    def name(self) -> str:
        return str(self.manifest.get("recipe", {}).get("name", self.path.parent.name))

    @property
    def model_file(self) -> Path:
        for name in MODEL_FILES:
            if (self.path / name).exists():
                return self.path / name
        raise UserError(f"artifact {self.path} holds no model file", "rebuild it with kokoro-opt build")

    @property
    def kokoro(self) -> dict[str, Any]:
        return json.loads((self.path / "kokoro.json").read_text(encoding="utf-8"))

    def voice_packs(self) -> dict[str, np.ndarray]:
        with np.load(self.path / "voices.npz") as packs:
            return {name: packs[name] for name in packs.files}


def open_artifact(path: str | Path) -> Artifact:
    """Open an artifact folder, or a recipe folder (its newest build)."""
    folder = Path(path)
    if folder.is_dir() and not (folder / MANIFEST).is_file():
        builds = sorted((p for p in folder.iterdir() if (p / MANIFEST).is_file()), key=lambda p: p.stat().st_mtime)
        if builds:
            folder = builds[-1]
    if not (folder / MANIFEST).is_file():
        raise UserError(f"no artifact at {path}", "build one first: kokoro-opt build recipes/fp32.yaml")
    manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    return Artifact(folder, manifest)
