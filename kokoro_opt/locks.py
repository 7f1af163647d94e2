"""Locks for measured decisions, committed beside the recipe like a package lockfile.

The sensitivity analysis takes most of a from-scratch build, and its result (which blocks and
branches are INT8, which inputs are clipped) is what should be identical everywhere. A lock
records that result with the scores behind it and the machine that measured it, keyed by the
stage's decision key (config, input chain, data files: contract.Pass.decision_key). A build with
a matching lock applies the decisions without re-analysing, still runs the quality gate on the
result, and fails clearly when the gate no longer holds on this machine; `build --reanalyze`, or
any change of the inputs, measures again and rewrites the lock.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import write_json_atomic
from kokoro_opt.errors import UserError, first_problem, read_json

LOCK_VERSION = 1


def lock_path(recipe_file: Path) -> Path:
    """`recipes/int8-mixed.yaml` -> `recipes/int8-mixed.lock.json`."""
    return recipe_file.with_name(f"{recipe_file.stem}.lock.json")


def stage_slot(index: int, kind: str) -> str:
    """Which stage of the recipe a lock entry belongs to: its position and kind (`3:quantize`)."""
    return f"{index}:{kind}"


@dataclass(frozen=True)
class StageLock:
    decision_key: str
    decisions: dict[str, Any]
    scores: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    # A decision too large for JSON (the windows stage's statistics) is a file kept beside the lock:
    # its name within the stage's output -> its sha256 (`decision_files`, `lock_files`)
    files: dict[str, str] = field(default_factory=dict)


def files_folder(lock: Path, slot: str) -> Path:
    """Where a lock keeps a stage's decision files: `recipes/int8-mixed.lock.d/4-windows/`."""
    return lock.with_name(lock.name.removesuffix(".lock.json") + ".lock.d") / slot.replace(":", "-")


def keep_files(lock: Path, slot: str, output: Path, names: tuple[str, ...]) -> dict[str, str]:
    """Copy a stage's decision files from its output beside the lock; their sha256 for the lock entry. Copied into a
    folder of their own first, then swapped in: a copy that fails (a full disk) leaves the files the lock names."""
    import os
    import shutil
    import uuid

    from kokoro_opt.hashing import file_sha256

    folder = files_folder(lock, slot)
    staging, old = (folder.with_name(f".{folder.name}-{what}-{uuid.uuid4().hex[:12]}") for what in ("new", "old"))
    try:
        staging.mkdir(parents=True)
        kept = {}
        for name in names:
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(output / name, target)
            kept[name] = file_sha256(target)
        if folder.exists():
            os.replace(folder, old)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return kept


def lock_files(lock: Path, slot: str, entry: StageLock) -> dict[str, Path]:
    """The entry's decision files, each checked against the sha256 the lock recorded."""
    from kokoro_opt.hashing import file_sha256

    found = {}
    for name, digest in entry.files.items():
        path = files_folder(lock, slot) / name
        if not path.is_file() or file_sha256(path) != digest:
            raise UserError(
                f"{lock}: the decision file {path} of stage {slot} is missing or changed",
                "restore it from git, or rebuild with --reanalyze to measure and lock it again",
            )
        found[name] = path
    return found


def read_lock(path: Path) -> dict[str, StageLock]:
    """The lock's entries by stage slot; {} when there is no lock file."""
    if not path.is_file():
        return {}
    hint = "restore it from git, or rebuild with --reanalyze to rewrite it"
    data = read_json(path, hint, f"lock file {path}")
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(data, dict) or "stages" not in data:
        raise UserError(f"lock file {path} has no 'stages'", hint)
    if not isinstance(data.get("weights") or "", str):  # none: a lock from before locks named their weights
        raise UserError(f"lock file {path}: 'weights' must name the weights it was measured on, e.g. pypi-int8", hint)
    try:
        entries = TypeAdapter(dict[str, StageLock]).validate_python(data["stages"])
    except ValidationError as exc:
        raise UserError(f"lock file {path}, under 'stages': {first_problem(exc)}", hint) from None
    return entries


def parent_locks(lock: Path) -> list[Path]:
    """The locks of the recipes that `lock`'s recipe extends, nearest first: `int8-mixed-ort.yaml`
    appends stages to `int8-mixed.yaml`, and its quantize stage applies `int8-mixed.lock.json`."""
    import yaml

    found: list[Path] = []
    recipe = lock.with_name(lock.name.removesuffix(".lock.json") + ".yaml")
    while recipe.is_file() and len(found) < 16:
        parent = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("extends")
        if not isinstance(parent, str):
            break
        recipe = recipe.parent / parent
        found.append(lock_path(recipe))
    return found


def weights_lock(lock: Path, source: str) -> Path:
    """The lock of a recipe built from `source` weights (weights/sources.py: huggingface, pypi-int8, path, ...).

    Decisions are measured on the weights (the decision key hashes them), so each source keeps its own lock: the
    recipe's `<name>.lock.json` is that of the weights it was first measured on (its `weights` field; the
    committed ones: the PyPI weights every machine can get without the network), another source's is
    `<name>.<source>.lock.json` beside it. A build on other weights measures once and locks beside the committed
    lock instead of replacing it."""
    try:
        data = json.loads(lock.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # none, or unreadable: read_lock says so, --reanalyze rewrites it
        return lock
    measured_on = data.get("weights") if isinstance(data, dict) else None
    if measured_on in (None, source) or not isinstance(measured_on, str):  # None: a lock from before locks named
        return lock  # their weights, it applies where it fits; not a name: read_lock says so
    return lock.with_name(f"{lock.name.removesuffix('.lock.json')}.{source}.lock.json")


def read_locks(lock: Path, source: str | None = None) -> dict[str, tuple[StageLock, Path]]:
    """Each stage slot's entry and the lock it comes from: `lock` first, then its parents' locks, each the one of
    the `source` weights when given (`weights_lock`). An entry applies only where its decision key matches
    (build.py), so a parent's entry for a stage the child changed is measured again."""
    entries: dict[str, tuple[StageLock, Path]] = {}
    for path in [*reversed(parent_locks(lock)), lock]:
        path = weights_lock(path, source) if source is not None else path
        entries.update({slot: (entry, path) for slot, entry in read_lock(path).items()})
    return entries


def write_lock(path: Path, recipe: str, entries: dict[str, StageLock], weights: str | None = None) -> None:
    data = {
        "lock_version": LOCK_VERSION,
        "recipe": recipe,
        "note": "measured decisions of this recipe; kokoro-opt build applies them, build --reanalyze refreshes them",
        **({"weights": weights} if weights is not None else {}),  # the weights they were measured on
        "stages": {slot: asdict(entry) for slot, entry in sorted(entries.items())},
    }
    write_json_atomic(path, data)


def new_entry(decision_key: str, record: dict[str, Any], machine: dict[str, Any]) -> StageLock:
    """A stage's measured decisions as a lock entry; its decision files are added once they are kept (keep_files)."""
    return StageLock(
        decision_key=decision_key,
        decisions=record["decisions"],
        scores=record.get("decision_scores", {}),
        machine=machine,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
