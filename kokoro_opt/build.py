"""Run a recipe: weights -> export -> each optimisation stage, every step cached by content hash.

Like Olive's passes, a stage's output folder is keyed by everything it depends on (contract.Pass:
its config, its input's key, its code version, the data files it reads, its libraries), so a rerun
with nothing changed reuses every folder, and changing one stage's config or data rebuilds that
stage and what follows it only. Decisions a stage measured are applied from the recipe's lock
(locks.py) unless `reanalyze` is set or the stage's inputs changed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kokoro_opt.artifacts import Artifact, link_or_copy, versions
from kokoro_opt.contract import Pass
from kokoro_opt.export import PASS as EXPORT
from kokoro_opt.hashing import content_key
from kokoro_opt.locks import StageLock, new_entry, read_lock, read_locks, stage_slot, write_lock
from kokoro_opt.machine import fingerprint
from kokoro_opt.passes import PASSES
from kokoro_opt.recipe import Recipe
from kokoro_opt.store import Store
from kokoro_opt.weights.sources import ResolvedWeights, resolve_weights

STAGE_LOG = "stage.log"


@dataclass
class BuildResult:
    artifact: Artifact
    weights: ResolvedWeights
    stages: list[dict[str, Any]] = field(default_factory=list)  # {kind, key, cached, seconds}
    lock_written: Path | None = None


@contextlib.contextmanager
def third_party_output(log_file: Path) -> Iterator[None]:
    """What libraries print or log while a stage runs goes to the stage's log file, not the terminal:
    Python's stdout and logging, and native code writing to file descriptor 1 (onnxsim's C++).

    Scoped: stdout and the root logger's handlers and level are restored when the stage ends. The
    progress bar and the stage's own messages go to stderr and stay on screen."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    sys.stdout.flush()
    saved_fd = os.dup(1)
    with open(log_file, "a", encoding="utf-8") as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.handlers = [handler]
        root.setLevel(logging.INFO)
        os.dup2(sink.fileno(), 1)
        try:
            with contextlib.redirect_stdout(sink):
                yield
        finally:
            sink.flush()
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
            root.handlers, root.level = saved_handlers, saved_level


def _run_stage(
    store: Store, kind: str, key: str, fill: Callable[[Path], dict[str, Any]], log: list[dict[str, Any]], extra: dict[str, Any]
) -> Artifact:
    cached = store.has_stage(kind, key)
    started = time.perf_counter()

    def fill_with_manifest(tmp: Path) -> dict[str, Any]:
        with third_party_output(tmp / STAGE_LOG):
            record = fill(tmp)
        if not (tmp / STAGE_LOG).stat().st_size:
            (tmp / STAGE_LOG).unlink()
        return {"id": key, "kind": kind, "stage": record, **extra, "created": datetime.now(UTC).isoformat()}

    artifact = store.put_stage(kind, key, fill_with_manifest)
    log.append({"kind": kind, "key": key, "cached": cached, "seconds": round(time.perf_counter() - started, 2)})
    return artifact


def _decision_runner(p: Pass, decisions: dict[str, Any] | None) -> Callable[[Any, Any, Path], dict[str, Any]]:
    if not p.decides:
        return p.run
    return lambda source, cfg, out: p.run(source, cfg, out, decisions=decisions)  # type: ignore[call-arg]


def build(
    recipe: Recipe,
    root: Path = Path("artifacts"),
    console: Console | None = None,
    lock: Path | None = None,
    reanalyze: bool = False,
) -> BuildResult:
    """Build the recipe's artifact under `root/<recipe name>/<content id>/` and return it.

    `lock`: the recipe's lock file (locks.py); decisions found there are applied, new ones written."""
    console = console or Console(stderr=True)
    store = Store(root)
    log: list[dict[str, Any]] = []
    locked = read_locks(lock) if lock is not None and not reanalyze else {}
    new_locks: dict[str, StageLock] = {}
    machine = fingerprint()
    steps = ["weights", "export", *(stage.kind for stage in recipe.stages), "package"]
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        say = progress.console.print
        task = progress.add_task(f"{recipe.name}: weights", total=len(steps))
        weights = resolve_weights(recipe.weights, log=lambda msg: say(msg))
        progress.update(task, advance=1, description=f"{recipe.name}: export ({weights.source} weights)")

        weights_key = content_key(weights.sha256, weights.voices_sha256())
        decision_key = EXPORT.decision_key(recipe.export, weights_key)
        key = export_key = EXPORT.cache_key(recipe.export, weights_key)
        export_extra = {"parent": None, "reference_export": export_key}
        current = _run_stage(store, "export", key, lambda out: EXPORT.run(weights, recipe.export, out), log, export_extra)
        chain = [current.manifest["stage"]]
        progress.update(task, advance=1)
        for index, stage in enumerate(recipe.stages):
            progress.update(task, description=f"{recipe.name}: {stage.kind}")
            p = PASSES[stage.kind]
            decision_key = p.decision_key(stage, decision_key)
            slot = stage_slot(index, stage.kind)
            decisions = None
            if p.decides and slot in locked:
                entry, source_lock = locked[slot]
                if entry.decision_key == decision_key:
                    decisions = entry.decisions
                    say(f"{stage.kind}: applying the decisions locked in {source_lock} (build --reanalyze to measure again)")
                else:
                    say(f"{stage.kind}: the inputs changed since {source_lock} was written: analysing again")
            parent_key, source, runner = key, current, _decision_runner(p, decisions)
            key = p.cache_key(stage, parent_key, {"decisions": decisions} if decisions is not None else None)
            extra = {"parent": parent_key, "reference_export": export_key}
            current = _run_stage(store, stage.kind, key, lambda out, s=stage, a=source, r=runner: r(a, s, out), log, extra)
            record = current.manifest["stage"]
            chain.append(record)
            if p.decides and decisions is None and "decisions" in record:
                new_locks[slot] = new_entry(decision_key, record, machine)
            elif p.decides and decisions is not None and record.get("decisions", decisions) != decisions:
                # a lock from before the stage pinned more of what it measured (calibration ranges): complete it
                new_locks[slot] = replace(locked[slot][0], decisions=record["decisions"])
            progress.update(task, advance=1)

        progress.update(task, description=f"{recipe.name}: package")
        final, parent = current, (log[-2]["key"] if len(log) > 1 else None)

        def package(out: Path) -> dict[str, Any]:
            for item in final.path.iterdir():
                if item.name != "manifest.json":
                    link_or_copy(item, out / item.name)
            return {
                "id": key,
                "kind": "recipe",
                "recipe": recipe.model_dump(mode="json", by_alias=True),
                "recipe_hash": recipe.config_hash(),
                "weights": {
                    "source": weights.source,
                    "sha256": weights.sha256,
                    "int8_rounded": weights.int8_rounded,
                    "note": weights.note,
                },
                "stages": chain,
                "stage_cache": log,
                "parent": parent,
                "reference_export": export_key,
                "decision_key": decision_key,
                "versions": versions(),
                "machine": machine,
                "created": datetime.now(UTC).isoformat(),
            }

        artifact = store.put_recipe(recipe.name, key, package)
        progress.update(task, advance=1, description=f"{recipe.name}: done")
    written = None
    if lock is not None and new_locks:
        write_lock(lock, recipe.name, {**read_lock(lock), **new_locks})
        written = lock
        console.print(f"wrote {lock}: the measured decisions; commit it so other machines build the same artifact")
    return BuildResult(artifact=artifact, weights=weights, stages=log, lock_written=written)
