"""Run a recipe: weights -> export -> each optimisation stage, every step cached by content hash.

Like Olive's passes, a stage's output folder is keyed by everything it depends on (contract.Pass:
its config, its input's key, its code, the data files it reads, its libraries), so a rerun with
nothing changed reuses every folder, and changing one stage's config, data or code rebuilds that
stage and what follows it only. Decisions a stage measured are applied from the recipe's lock
(locks.py) unless `reanalyze` is set or the stage's inputs changed.

This module is the engine that owns the artifact folders: it gives each pass its input's runtime
files, carries forward the side files a pass declares still true (`Pass.carries`), refuses a pass
that wrote what it did not declare, derives each output's capabilities from the declarations and
writes every manifest (kokoro_opt/manifest.py). Passes write their own outputs only.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn

from kokoro_opt.artifacts import MODEL_FILES, Artifact, link_or_copy, remove_stale_temporaries, versions
from kokoro_opt.contract import Pass, check_order, declared_outputs
from kokoro_opt.errors import UserError
from kokoro_opt.export import PASS as EXPORT
from kokoro_opt.locks import (
    StageLock,
    keep_files,
    lock_files,
    new_entry,
    read_lock,
    read_locks,
    stage_slot,
    weights_lock,
    write_lock,
)
from kokoro_opt.machine import fingerprint
from kokoro_opt.manifest import MANIFEST, RECORD_FILES, STAGE_LOG, Capabilities, ChainStep
from kokoro_opt.passes import PASSES
from kokoro_opt.paths import user_cache
from kokoro_opt.recipe import Recipe
from kokoro_opt.store import Store
from kokoro_opt.tables import make_progress
from kokoro_opt.weights.sources import ResolvedWeights, resolve_weights

RUNTIME_FILES = ("voices.npz", "kokoro.json")  # every artifact's: what speaking needs besides the model


@dataclass
class BuildResult:
    artifact: Artifact
    weights: ResolvedWeights
    stages: list[dict[str, Any]] = field(default_factory=list)  # {kind, key, cached, seconds}
    lock_written: Path | None = None
    locks: tuple[Path, ...] = ()  # the locks its decisions come from, a parent recipe's too: what push sends


@contextlib.contextmanager
def third_party_output(log_file: Path) -> Iterator[None]:
    """What libraries print or log while a stage runs goes to the stage's log file, not the terminal:
    Python's stdout, stderr (progress bars such as coremltools' tqdm, warnings) and logging, and native code
    writing to file descriptor 1 (onnxsim's C++).

    Scoped: everything is restored when the stage ends. The build's own progress bar and messages keep the
    terminal: its console is bound to the real stderr before any stage runs (`build`)."""
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
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
        finally:
            sink.flush()
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
            root.handlers, root.level = saved_handlers, saved_level


def chain_of(recipe: Recipe) -> list[Pass]:
    """The recipe's passes after the export, checked against each other's declarations."""
    unknown = [stage.kind for stage in recipe.stages if stage.kind not in PASSES]
    if unknown:
        raise UserError(f"recipe {recipe.name}: no stage '{unknown[0]}'", f"use one of {', '.join(sorted(PASSES))}")
    check_order([EXPORT.kind, *(stage.kind for stage in recipe.stages)], {EXPORT.kind: EXPORT, **PASSES})
    return [PASSES[stage.kind] for stage in recipe.stages]


def _side_files(folder: Path) -> list[str]:
    """What a folder holds besides the model, the runtime files and the records (top-level names)."""
    plain = {*MODEL_FILES, *RUNTIME_FILES, MANIFEST, *RECORD_FILES}
    return sorted(p.name for p in folder.iterdir() if p.name not in plain)


def prepare_output(source: Artifact | None, out: Path) -> None:
    """The runtime files of the input, for the pass to read and amend (kokoro.json's runtime settings)."""
    if source is not None:
        for name in RUNTIME_FILES:
            shutil.copy2(source.path / name, out / name)


def _carry(p: Pass, source: Artifact | None, out: Path) -> None:
    """Copy the input's side files the pass declares still true, where the pass did not write them itself;
    then refuse anything the pass wrote that it did not declare."""
    if source is not None:
        for name in p.carries:
            if (source.path / name).exists() and not (out / name).exists():
                link_or_copy(source.path / name, out / name)
    allowed = declared_outputs(p)
    stray = [name for name in _side_files(out) if not any(fnmatch.fnmatch(name, pattern) for pattern in allowed)]
    if stray:
        raise UserError(
            f"stage '{p.kind}' wrote {stray[0]}, which it does not declare",
            f"add it to the stage's Pass(produces=...) in kokoro_opt/passes/{p.kind}.py",
        )


def _capabilities(p: Pass, source: Artifact | None) -> Capabilities:
    held = set(source.capabilities.names()) if source is not None else set()
    return Capabilities.of((held & set(p.keeps)) | set(p.grants))


class _Engine:
    """One build's bookkeeping: the store, the chain so far, the steps' timings and the records."""

    def __init__(self, store: Store, machine: dict[str, Any], checks: Sequence[Callable[[], object]] = ()) -> None:
        """`checks`: what the chain's stages need of this machine, asked before the first stage that is not cached
        (an artifact whose every stage is cached builds without them)."""
        self.store, self.machine, self.checks = store, machine, list(checks)
        self.chain: list[ChainStep] = []
        self.steps: list[dict[str, Any]] = []  # {kind, key, cached, seconds}
        self.records: list[dict[str, Any]] = []

    def run(
        self,
        p: Pass,
        key: str,
        source: Artifact | None,
        runner: Callable[[Path], dict[str, Any]],
        reference_export: str,
    ) -> Artifact:
        started = time.perf_counter()
        chain = [*self.chain, ChainStep(kind=p.kind, key=key)]
        ran: list[bool] = []  # the cache had no intact output: it was built here (another build may have waited)

        def fill(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
            while self.checks:
                self.checks.pop(0)()
            ran.append(True)
            prepare_output(source, tmp)
            with third_party_output(tmp / STAGE_LOG):
                record = runner(tmp)
            if not (tmp / STAGE_LOG).stat().st_size:
                (tmp / STAGE_LOG).unlink()
            _carry(p, source, tmp)
            fields = {
                "id": key,
                "kind": p.kind,
                "chain": [step.model_dump() for step in chain],
                "parent": source.id if source is not None else None,
                "reference_export": reference_export,
                "side_files": _side_files(tmp),
                "capabilities": _capabilities(p, source).model_dump(),
            }
            return fields, {"created": _now(), "machine": self.machine, "versions": versions(), "stages": [record]}

        artifact = self.store.put_stage(p.kind, key, fill)
        self.chain = chain
        self.steps.append({"kind": p.kind, "key": key, "cached": not ran, "seconds": round(time.perf_counter() - started, 2)})
        self.records.append(artifact.build.stages[-1] if artifact.build.stages else {"stage": p.kind})
        return artifact


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


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
    console.file = console.file  # bound to the terminal now: a stage's own stderr goes to its log (third_party_output)
    passes = chain_of(recipe)
    for store_root in (root, user_cache()):
        remove_stale_temporaries(store_root)
    engine = _Engine(Store(root), fingerprint(), [p.machine_check for p in passes if p.machine_check is not None])
    new_locks: dict[str, StageLock] = {}
    decided: dict[str, tuple[Path, tuple[str, ...]]] = {}  # slot -> (stage output, its decision files)
    applied_from: list[Path] = []  # the locks whose decisions were applied
    steps = ["weights", "export", *(stage.kind for stage in recipe.stages), "package"]
    with make_progress(
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
        weights = resolve_weights(recipe.weights, log=say)
        locked = read_locks(lock, weights.source) if lock is not None and not reanalyze else {}
        if lock is not None and (beside := weights_lock(lock, weights.source)) != lock:
            say(f"{lock.name} holds decisions measured on other weights; these ({weights.source}) are locked in {beside.name}")
            lock = beside
        progress.update(task, advance=1, description=f"{recipe.name}: export ({weights.source} weights)")

        decision_key = EXPORT.decision_key(recipe.export, weights.decision_key())
        key = export_key = EXPORT.cache_key(recipe.export, weights.cache_key())
        current = engine.run(EXPORT, key, None, lambda out: EXPORT.run(weights, recipe.export, out), export_key)
        progress.update(task, advance=1)
        for index, (stage, p) in enumerate(zip(recipe.stages, passes, strict=True)):
            progress.update(task, description=f"{recipe.name}: {stage.kind}")
            decision_key = p.decision_key(stage, decision_key)
            slot = stage_slot(index, stage.kind)
            decisions, applied = _locked_decisions(p, stage.kind, slot, locked, decision_key, say)
            if decisions is not None:
                applied_from.append(locked[slot][1])
            source, runner = current, _decision_runner(p, applied)
            locked_as = {"decisions": decisions, "files": locked[slot][0].files} if decisions is not None else None
            key = p.cache_key(stage, key, locked_as)
            current = engine.run(p, key, source, lambda out, s=stage, a=source, r=runner: r(a, s, out), export_key)
            record = engine.records[-1]
            if p.decides and decisions is None and "decisions" in record:
                new_locks[slot] = new_entry(decision_key, record, engine.machine)
                if p.decision_files:
                    decided[slot] = (current.path, p.decision_files)
            elif p.decides and decisions is not None and record.get("decisions", decisions) != decisions:
                # a lock from before the stage pinned more of what it measured (calibration ranges): complete it
                new_locks[slot] = replace(locked[slot][0], decisions=record["decisions"])
            progress.update(task, advance=1)

        progress.update(task, description=f"{recipe.name}: package")
        fields = {"recipe": recipe.model_dump(mode="json", by_alias=True), "recipe_hash": recipe.config_hash()}
        artifact = engine.store.put_recipe(recipe.name, key, _packager(current, fields, decision_key, weights, engine), fields)
        progress.update(task, advance=1, description=f"{recipe.name}: done")
    written = None
    if lock is not None and new_locks:
        try:
            for slot, (output, names) in decided.items():  # the files first: the lock names their sha256
                new_locks[slot] = replace(new_locks[slot], files=keep_files(lock, slot, output, names))
            kept = {} if reanalyze else read_lock(lock)  # reanalysed, every entry is new (and the old lock may not read)
            write_lock(lock, recipe.name, {**kept, **new_locks}, weights.source)
            written = lock
            console.print(f"wrote {lock}: the measured decisions; commit it so other machines build the same artifact")
        except OSError as exc:  # the artifact is built and cached: say what is not kept, and go on
            console.print(f"could not write {lock} ({exc.strerror}): the measured decisions are not locked; "
                          "make its folder writable and build again to keep them", markup=False)  # fmt: skip
    locks = tuple(dict.fromkeys([*applied_from, *([written] if written else [])]))
    return BuildResult(artifact=artifact, weights=weights, stages=engine.steps, lock_written=written, locks=locks)


def _locked_decisions(
    p: Pass, kind: str, slot: str, locked: dict[str, Any], decision_key: str, say: Callable[[str], None]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the lock's decisions for this stage, what its run is given: those and the lock's files); (None, None)
    when the stage decides nothing, the lock has no entry for it, or its inputs changed since (it measures)."""
    if not (p.decides and slot in locked):
        return None, None
    entry, source_lock = locked[slot]
    if entry.decision_key != decision_key:
        say(f"{kind}: the inputs changed since {source_lock} was written: analysing again")
        return None, None
    p.check_decisions(entry.decisions, source_lock)
    if missing := sorted(set(p.decision_files) - set(entry.files)):  # else it would be fitted again, unsaid
        raise UserError(
            f"{source_lock}: the entry of stage '{kind}' names no file {missing[0]}",
            "restore the lock from git, or rebuild with --reanalyze to measure and lock it again",
        )
    files = {name: str(path) for name, path in lock_files(source_lock, slot, entry).items()}
    say(f"{kind}: applying the decisions locked in {source_lock} (build --reanalyze to measure again)")
    return entry.decisions, {**entry.decisions, "files": files} if files else entry.decisions


def _packager(
    final: Artifact, recipe_fields: dict[str, Any], decision_key: str, weights: ResolvedWeights, engine: _Engine
) -> Callable[[Path], tuple[dict[str, Any], dict[str, Any]]]:
    """What `Store.put_recipe` fills the recipe's folder with: the last stage's files, its manifest with the recipe's
    fields (`recipe`, `recipe_hash`), and the build record."""

    def package(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        for item in final.path.iterdir():
            if item.name not in (MANIFEST, *RECORD_FILES):
                link_or_copy(item, out / item.name)
        fields = {
            **final.manifest.model_dump(mode="json", exclude={"files"}),
            "kind": "recipe",
            **recipe_fields,
            "decision_key": decision_key,
            "weights": {
                "source": weights.source,
                "sha256": weights.sha256,
                "int8_rounded": weights.int8_rounded,
                "note": weights.note,
            },
        }
        record = {
            "created": _now(),
            "machine": engine.machine,
            "versions": versions(),
            "stages": engine.records,
            "steps": engine.steps,
        }
        return fields, record

    return package
