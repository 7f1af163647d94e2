"""An artifact's contract: what its folder holds (`manifest.json`) and what its build measured (`build.json`).

The manifest says what the artifact *is*, from its inputs alone: its id, the chain of stages that made
it, its recipe and weights, the side files it carries, what it can do (`Capabilities`) and every file's
sha256 and size. Two machines that build the same recipe on the same inputs write the same manifest,
byte for byte. What a build *measured* (gate scores, timings, the machine, when) differs from one run
to the next, so it goes to `build.json` beside it: a record, not content, never hashed or verified
(`RECORD_FILES`). Both are read and written here only, and both are checked: a manifest from elsewhere
(a fetched artifact) is untrusted input.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kokoro_opt.errors import UserError, read_json, read_validated
from kokoro_opt.recipe_yaml import NAME_PATTERN

MANIFEST = "manifest.json"
BUILD_RECORD = "build.json"
STAGE_LOG = "stage.log"
RECORD_FILES = (BUILD_RECORD, STAGE_LOG)  # what a build measured and printed: not part of the content
FORMAT = 2
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_id(value: str) -> str:
    """An artifact id is one folder name: letters, digits, '.', '_', '-'; never a path."""
    if not _ID.match(value) or ".." in value:
        raise ValueError(f"artifact id {value!r} is not a plain name (letters, digits, '.', '_', '-')")
    return value


def check_relative(name: str) -> str:
    """A file an artifact lists: a relative path inside its folder, never absolute or climbing out of it."""
    path = PurePosixPath(name)
    if not name or "\\" in name or path.is_absolute() or any(part in ("..", ".", "") for part in name.split("/")):
        raise ValueError(f"file name {name!r} is not a relative path inside the artifact folder")
    return name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class ChainStep(_Strict):
    """One stage of the chain that made an artifact: its kind and cache key (the stage's folder in the store)."""

    kind: str
    key: str

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        return check_id(value)


class Capabilities(_Strict):
    """What an artifact can do beyond speaking whole utterances, declared by the stages that made it
    (contract.Pass.grants / keeps): `edges` (the decoder can skip edge silence, `serve --cap-edges`),
    `windowed` (the generator runs in windows with its statistics, `serve --windowed`) and `fused` (whole decoding
    runs the generator's chains as native kernels, runtime/fused.py)."""

    edges: bool = False
    windowed: bool = False
    fused: bool = False

    @classmethod
    def of(cls, names: set[str] | list[str] | tuple[str, ...]) -> Capabilities:
        unknown = set(names) - set(cls.model_fields)
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}")
        return cls(**dict.fromkeys(names, True))

    def names(self) -> list[str]:
        return [name for name in type(self).model_fields if getattr(self, name)]


class WeightsInfo(_Strict):
    source: str
    sha256: str
    int8_rounded: bool = False
    note: str = ""


class Manifest(_Strict):
    """`manifest.json`: see the module docstring. `kind` is `export`, a stage kind, `recipe` or `peer`."""

    format: Literal[2] = FORMAT
    id: str
    kind: str
    chain: list[ChainStep] = Field(default_factory=list)
    parent: str | None = None  # the stage output before the last (an .ort artifact's ONNX source)
    reference_export: str | None = None  # the fp32 export it was built from
    recipe: dict[str, Any] | None = None
    recipe_hash: str | None = None
    decision_key: str | None = None
    weights: WeightsInfo | None = None
    side_files: list[str] = Field(default_factory=list)
    capabilities: Capabilities = Field(default_factory=Capabilities)
    external: bool = False  # a peer kokoro-opt did not build (kokoro-onnx's int8)
    inputs: str | None = None  # a peer's graph interface, when it differs from Kokoro's export
    files: dict[str, FileEntry] = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return check_id(value)

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for name in files:
            check_relative(name)
            if name in (MANIFEST, *RECORD_FILES):
                raise ValueError(f"{name} is not content and cannot be listed in files")
        return files

    @field_validator("recipe")
    @classmethod
    def _recipe(cls, recipe: dict[str, Any] | None) -> dict[str, Any] | None:
        """The recipe as built, older schemas included; what is read from it has its type: its name becomes folder,
        experiment and MLflow path names, and is printed."""
        if recipe is None:
            return None
        name = recipe.get("name")
        if name is not None and not (isinstance(name, str) and re.fullmatch(NAME_PATTERN, name)):
            raise ValueError(f"recipe.name {str(name)[:40]!r} is not a recipe name ({NAME_PATTERN})")
        for part in ("export", "weights", "evaluate"):
            if not isinstance(recipe.get(part, {}), dict):
                raise ValueError(f"recipe.{part} is not a mapping")
        stages = recipe.get("stages", [])
        if not (isinstance(stages, list) and all(isinstance(stage, dict) for stage in stages)):
            raise ValueError("recipe.stages is not a list of mappings")
        return recipe

    @field_validator("side_files")
    @classmethod
    def _side_files(cls, names: list[str]) -> list[str]:
        return [check_relative(name) for name in names]

    @property
    def name(self) -> str | None:
        return str(self.recipe.get("name")) if self.recipe and self.recipe.get("name") else None

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


class BuildRecord(BaseModel):
    """`build.json`: what making the artifact measured. `stages` holds each stage's own record (its gate's
    scores, decisions and their scores, timings), in chain order; `steps` whether each was cached and how
    long it took in this build."""

    model_config = ConfigDict(extra="allow")

    created: str = ""
    machine: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    stages: list[dict[str, Any]] = Field(default_factory=list)
    steps: list[dict[str, Any]] = Field(default_factory=list)
    # where `fetch` brought the folder from ("" for one built here): a build never takes a fetched folder as its
    # own cache, since an id hashes a stage's inputs, not the files a pusher put under it
    fetched_from: str = ""

    def find(self, kind: str) -> dict[str, Any] | None:
        """The record of the chain's last stage of this kind; None when this record has none (a chain without
        that stage, or an artifact fetched without its build record)."""
        return next((record for record in reversed(self.stages) if record.get("stage") == kind), None)

    def stage(self, kind: str) -> dict[str, Any]:
        """The record of the chain's last stage of this kind; UserError when the chain has none."""
        if (record := self.find(kind)) is not None:
            return record
        raise UserError(f"the artifact was not built with a {kind} stage", f"build a recipe with `- kind: {kind}`")


def parse_manifest(data: Any, origin: str) -> Manifest:
    """A manifest from a file or a remote run: every problem is one UserError naming `origin`."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "manifest"
        raise UserError(
            f"{origin}: its manifest is not valid ({where}: {first['msg'].removeprefix('Value error, ')})",
            "rebuild it with this version of kokoro-opt, or fetch it again from the machine that built it",
        ) from None


def read_manifest(folder: Path) -> Manifest:
    return parse_manifest(read_json(folder / MANIFEST, "rebuild the artifact, or fetch it again"), str(folder))


def read_build_record(folder: Path) -> BuildRecord:
    """The folder's build record; an empty one when there is none (a fetched artifact pushed without it)."""
    path = folder / BUILD_RECORD
    if not path.is_file():
        return BuildRecord()
    return read_validated(path, BuildRecord, "rebuild the artifact, or fetch it again")
