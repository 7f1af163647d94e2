"""Run a recipe: weights -> export -> each optimisation stage, every step cached by content hash.

Like Olive's passes, a stage's output folder is keyed by (stage kind, its config, the input's key,
the stage code version), so a rerun with nothing changed reuses every folder, and changing one
stage's config rebuilds that stage and what follows it only.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kokoro_opt.artifacts import Artifact, build_folder, content_key, link_or_copy, open_artifact, versions
from kokoro_opt.export import run_export
from kokoro_opt.recipe import Recipe
from kokoro_opt.weights.sources import ResolvedWeights, resolve_weights

# Bump a stage's version when its code changes what it writes: old cache entries stop matching.
STAGE_VERSIONS = {"export": "1", "quantize": "5", "snake": "2", "coreml": "2"}

StageRunner = Callable[[Artifact, Any, Path], dict[str, Any]]


def stage_runners() -> dict[str, StageRunner]:
    """Stage kind -> function(input artifact, stage config, output folder) -> stage record."""
    from kokoro_opt import passes

    return passes.RUNNERS


@dataclass
class BuildResult:
    artifact: Artifact
    weights: ResolvedWeights
    stages: list[dict[str, Any]] = field(default_factory=list)  # {kind, key, cached, seconds}


def machine_info() -> dict[str, Any]:
    import os

    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    except OSError:
        model = platform.processor()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "neon") if f in flags.split()]
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa, "system": platform.system(), "machine": platform.machine()}


def _run_stage(root: Path, kind: str, key: str, fill: Callable[[Path], dict[str, Any]], log: list[dict[str, Any]]) -> Artifact:
    folder = root / "_cache" / f"{kind}-{key}"
    cached = (folder / "manifest.json").is_file()
    started = time.perf_counter()

    def fill_with_manifest(tmp: Path) -> dict[str, Any]:
        record = fill(tmp)
        return {"id": key, "stage": record, "created": datetime.now(UTC).isoformat()}

    artifact = open_artifact(build_folder(folder, fill_with_manifest))
    log.append({"kind": kind, "key": key, "cached": cached, "seconds": round(time.perf_counter() - started, 2)})
    return artifact


def build(recipe: Recipe, root: Path = Path("artifacts"), console: Console | None = None) -> BuildResult:
    """Build the recipe's artifact under `root/<recipe name>/<content id>/` and return it."""
    console = console or Console(stderr=True)
    runners = stage_runners()
    log: list[dict[str, Any]] = []
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
        task = progress.add_task(f"{recipe.name}: weights", total=len(steps))
        weights = resolve_weights(recipe.weights, log=lambda msg: progress.console.print(msg))
        progress.update(task, advance=1, description=f"{recipe.name}: export ({weights.source} weights)")

        key = content_key("export", STAGE_VERSIONS["export"], recipe.export.model_dump(mode="json"), weights.sha256)
        current = _run_stage(root, "export", key, lambda out: run_export(weights, recipe.export, out), log)
        progress.update(task, advance=1)
        for stage in recipe.stages:
            progress.update(task, description=f"{recipe.name}: {stage.kind}")
            runner = runners[stage.kind]
            key = content_key(stage.kind, STAGE_VERSIONS.get(stage.kind, "1"), stage.model_dump(mode="json"), key)
            source = current
            current = _run_stage(root, stage.kind, key, lambda out, s=stage, a=source, r=runner: r(a, s, out), log)
            progress.update(task, advance=1)

        progress.update(task, description=f"{recipe.name}: package")
        chain = [open_artifact(root / "_cache" / f"{entry['kind']}-{entry['key']}").manifest["stage"] for entry in log]
        final = current

        def package(out: Path) -> dict[str, Any]:
            for item in final.path.iterdir():
                if item.name != "manifest.json":
                    link_or_copy(item, out / item.name)
            return {
                "id": key,
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
                "versions": versions(),
                "machine": machine_info(),
                "created": datetime.now(UTC).isoformat(),
            }

        artifact = open_artifact(build_folder(root / recipe.name / key, package))
        progress.update(task, advance=1, description=f"{recipe.name}: done")
    return BuildResult(artifact=artifact, weights=weights, stages=log)
