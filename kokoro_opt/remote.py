"""Artifacts travel through the MLflow artifact store: push a built folder once, fetch it by id elsewhere.

A pushed artifact is one run in the `kokoro-opt-artifacts` experiment, tagged with the artifact id,
its recipe, its place in the store (`<recipe>/<id>`, or `_cache/export-<key>` for a reference
export) and the machine that built it. Its files: the folder under `artifact/` (model, manifest,
precision map, calibration, voices, `kokoro.json`) and, from `build --push`, the recipe's lock under
`lock/` (which decisions the build applied; the folder alone is what serving needs). Fetching downloads
into a temporary folder inside the store, checks every file against the sha256 in the manifest (no
file missing, none extra, none changed) and only then renames it into place: a tampered or damaged
copy is refused, naming the file, and leaves nothing behind.

An artifact is pushed with the fp32 export it was built from, so a machine that fetches it can also
evaluate it against its reference, not only serve it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from kokoro_opt.artifacts import Artifact, build_folder, file_hashes, open_artifact
from kokoro_opt.errors import UserError
from kokoro_opt.evaluate.tracking import (
    EXPERIMENT_PREFIX,
    KIND_TAG,
    _client,
    _experiment,
    existing_client,
    machine_tags,
    resolve_tracking_uri,
)
from kokoro_opt.manifest import BUILD_RECORD, MANIFEST, Manifest, parse_manifest, read_build_record
from kokoro_opt.store import Store, stage_chain

EXPERIMENT = EXPERIMENT_PREFIX + "artifacts"
PUSHED_KIND = "artifact"
Say = Callable[[str], None]


def verify_folder(folder: Path, manifest: Manifest, origin: str) -> None:
    """Every file the manifest lists, with its sha256, and nothing else; UserError naming the first problem."""
    expected = manifest.files
    if not expected:
        raise UserError(f"{origin}: its manifest lists no file hashes", "push it again with this version of kokoro-opt")
    found = file_hashes(folder)
    hint = "the copy was changed or damaged: push it again from the machine that built it (kokoro-opt push)"
    for name, entry in sorted(expected.items()):
        if name not in found:
            raise UserError(f"{origin}: {name} is missing", hint)
        if found[name].sha256 != entry.sha256:
            problem = f"{name} does not match its manifest (sha256 {found[name].sha256[:12]}... != {entry.sha256[:12]}...)"
            raise UserError(f"{origin}: {problem}", hint)
    extra = sorted(set(found) - set(expected))
    if extra:
        raise UserError(f"{origin}: {extra[0]} is not in its manifest", hint)


def _label(artifact: Artifact) -> str:
    """A recipe artifact's recipe name; a stage output's kind (the fp32 export an artifact was built from)."""
    return artifact.name if artifact.manifest.recipe else artifact.manifest.kind


def _store_place(folder: Path) -> str:
    """Where a folder lives inside its store: <recipe>/<id> or _cache/<kind>-<key>."""
    return f"{folder.parent.name}/{folder.name}"


def _pushed_runs(client: Any, artifact_id: str, exact: bool = True, place: str | None = None) -> list[Any]:
    """Finished pushes of an id (or id prefix); recipe artifacts before stage outputs of the same id."""
    found = client.get_experiment_by_name(EXPERIMENT)
    if found is None or "'" in artifact_id:
        return []
    match = f"= '{artifact_id}'" if exact else f"LIKE '{artifact_id}%'"
    query = f"tags.{KIND_TAG} = '{PUSHED_KIND}' and tags.artifact_id {match} and attributes.status = 'FINISHED'"
    runs = client.search_runs([found.experiment_id], query + (f" and tags.store_place = '{place}'" if place else ""))
    return sorted(runs, key=lambda r: r.data.tags.get("store_place", "").startswith("_"))


FOLDER, LOCK = "artifact", "lock"


def _push_folder(client: Any, uri: str, artifact: Artifact, say: Say, lock: Path | None = None) -> str:
    existing = _pushed_runs(client, artifact.id, place=_store_place(artifact.path))
    if existing:
        return str(existing[0].info.run_id)
    from kokoro_opt.machine import fingerprint

    verify_folder(artifact.path, artifact.manifest, f"artifact {artifact.id}")  # never push a damaged folder
    tags = {
        KIND_TAG: PUSHED_KIND,
        "artifact_id": artifact.id,
        "artifact_name": _label(artifact),
        "store_place": _store_place(artifact.path),
        **machine_tags(artifact.build.machine or fingerprint()),
    }
    size = sum(p.stat().st_size for p in artifact.path.rglob("*") if p.is_file())
    say(f"pushing {_label(artifact)} {artifact.id} ({size / 1e6:.0f} MB) to {uri}")
    experiment = _experiment(client, uri, EXPERIMENT)
    run_id = str(client.create_run(experiment, tags=tags, run_name=f"{_label(artifact)}-{artifact.id[:8]}").info.run_id)
    try:
        client.log_artifacts(run_id, str(artifact.path), FOLDER)
        if lock is not None and lock.is_file():
            client.log_artifact(run_id, str(lock), LOCK)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id)
    return run_id


def push_artifact(artifact: Artifact, tracking_uri: str | None = None, say: Say = print, lock: Path | None = None) -> str:
    """Log the artifact folder (and the fp32 export it was built from, and the recipe's `lock` when
    given) to the tracking server's artifact store; returns the artifact's run id. Pushing again is a no-op."""
    uri = resolve_tracking_uri(tracking_uri)
    client = _client(uri)
    reference = Store(artifact.path.parent.parent).reference_export(artifact)
    if reference is not None and reference.id != artifact.id:
        _push_folder(client, uri, reference, say)
    return _push_folder(client, uri, artifact, say, lock)


def _safe_place(place: str, origin: str) -> PurePosixPath:
    parts = PurePosixPath(place).parts
    if len(parts) != 2 or any(p.startswith(".") for p in parts):
        raise UserError(f"{origin}: refusing its store place {place!r}", "push it again with this version of kokoro-opt")
    return PurePosixPath(place)


def _fetch_run(client: Any, run: Any, root: Path, say: Say) -> Artifact:
    tags = run.data.tags
    artifact_id, origin = tags["artifact_id"], f"artifact {tags['artifact_id']} (MLflow run {run.info.run_id})"
    final = root / _safe_place(tags.get("store_place", ""), origin)
    if (final / MANIFEST).is_file():
        local = open_artifact(final)
        verify_folder(local.path, local.manifest, f"artifact {artifact_id} at {final}")
        return local

    def fill(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        say(f"fetching {tags.get('artifact_name', '?')} {artifact_id} from MLflow run {run.info.run_id}")
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as download:
            folder = Path(client.download_artifacts(run.info.run_id, FOLDER, download))
            if not (folder / MANIFEST).is_file():
                raise UserError(f"{origin}: no {MANIFEST} in its files", "push it again with this version of kokoro-opt")
            manifest = parse_manifest(_read_json(folder / MANIFEST, origin), origin)
            if manifest.id != artifact_id:
                raise UserError(f"{origin}: its manifest is for artifact {manifest.id}", "push it again")
            verify_folder(folder, manifest, origin)
            record = read_build_record(folder).model_dump(mode="json")
            for item in folder.iterdir():
                if item.name not in (MANIFEST, BUILD_RECORD):
                    shutil.move(str(item), tmp / item.name)
        return manifest.model_dump(mode="json", exclude={"files"}), record  # build_folder hashes the files again

    root.mkdir(parents=True, exist_ok=True)
    return open_artifact(build_folder(final, fill))


def fetch_artifact(spec: str, root: Path, tracking_uri: str | None = None, say: Say = print) -> Artifact | None:
    """The pushed artifact whose id starts with `spec`, fetched into `root` with its fp32 export and
    verified; None when the tracking store has no such artifact."""
    opened = existing_client(tracking_uri)
    if opened is None:
        return None  # nothing pushed yet
    uri, client = opened
    runs = _pushed_runs(client, spec, exact=False)
    ids = sorted({r.data.tags["artifact_id"] for r in runs})
    if not ids:
        return None
    if len(ids) > 1:
        raise UserError(f"artifact id '{spec}' is ambiguous in {uri}: {', '.join(i[:12] for i in ids)}", "give more of the id")
    artifact = _fetch_run(client, runs[0], root, say)
    chain = stage_chain(artifact)
    if chain and chain[0].kind == "export" and chain[0].key != artifact.id:
        key = chain[0].key
        place = _store_place(Store(root).stage_path("export", key))
        reference = _pushed_runs(client, key, place=place) or _pushed_runs(client, key)
        if reference:
            _fetch_run(client, reference[0], root, say)
        else:
            say(f"its fp32 export {key} was not pushed: it can be served here, not scored against fp32")
    return artifact


def _read_json(path: Path, origin: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{origin}: {path.name} is not readable JSON ({exc})", "push it again") from None
