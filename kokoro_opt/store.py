"""The artifact store: the one place that knows the folder layout and what a manifest holds.

    <root>/_cache/<kind>-<key>/     one stage output, addressed by its cache key (contract.Pass)
    <root>/<recipe>/<key>/          a recipe's result: the last stage's files, hard-linked
    <root>/_peers/<name>/           models kokoro-opt did not build (kokoro-onnx's int8), for comparison

Every folder is written by `artifacts.build_folder` (temporary folder, rename, lock, file hashes)
and holds a manifest.json. A recipe manifest carries the stage chain (`stage_cache`), its parent
(the stage output before the last), its reference export and the machine it was built on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import MANIFEST, Artifact, build_folder, open_artifact

STAGE_CACHE = "_cache"
PEERS = "_peers"


@dataclass(frozen=True)
class StageEntry:
    """One step of a recipe's chain as the manifest records it."""

    kind: str
    key: str
    cached: bool = False
    seconds: float = 0.0

    @classmethod
    def of(cls, entry: dict[str, Any]) -> StageEntry:
        return cls(str(entry["kind"]), str(entry["key"]), bool(entry.get("cached", False)), float(entry.get("seconds", 0.0)))


def stage_chain(artifact: Artifact) -> list[StageEntry]:
    return [StageEntry.of(e) for e in artifact.manifest.get("stage_cache") or []]


@dataclass(frozen=True)
class Store:
    root: Path

    def stage_path(self, kind: str, key: str) -> Path:
        return self.root / STAGE_CACHE / f"{kind}-{key}"

    def recipe_path(self, recipe: str, key: str) -> Path:
        return self.root / recipe / key

    def peer_path(self, name: str) -> Path:
        return self.root / PEERS / name

    def has_stage(self, kind: str, key: str) -> bool:
        return (self.stage_path(kind, key) / MANIFEST).is_file()

    def stage(self, kind: str, key: str) -> Artifact | None:
        folder = self.stage_path(kind, key)
        return open_artifact(folder) if (folder / MANIFEST).is_file() else None

    def put_stage(self, kind: str, key: str, fill: Callable[[Path], dict[str, Any]]) -> Artifact:
        return open_artifact(build_folder(self.stage_path(kind, key), fill))

    def put_recipe(self, recipe: str, key: str, fill: Callable[[Path], dict[str, Any]]) -> Artifact:
        return open_artifact(build_folder(self.recipe_path(recipe, key), fill))

    def put_peer(self, name: str, fill: Callable[[Path], dict[str, Any]]) -> Artifact:
        return open_artifact(build_folder(self.peer_path(name), fill))

    def exports(self) -> list[Artifact]:
        """Every cached export, newest first."""
        found = sorted((self.root / STAGE_CACHE).glob("export-*/" + MANIFEST), key=lambda p: p.stat().st_mtime, reverse=True)
        return [open_artifact(p.parent) for p in found]

    def artifacts(self) -> list[Artifact]:
        """Every recipe artifact (not the stage cache, not peers), newest last."""
        found = [
            open_artifact(p.parent) for p in self.root.glob("*/*/" + MANIFEST) if not p.parent.parent.name.startswith(("_", "."))
        ]
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


def store_of(artifact: Artifact) -> Store:
    """The store a recipe artifact lives in (<root>/<recipe>/<key>) or a stage output (<root>/_cache/...)."""
    return Store(artifact.path.parent.parent)
