"""An artifact folder, and how one is written: atomically, under a lock, with file hashes.

An artifact folder is self-contained: the model file, `voices.npz`, `kokoro.json` (vocab, sample
rate, weights provenance), its side files, `manifest.json` (what it is: kokoro_opt/manifest.py) and
`build.json` (what its build measured). Where folders live is the store's business (store.py); this
module knows one folder at a time. The lock and the temporary folder of a build sit beside the store's
folders (`.locks/`, `.tmp/`), not inside an output: an output holds its content and its records only.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.hashing import file_sha256
from kokoro_opt.machine import installed_versions
from kokoro_opt.manifest import (
    BUILD_RECORD,
    MANIFEST,
    RECORD_FILES,
    BuildRecord,
    Capabilities,
    FileEntry,
    Manifest,
    read_build_record,
    read_manifest,
)

MODEL_FILES = ("model.onnx", "model.ort", "model.mlpackage")
LOCKS = ".locks"
TEMPORARY = ".tmp"
# kokoro.json's "windows" key that says the windows stage found windowed speech within its default budget
WINDOWED_BY_DEFAULT = "served_by_default"


def file_hashes(folder: Path) -> dict[str, FileEntry]:
    """Every content file under `folder` (not the manifest, not the build's records) with its sha256 and size."""
    return {
        p.relative_to(folder).as_posix(): FileEntry(sha256=file_sha256(p), size=p.stat().st_size)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() not in (MANIFEST, *RECORD_FILES)
    }


def versions() -> dict[str, str]:
    """What a build ran with, for its record."""
    packages = ("kokoro-opt", "torch", "onnx", "onnxruntime", "kokoro", "onnxslim", "coremltools")
    return {"python": platform.python_version(), **installed_versions(packages)}


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


Fill = Callable[[Path], tuple[dict[str, Any], dict[str, Any]]]


def build_folder(final: Path, fill: Fill, root: Path | None = None) -> Path:
    """Run `fill(tmp)` in a temporary folder, write the manifest and build record it returns, rename into place.

    `fill` returns (manifest fields, build record); the manifest's `files` are hashed here. A folder with a
    manifest is complete by construction; anything else (a killed build's temporary folder) is never read
    and gets cleaned up by the next build of that folder. The lock and the temporary folder go under `root`
    (default: a store's, two levels up from <root>/<recipe>/<id>).
    """
    if (final / MANIFEST).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    slot = f"{final.parent.name}-{final.name}"  # unique in the store: <recipe>-<id>, _cache-<kind>-<key>
    root = root if root is not None else final.parent.parent
    locks, temporary = root / LOCKS, root / TEMPORARY
    locks.mkdir(exist_ok=True)
    temporary.mkdir(exist_ok=True)
    with _exclusive(locks / slot):
        if (final / MANIFEST).is_file():  # another process finished it while we waited
            return final
        for stale in temporary.glob(f"{slot}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = temporary / f"{slot}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()  # not mkdtemp: its 0700 would make the store unreadable to anyone else (a serving account)
        try:
            fields, record = fill(tmp)
            manifest = Manifest.model_validate({**fields, "files": file_hashes(tmp)})
            (tmp / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
            write_json_atomic(tmp / BUILD_RECORD, BuildRecord.model_validate(record).model_dump(mode="json"))
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
    """A built, self-contained model folder: its manifest (what it is) and build record (what was measured)."""

    path: Path
    manifest: Manifest

    @property
    def id(self) -> str:
        return self.manifest.id

    @property
    def name(self) -> str:
        return self.manifest.name or self.path.parent.name

    @property
    def capabilities(self) -> Capabilities:
        return self.manifest.capabilities

    @property
    def windowed_by_default(self) -> bool:
        """`serve` streams it windowed unless told otherwise: it can, and its windows stage measured the windowed
        speech within the stage's default_budget (the whole decoding's quality, recipe.WHOLE_QUALITY)."""
        return self.capabilities.windowed and bool(self.kokoro.get("windows", {}).get(WINDOWED_BY_DEFAULT))

    @cached_property
    def build(self) -> BuildRecord:
        return read_build_record(self.path)

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
        raise not_an_artifact(path)
    return Artifact(folder, read_manifest(folder))


def not_an_artifact(path: str | Path) -> UserError:
    """What a path given as an artifact is instead, and what to pass."""
    folder, wanted = Path(path), "pass artifacts/<recipe>/<id> or artifacts/<recipe>"
    if folder.suffix in (".yaml", ".yml") and folder.is_file():
        return UserError(f"{path} is a recipe, not an artifact", f"build it first: kokoro-opt build {path}")
    if not folder.exists():
        return UserError(f"no such folder: {path}", f"{wanted}, or build one: kokoro-opt build recipes/int8-mixed.yaml")
    return UserError(
        f"{path} is not an artifact folder (no {MANIFEST}, and no build of a recipe in it)",
        f"{wanted}, or build one: kokoro-opt build recipes/int8-mixed.yaml",
    )
