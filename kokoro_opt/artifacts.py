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
import logging
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

from kokoro_opt.errors import UserError, read_arrays, read_json_object
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

log = logging.getLogger("kokoro_opt.store")
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
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # its own: two writers must not share one
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def files_mismatch(found: dict[str, FileEntry], expected: dict[str, FileEntry]) -> str | None:
    """The first way a folder's files (`file_hashes`) differ from what its manifest lists; None when they match."""
    for name, entry in sorted(expected.items()):
        if name not in found:
            return f"{name} is missing"
        if found[name].sha256 != entry.sha256:
            return f"{name} does not match its manifest (sha256 {found[name].sha256[:12]}... != {entry.sha256[:12]}...)"
    extra = sorted(set(found) - set(expected))
    return f"{extra[0]} is not in its manifest" if extra else None


REBUILD = "the folder was changed or damaged: build it again (kokoro-opt build <its recipe>)"


def folder_damage(folder: Path, manifest: Manifest | None = None) -> str | None:
    """What makes a finished folder untrustworthy now: a manifest or build record this version cannot read, a symbolic
    link, or a file changed, missing or added since it was written. None: intact. Hashing its files is what reusing it costs
    (~0.3 s per 250 MB), paid so that a damaged stage output is built again instead of carried into a new artifact."""
    if manifest is None:
        try:
            manifest = read_manifest(folder)
        except UserError as exc:
            return exc.message
    if link := first_link(folder):
        return f"{link.relative_to(folder)} is a symbolic link"
    try:  # not among the hashed files (it records how the folder was made), but read by every build that reuses it
        read_build_record(folder)
    except UserError as exc:
        return exc.message
    return files_mismatch(file_hashes(folder), manifest.files)


def first_link(folder: Path) -> Path | None:
    """A symbolic link anywhere in a folder about to be trusted (it could lead anywhere); None: plain files only."""
    return next((p for p in folder.rglob("*") if p.is_symlink()), None)


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise builders of the same folder (two `kokoro-opt build` runs, DVC, a test and a user)."""
    import fcntl

    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_stale_temporaries(root: Path) -> None:
    """The temporary folders killed builds left under a store (or the weights cache), whatever they were building:
    one whose slot nobody holds the lock of is no one's. `build_folder` clears only its own slot's."""
    import fcntl

    for stale in sorted((root / TEMPORARY).glob("*")) if (root / TEMPORARY).is_dir() else []:
        slot = root / LOCKS / stale.name.rsplit("-", 1)[0]
        with contextlib.suppress(OSError), open(slot, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a build of that slot is running now
            shutil.rmtree(stale, ignore_errors=True)
            fcntl.flock(handle, fcntl.LOCK_UN)


Fill = Callable[[Path], tuple[dict[str, Any], dict[str, Any]]]


def build_folder(final: Path, fill: Fill, root: Path | None = None, built_here: bool = False) -> Path:
    """Run `fill(tmp)` in a temporary folder, write the manifest and build record it returns, rename into place.

    `fill` returns (manifest fields, build record); the manifest's `files` are hashed here. A folder with a
    manifest is complete by construction, and reused while its files still match it (`folder_damage`); a
    damaged one is built again, with a warning. `built_here` (a build's stage outputs and results): a folder
    `fetch` brought is built again too. A killed build's temporary folder is never read: the next build
    of that folder, or any build's start (`remove_stale_temporaries`), removes it. The lock and the temporary
    folder go under `root` (default: a store's, two levels up from <root>/<recipe>/<id>).
    """
    if (final / MANIFEST).is_file() and _not_reusable(final, built_here) is None:
        return final
    slot = f"{final.parent.name}-{final.name}"  # unique in the store: <recipe>-<id>, _cache-<kind>-<key>
    root = root if root is not None else final.parent.parent
    locks, temporary = root / LOCKS, root / TEMPORARY
    locks.mkdir(parents=True, exist_ok=True)
    temporary.mkdir(exist_ok=True)
    if final.parent.is_dir() and final.parent.stat().st_dev != temporary.stat().st_dev:  # before the work: no rename
        raise UserError(  # from one to the other (EXDEV), and copying would not be atomic
            f"{final.parent} is on another file system than {temporary}, where its folders are made",
            "keep a store on one file system: link or mount the whole artifacts folder, or pass --artifacts there",
        )
    with exclusive(locks / slot):
        if (final / MANIFEST).is_file():  # another process finished it while we waited, or it was damaged since
            if (why := _not_reusable(final, built_here)) is None:
                return final
            log.warning("%s: %s; making it again", final, why)
        for stale in temporary.glob(f"{slot}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = temporary / f"{slot}-{uuid.uuid4().hex[:12]}"
        replaced = temporary / f"{slot}-old{uuid.uuid4().hex[:12]}"  # a damaged or fetched folder, moved aside
        tmp.mkdir()  # not mkdtemp: its 0700 would make the store unreadable to anyone else (a serving account)
        try:
            fields, record = fill(tmp)
            manifest = Manifest.model_validate({**fields, "files": file_hashes(tmp)})
            (tmp / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
            write_json_atomic(tmp / BUILD_RECORD, BuildRecord.model_validate(record).model_dump(mode="json"))
            with contextlib.suppress(FileNotFoundError):  # replaced: a reader (a server loading it, `/v1/models`)
                os.replace(final, replaced)  # never finds it gone for longer than between two renames
            final.parent.mkdir(parents=True, exist_ok=True)  # only now: a fill that failed leaves no empty folder
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(replaced, ignore_errors=True)
    return final


def _not_reusable(final: Path, built_here: bool) -> str | None:
    """Why a finished folder is not taken as it is: damaged, or (`built_here`) fetched. None: reuse it."""
    if (damage := folder_damage(final)) is not None:
        return damage
    if built_here and (origin := read_build_record(final).fetched_from):
        return f"fetched from {origin}, and a build takes as its own only what it built"
    return None


def update_manifest(folder: Path, fields: dict[str, Any]) -> None:
    """Rewrite a folder's manifest with `fields` changed, atomically, its files untouched (so still intact): what a
    recipe records of itself (its evaluate settings, its description) may change while its stages stay cached."""
    manifest = read_manifest(folder)
    if all(getattr(manifest, name) == value for name, value in fields.items()):
        return
    updated = Manifest.model_validate({**manifest.model_dump(mode="json"), **fields})
    tmp = folder / f".{MANIFEST}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        tmp.write_text(updated.to_json(), encoding="utf-8")
        os.replace(tmp, folder / MANIFEST)  # a reader sees the old manifest or the new one
    finally:
        tmp.unlink(missing_ok=True)


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
        return self.capabilities.windowed and self.kokoro.get("windows", {}).get(WINDOWED_BY_DEFAULT) is True

    def damage(self) -> str | None:
        """What changed or damaged the folder since its manifest was written; None: intact. A manifest without file
        hashes (an older kokoro-opt's, or emptied by hand) vouches for nothing: the folder is not trusted either."""
        if not self.manifest.files:
            return "its manifest lists no file hashes (an older kokoro-opt made it)"
        return folder_damage(self.path, self.manifest)

    def check_intact(self, hint: str | None = None) -> None:
        """Refuse a folder changed or damaged since its manifest was written (not measured, served or pushed as
        what its id names). The default hint is how to get it back: fetched, fetch it again (seconds); else build it."""
        if damage := self.damage():
            raise UserError(f"artifact {self.id} at {self.path}: {damage}", hint or self._repair())

    def _repair(self) -> str:
        try:
            origin = read_build_record(self.path).fetched_from
        except UserError:  # the record is what was damaged
            origin = ""
        if origin:
            store = self.path.parent.parent
            return (f"the folder was changed or damaged since it was fetched ({origin}): fetch it again, "
                    f"kokoro-opt fetch {self.id} --artifacts {store} (with the --tracking-uri it came from)")  # fmt: skip
        return REBUILD

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
        """kokoro.json: what running the artifact needs besides its graphs (vocab, sample rate, the windows stage's
        settings, ...). Checked where it is read, as a fetched artifact's files are untrusted."""
        return checked_kokoro(read_json_object(self.path / "kokoro.json", _FETCH_AGAIN), self.path / "kokoro.json")

    @property
    def voice_names(self) -> list[str]:
        """The voices voices.npz holds, sorted, by name only: no pack is read (`voice_packs` checks them)."""
        import zipfile

        path = self.path / "voices.npz"
        try:
            with zipfile.ZipFile(path) as archive:
                return sorted(name.removesuffix(".npy") for name in archive.namelist())
        except (OSError, zipfile.BadZipFile) as exc:
            raise UserError(f"{path} is not readable ({type(exc).__name__})", _FETCH_AGAIN) from None

    def voice_packs(self) -> dict[str, np.ndarray]:
        """Each voice's style table: (positions, 1, style width) floats, one shape for all, every value finite."""
        path = self.path / "voices.npz"
        packs = read_arrays(path, _FETCH_AGAIN)
        shapes = {pack.shape for pack in packs.values()}
        bad = [n for n, p in packs.items() if p.dtype.kind != "f" or p.ndim != 3 or p.shape[1] != 1 or not np.isfinite(p).all()]
        if not packs or bad or len(shapes) != 1 or min(next(iter(shapes))) < 1:
            detail = f"{bad[0]} is a {packs[bad[0]].dtype} array of shape {packs[bad[0]].shape}" if bad else f"shapes {shapes}"
            raise UserError(f"{path} does not hold voice style tables ({detail})", _FETCH_AGAIN)
        return packs


_FETCH_AGAIN = "rebuild the artifact, or fetch it again"


def checked_kokoro(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """kokoro.json's fields of known type, or one UserError naming the first that is not."""
    vocab, windows = meta.get("vocab"), meta.get("windows", {})
    problem = None
    if not (
        isinstance(vocab, dict)
        and vocab
        and all(isinstance(k, str) and type(v) is int and 0 <= v < 1024 for k, v in vocab.items())
    ):
        problem = "vocab is not a map of symbols to token ids"
    elif not (type(meta.get("sample_rate", 24_000)) is int and 8_000 <= meta.get("sample_rate", 24_000) <= 192_000):
        problem = "sample_rate is not a rate in Hz"
    elif type(meta.get("audio_gain", 1.0)) not in (int, float) or not 0 < meta.get("audio_gain", 1.0) < 1e3:
        problem = "audio_gain is not a positive gain"
    elif not (isinstance(windows, dict) and all(type(v) in (int, float, bool) for v in windows.values())):
        problem = "windows is not a map of settings to numbers"
    elif steps := [k for k, v in windows.items() if k in WINDOW_STEP_SETTINGS and not _steps(k, v)]:
        problem = f"windows.{steps[0]} is {windows[steps[0]]!r}, not a number of steps"
    elif "edges" in meta and not (
        isinstance(edges := meta["edges"], dict) and all(_steps(k, edges.get(k)) for k in ("lead_frames", "trail_frames"))
    ):
        problem = "edges is not a map of lead_frames and trail_frames to numbers of frames"
    elif not (isinstance(weights := meta.get("weights", {}), dict) and isinstance(weights.get("source", ""), str)):
        problem = "weights is not a map with a source name"
    if problem:
        raise UserError(f"{path}: {problem}", _FETCH_AGAIN)
    return meta


# kokoro.json's window settings (runtime.windowed.WindowSettings' fields, tests/test_untrusted_artifacts.py)
WINDOW_STEP_SETTINGS = ("first_steps", "steps", "overlap_steps", "lead_overlap_steps", "lead_frames", "trail_frames",
                        "finish_steps", "bridge_overlap_steps")  # fmt: skip


def _steps(name: str, value: Any) -> bool:
    """A window setting the windows stage writes: a whole number of steps (frames), within reach."""
    return type(value) is int and (1 if name in ("first_steps", "steps") else 0) <= value <= 100_000


def open_artifact(path: str | Path) -> Artifact:
    """Open an artifact folder, or a recipe folder (its newest build)."""
    folder = Path(path)
    inside = folder.resolve().name.startswith(("_", "."))  # the store's own folders (_cache, _peers, .tmp): no recipe's
    if folder.is_dir() and not (folder / MANIFEST).is_file() and not inside:
        builds = sorted((p for p in folder.iterdir() if (p / MANIFEST).is_file()), key=lambda p: p.stat().st_mtime)
        if builds:
            folder = builds[-1]
    if not (folder / MANIFEST).is_file():
        raise not_an_artifact(path)
    return Artifact(folder, read_manifest(folder))


def not_an_artifact(path: str | Path) -> UserError:
    """What a path given as an artifact is instead, and what to pass."""
    folder, wanted = Path(path), "pass artifacts/<recipe>/<id> or artifacts/<recipe>"
    if not str(path).strip():
        return UserError("the artifact given is an empty name", wanted)
    if folder.suffix in (".yaml", ".yml") and folder.is_file():
        return UserError(f"{path} is a recipe, not an artifact", f"build it first: kokoro-opt build {path}")
    if not folder.exists():
        return UserError(f"no such folder: {path}", f"{wanted}, or build one: kokoro-opt build recipes/int8-mixed.yaml")
    return UserError(
        f"{path} is not an artifact folder (no {MANIFEST}, and no build of a recipe in it)",
        f"{wanted}, or build one: kokoro-opt build recipes/int8-mixed.yaml",
    )
