"""What `kokoro-opt evaluate` / `compare` are pointed at, as artifacts: built, found or fetched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def evaluation_targets(
    targets: list[str], root: Path, tracking_uri: str | None, console: Any, say: Callable[[str], None]
) -> list[Any]:
    """Artifacts for each target: `all` (every one under `root`), a recipe (built; cheap when every stage
    is cached), an artifact folder, or an artifact id (here, or pushed from another machine)."""
    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.select import artifact_by_id, names_a_path, no_artifacts
    from kokoro_opt.store import Store

    found = []
    for target in targets:
        if target == "all":
            found.extend(Store(root).artifacts())
        elif target.endswith((".yaml", ".yml")):
            from kokoro_opt.build import build
            from kokoro_opt.locks import lock_path
            from kokoro_opt.recipe import load_recipe

            found.append(build(load_recipe(target), root, console=console, lock=lock_path(Path(target))).artifact)
        elif names_a_path(target):
            found.append(open_artifact(target))
        else:
            found.append(artifact_by_id(target, root, tracking_uri, say=say))
    if not found:
        raise no_artifacts(root)
    return found
