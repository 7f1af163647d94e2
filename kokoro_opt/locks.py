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
from kokoro_opt.errors import UserError

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


def read_lock(path: Path) -> dict[str, StageLock]:
    """The lock's entries by stage slot; {} when there is no lock file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {slot: StageLock(**entry) for slot, entry in data["stages"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"lock file {path} is not readable ({exc})", "delete it, or rebuild with --reanalyze to rewrite it"
        ) from None


def write_lock(path: Path, recipe: str, entries: dict[str, StageLock]) -> None:
    data = {
        "lock_version": LOCK_VERSION,
        "recipe": recipe,
        "note": "measured decisions of this recipe; kokoro-opt build applies them, build --reanalyze refreshes them",
        "stages": {slot: asdict(entry) for slot, entry in sorted(entries.items())},
    }
    write_json_atomic(path, data)


def new_entry(decision_key: str, record: dict[str, Any], machine: dict[str, Any]) -> StageLock:
    return StageLock(
        decision_key=decision_key,
        decisions=record["decisions"],
        scores=record.get("decision_scores", {}),
        machine=machine,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
