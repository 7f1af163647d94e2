"""The artifact store: the one place that knows the folder layout and what a manifest holds.

    <root>/_cache/<kind>-<key>/     one stage output, addressed by its cache key (contract.Pass)
    <root>/<recipe>/<key>/          a recipe's result: the last stage's files, hard-linked; the folder
                                    built last is the recipe's current build (`best` passes over the rest)
    <root>/_peers/<name>/           models kokoro-opt did not build (kokoro-onnx's int8), for comparison

Every folder is written by `artifacts.build_folder` (temporary folder, rename, lock, file hashes)
and holds a manifest.json (kokoro_opt/manifest.py): the stage chain, the parent (the stage output
before the last), the reference export; its build.json records what the build measured and where.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact, Fill, build_folder, open_artifact, update_manifest
from kokoro_opt.errors import UserError
from kokoro_opt.manifest import MANIFEST, ChainStep

STAGE_CACHE = "_cache"
PEERS = "_peers"


def stage_chain(artifact: Artifact) -> list[ChainStep]:
    return list(artifact.manifest.chain)


@dataclass(frozen=True)
class Store:
    root: Path

    def stage_path(self, kind: str, key: str) -> Path:
        return self.root / STAGE_CACHE / f"{kind}-{key}"

    def recipe_path(self, recipe: str, key: str) -> Path:
        return self.root / recipe / key

    def peer_path(self, name: str) -> Path:
        return self.root / PEERS / name

    def stage(self, kind: str, key: str) -> Artifact | None:
        folder = self.stage_path(kind, key)
        return open_artifact(folder) if (folder / MANIFEST).is_file() else None

    def put_stage(self, kind: str, key: str, fill: Fill) -> Artifact:
        return open_artifact(build_folder(self.stage_path(kind, key), fill, built_here=True))

    def put_recipe(self, recipe: str, key: str, fill: Fill, fields: dict[str, Any] | None = None) -> Artifact:
        """The recipe's artifact, built or found; either way it becomes the recipe's newest build (what
        `artifacts/<recipe>` and `best` take): building an earlier recipe again makes it current again. `fields`:
        what the manifest records of the recipe; a found folder records them as they are now (its `evaluate:` or
        description may have been edited since: `evaluate` and `tune` read them there)."""
        folder = build_folder(self.recipe_path(recipe, key), fill, built_here=True)
        if fields is not None:
            update_manifest(folder, fields)
        with contextlib.suppress(OSError):  # a store on a read-only file system is read, not marked
            os.utime(folder)
        return open_artifact(folder)

    def put_peer(self, name: str, fill: Fill) -> Artifact:
        return open_artifact(build_folder(self.peer_path(name), fill, built_here=True))

    def exports(self) -> list[Artifact]:
        """Every cached export, newest first."""
        found = sorted((self.root / STAGE_CACHE).glob("export-*/" + MANIFEST), key=lambda p: p.stat().st_mtime, reverse=True)
        return _readable(p.parent for p in found)

    def artifacts(self) -> list[Artifact]:
        """Every recipe artifact (not the stage cache, not peers), newest last."""
        found = _readable(p.parent for p in self.root.glob("*/*/" + MANIFEST) if not p.parent.parent.name.startswith(("_", ".")))
        return sorted(found, key=lambda a: a.path.stat().st_mtime)

    def reference_export(self, artifact: Artifact) -> Artifact | None:
        """The fp32 export an artifact was built from (itself for an fp32 recipe)."""
        chain = stage_chain(artifact)
        if not chain or chain[0].kind != "export":
            return None
        return artifact if len(chain) == 1 and chain[0].key == artifact.id else self.stage("export", chain[0].key)

    def parent(self, artifact: Artifact) -> Artifact | None:
        """The stage output the artifact's last stage read (an .ort artifact's ONNX source)."""
        chain = stage_chain(artifact)
        return self.stage(chain[-2].kind, chain[-2].key) if len(chain) >= 2 else None


def _readable(folders: Iterable[Path]) -> list[Artifact]:
    """The folders whose manifest this version reads; one written by an older kokoro-opt (another manifest
    format) is passed over: its cache key no longer matches anything a build makes, so a build makes it anew."""
    found = []
    for folder in folders:
        with contextlib.suppress(UserError):
            found.append(open_artifact(folder))
    return found


def store_of(artifact: Artifact) -> Store:
    """The store a recipe artifact lives in (<root>/<recipe>/<key>) or a stage output (<root>/_cache/...)."""
    return Store(artifact.path.parent.parent)
