"""Artifacts travel through the MLflow artifact store: push a built folder once, fetch it by id elsewhere.

A pushed artifact is one run in the `kokoro-opt-artifacts` experiment, tagged with the artifact id,
its recipe, its place in the store (`<recipe>/<id>`, or `_cache/export-<key>` for a reference
export) and the machine that built it. Its files: the folder under `artifact/` (model, manifest,
precision map, calibration, voices, `kokoro.json`) and, from `build --push`, the locks its decisions
come from under `lock/` (the recipe's, a parent recipe's; the folder alone is what serving needs). Fetching downloads
into the build's temporary folder inside the store (`.tmp/<slot>-*`, removed with it), checks every file against
the sha256 in the manifest (no file missing, none extra, none changed) and only then renames it into place: a
tampered or damaged copy is refused, naming the file, and leaves nothing behind. A local copy damaged since it
arrived is fetched again.

What a tracking server serves is untrusted: an artifact id is a plain name (no path characters), a
run's store place is `<folder>/<name>` inside the store and ends with its id, every file a run lists
or a manifest names is a plain relative path (no `..`, not absolute, no symlink once downloaded),
and the manifest (kokoro_opt/manifest.py, validated when read) gives each file's size: a listed file
of another size, or one the manifest does not name, is refused before anything but the manifest is
downloaded. The build's records (build.json, stage.log) are not content and are only size-bounded.

An artifact is pushed with the fp32 export it was built from, so a machine that fetches it can also
evaluate it against its reference, not only serve it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from kokoro_opt.artifacts import REBUILD, Artifact, build_folder, folder_damage, open_artifact
from kokoro_opt.errors import UserError, read_json
from kokoro_opt.evaluate.tracking_store import (
    EXPERIMENT_PREFIX,
    KIND_TAG,
    download_quietly,
    existing_client,
    experiment_id,
    machine_tags,
    open_client,
    resolve_tracking_uri,
)
from kokoro_opt.manifest import (
    BUILD_RECORD,
    MANIFEST,
    RECORD_FILES,
    Manifest,
    check_id,
    check_relative,
    parse_manifest,
    read_build_record,
)
from kokoro_opt.store import Store, stage_chain

EXPERIMENT = EXPERIMENT_PREFIX + "artifacts"
PUSHED_KIND = "artifact"
Say = Callable[[str], None]


_MANIFEST_LIMIT = 1 << 20  # a manifest is a few KB
_RECORD_LIMIT = 16 << 20  # a build record or stage log: KB to a few MB
_PUSH_AGAIN = "push it again from the machine that built it (kokoro-opt push replaces a push the server lost part of)"


def check_artifact_id(artifact_id: str, origin: str = "artifact id") -> str:
    try:
        return check_id(artifact_id)
    except ValueError:
        raise UserError(
            f"{origin} {artifact_id!r} is not an artifact id", "an id is letters, digits, '.', '_', '-': 49bf3e57ae25cd04"
        ) from None


def _is_name(text: str) -> bool:
    try:
        check_id(text)
    except ValueError:
        return False
    return True


def _check_relative(name: str, origin: str) -> str:
    """A file name from elsewhere: a plain path below its folder, or UserError."""
    try:
        return check_relative(name)
    except ValueError:
        raise UserError(f"{origin}: refusing the file name {name!r} (outside its folder)", _PUSH_AGAIN) from None


def verify_folder(folder: Path, manifest: Manifest, origin: str, hint: str | None = None) -> None:
    """Every file the manifest lists, with its sha256, and nothing else; UserError naming the first problem.
    `hint`: what to do about it (default: push it again, for a fetched copy)."""
    expected = manifest.files
    if not expected:
        raise UserError(f"{origin}: its manifest lists no file hashes", "push it again with this version of kokoro-opt")
    for name in expected:
        _check_relative(name, origin)
    hint = hint or "the copy was changed or damaged: push it again from the machine that built it (kokoro-opt push)"
    if problem := folder_damage(folder, manifest):
        raise UserError(f"{origin}: {problem}", hint)


def _label(artifact: Artifact) -> str:
    """A recipe artifact's recipe name; a stage output's kind (the fp32 export an artifact was built from)."""
    return artifact.name if artifact.manifest.recipe else artifact.manifest.kind


def _store_place(folder: Path) -> str:
    """Where a folder lives inside its store: <recipe>/<id> or _cache/<kind>-<key>."""
    return f"{folder.parent.name}/{folder.name}"


def _place_of(manifest: Manifest) -> str | None:
    """Where a store keeps what `manifest` describes: <its recipe>/<id>, _cache/<kind>-<id>; None for a peer (a
    folder of _peers named after it)."""
    store = Store(Path("."))
    if manifest.kind == "peer":
        return None
    if manifest.kind == "recipe":
        return _store_place(store.recipe_path(manifest.name or "?", manifest.id))
    return _store_place(store.stage_path(manifest.kind, manifest.id))


def _pushed_runs(client: Any, artifact_id: str, exact: bool = True, place: str | None = None) -> list[Any]:
    """Finished pushes of an id (or id prefix); recipe artifacts before stage outputs of the same id."""
    check_artifact_id(artifact_id)
    found = client.get_experiment_by_name(EXPERIMENT)
    if found is None:
        return []
    match = f"= '{artifact_id}'" if exact else f"LIKE '{artifact_id}%'"
    query = f"tags.{KIND_TAG} = '{PUSHED_KIND}' and tags.artifact_id {match} and attributes.status = 'FINISHED'"
    runs = client.search_runs([found.experiment_id], query + (f" and tags.store_place = '{place}'" if place else ""))
    runs = [r for r in runs if r.data.tags.get("artifact_id", "").startswith(artifact_id)]  # LIKE reads '_' as any one
    return sorted(runs, key=lambda r: r.data.tags.get("store_place", "").startswith("_"))


FOLDER, LOCK = "artifact", "lock"


def _push_folder(client: Any, uri: str, artifact: Artifact, say: Say, locks: Sequence[Path] = ()) -> str:
    _check_placeable(artifact)
    existing = _pushed_runs(client, artifact.id, place=_store_place(artifact.path))
    if existing and _earlier_push_is_whole(client, existing[0], artifact, say):
        return str(existing[0].info.run_id)
    from kokoro_opt.machine import fingerprint

    verify_folder(artifact.path, artifact.manifest, f"artifact {artifact.id}", REBUILD)  # never push a damaged folder
    tags = {
        KIND_TAG: PUSHED_KIND,
        "artifact_id": artifact.id,
        "artifact_name": _label(artifact),
        "store_place": _store_place(artifact.path),
        **machine_tags(artifact.build.machine or fingerprint()),
    }
    size = sum(entry.size for entry in artifact.manifest.files.values())
    if artifact.build.fetched_from:
        say(f"{_label(artifact)} {artifact.id} was fetched from {artifact.build.fetched_from}, not built here: pushed as it came")
    say(f"pushing {_label(artifact)} {artifact.id} ({size / 1e6:.0f} MB) to {uri}")
    experiment = experiment_id(client, uri, EXPERIMENT)
    run_id = str(client.create_run(experiment, tags=tags, run_name=f"{_label(artifact)}-{artifact.id[:8]}").info.run_id)
    try:
        client.log_artifacts(run_id, str(artifact.path), FOLDER)
        for lock in locks:
            client.log_artifact(run_id, str(lock), LOCK)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id)
    return run_id


def push_artifact(artifact: Artifact, tracking_uri: str | None = None, say: Say = print, locks: Sequence[Path] = ()) -> str:
    """Log the artifact folder (and the fp32 export it was built from, and the `locks` its decisions come from:
    build.BuildResult.locks) to the tracking server's artifact store; returns the artifact's run id. Pushing again
    is a no-op."""
    _check_placeable(artifact)  # before a tracking store is opened (or, for a new SQLite path, made)
    uri = resolve_tracking_uri(tracking_uri)
    client = open_client(uri)
    reference = Store(artifact.path.parent.parent).reference_export(artifact)
    if reference is not None and reference.id != artifact.id:
        _push_folder(client, uri, reference, say)
    return _push_folder(client, uri, artifact, say, locks)


def _earlier_push_is_whole(client: Any, run: Any, artifact: Artifact, say: Say) -> bool:
    """An id already pushed is not pushed again, unless the server lost part of it (a file missing or of another size
    than its manifest says, as `fetch` finds it): that run is deleted (MLflow can restore it) and the folder pushed
    anew, which is what fetch's error tells the user to do. Where the pushed files differ from these (a stage whose
    output is not byte for byte reproducible, `.ort` conversion, built again on this machine), say so rather than
    claim them."""
    run_id = str(run.info.run_id)
    origin = f"artifact {artifact.id} (MLflow run {run_id})"
    listed = _listing(client, run_id, origin)  # a server that does not answer stops the push: nothing is deleted
    if not listed:  # no file at all: rather a server whose artifact store is not where it was (unmounted, moved)
        raise UserError(
            f"{origin}: the server lists none of its files, so nothing was pushed or deleted",
            "check that the tracking server finds its artifact store (mlflow server --artifacts-destination); if the "
            "files are really gone, delete that MLflow run and push again",
        )
    lost = f"{origin}: no {MANIFEST} in its files" if MANIFEST not in listed else None
    if lost is None:
        try:  # some of its files are there: the ones missing, of another size or unreadable were lost or damaged
            with tempfile.TemporaryDirectory(prefix=".kokoro-opt-push-") as download:
                pushed = _read_manifest(client, run_id, download, origin, listed)
            _check_listing(listed, pushed, origin)
        except UserError as exc:
            lost = exc.message
    if lost is not None:
        client.delete_run(run_id)
        say(f"{lost}: that push is deleted (MLflow can restore it) and {_label(artifact)} {artifact.id} pushed again")
        return False
    differ = sorted(n for n in {*pushed.files, *artifact.manifest.files} if pushed.files.get(n) != artifact.manifest.files.get(n))
    if differ:
        files = ", ".join(differ[:3]) + (" ..." if len(differ) > 3 else "")
        say(f"{_label(artifact)} {artifact.id} was pushed before from another build (MLflow run {run_id}) whose {files} "
            "differ from these: that push stays what the id fetches")  # fmt: skip
    return True


def _check_placeable(artifact: Artifact) -> None:
    if not _placeable(_store_place(artifact.path), artifact.id):  # a copy elsewhere: no fetch could place it
        raise UserError(
            f"{artifact.path} is not where a store keeps artifact {artifact.id} (<recipe>/{artifact.id})",
            f"push it from the store it was built in, e.g. artifacts/{artifact.name}/{artifact.id}",
        )


def _placeable(place: str, artifact_id: str) -> bool:
    """`<folder>/<name>` named after the artifact (`<recipe>/<id>`, `_cache/<kind>-<id>`)."""
    parts = place.split("/")
    named = len(parts) == 2 and _is_name(parts[0].removeprefix("_")) and _is_name(parts[1])
    return named and parts[1] in (artifact_id, f"{parts[1].rsplit('-', 1)[0]}-{artifact_id}")


def _safe_place(root: Path, place: str, artifact_id: str, origin: str) -> Path:
    """The folder a fetched artifact goes to: its store place (`_placeable`) inside `root`."""
    parts = place.split("/")
    hint = "push it again with this version of kokoro-opt"
    if not _placeable(place, artifact_id):
        raise UserError(f"{origin}: refusing its store place {place!r}", hint)
    final = root / parts[0] / parts[1]
    if not final.resolve().is_relative_to(root.resolve()):  # a symlinked folder in the store
        raise UserError(f"{origin}: its store place {place!r} leads outside {root}", hint)
    return final


def _listing(client: Any, run_id: str, origin: str) -> dict[str, int | None]:
    """The run's files under `artifact/` with the sizes the server reports; MLflow refuses unsafe paths."""
    from mlflow.exceptions import MlflowException

    found: dict[str, int | None] = {}
    pending = [FOLDER]
    try:
        while pending:
            for info in client.list_artifacts(run_id, pending.pop()):
                if info.is_dir:
                    pending.append(info.path)
                else:
                    name = _check_relative(str(PurePosixPath(info.path).relative_to(FOLDER)), origin)
                    found[name] = info.file_size
    except (MlflowException, ValueError) as exc:
        raise UserError(f"{origin}: its file list was refused: {exc}", _PUSH_AGAIN) from None
    return found


def _check_listing(listed: dict[str, int | None], manifest: Manifest, origin: str) -> None:
    """Before the download: the files the run lists are the manifest's, of the sizes it gives."""
    records = {name: _RECORD_LIMIT for name in RECORD_FILES if name in listed}
    expected = {name: entry.size for name, entry in manifest.files.items()} | records
    for name in sorted((set(listed) - {MANIFEST}) ^ set(expected)):
        where = "is not in its manifest" if name in listed else "is missing"
        raise UserError(f"{origin}: {name} {where}", _PUSH_AGAIN)
    for name, size in sorted(listed.items()):
        if name == MANIFEST:
            continue
        if size is None or (size > expected[name] if name in records else size != expected[name]):
            want = f"at most {expected[name]}" if name in records else str(expected[name])
            raise UserError(f"{origin}: {name} is {size} bytes on the server; its manifest says {want}", _PUSH_AGAIN)


def _read_manifest(client: Any, run_id: str, download: str, origin: str, listed: dict[str, int | None]) -> Manifest:
    size = listed.get(MANIFEST)  # the run's `_listing`
    if size is None or size > _MANIFEST_LIMIT:  # the listing's size, before a byte is downloaded: a server may send any
        raise UserError(f"{origin}: its {MANIFEST} is {'of no stated size' if size is None else f'{size} bytes'}", _PUSH_AGAIN)
    path = Path(download_quietly(client, run_id, f"{FOLDER}/{MANIFEST}", download))
    if path.stat().st_size > _MANIFEST_LIMIT:
        raise UserError(f"{origin}: its {MANIFEST} is {path.stat().st_size} bytes", _PUSH_AGAIN)
    manifest = parse_manifest(read_json(path, "push it again", f"{origin}: {path.name}"), origin)
    path.unlink()
    return manifest


def _fetch_run(client: Any, run: Any, root: Path, say: Say, kind: str | None = None) -> Artifact:
    """Fetch one push into `root`, verified; `kind`: what its manifest must be (an artifact's fp32 export)."""
    tags = run.data.tags
    run_origin = f"MLflow run {run.info.run_id}"
    artifact_id = check_artifact_id(str(tags.get("artifact_id", "")), f"{run_origin}: its artifact id")
    origin = f"artifact {artifact_id} ({run_origin})"
    final = _safe_place(root, tags.get("store_place", ""), artifact_id, origin)
    damaged = f"the pushed copy was changed or damaged: delete {run_origin} and push it again from the machine that built it"

    def fill(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        listed = _listing(client, run.info.run_id, origin)
        if MANIFEST not in listed:
            raise UserError(f"{origin}: no {MANIFEST} in its files", "push it again with this version of kokoro-opt")
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=tmp) as download:  # a killed fetch's goes with tmp
            manifest = _read_manifest(client, run.info.run_id, download, origin, listed)
            if manifest.id != artifact_id:
                raise UserError(f"{origin}: its manifest is for artifact {manifest.id}", "push it again")
            place, expected = _store_place(final), _place_of(manifest)
            if expected is None:  # a peer: `push` never sends one, and its folder is what `evaluate --peers` scores
                raise UserError(f"{origin}: its manifest is a peer's, which no push sends", _PUSH_AGAIN)
            if place != expected:  # else a tiny artifact placed as int8-mixed/<id> would be that recipe's newest build here
                wrong = f"its store place {place!r} is not where its manifest belongs ({expected})"
                raise UserError(f"{origin}: {wrong}", _PUSH_AGAIN)
            if kind is not None and manifest.kind != kind:
                raise UserError(f"{origin}: it is a {manifest.kind}, not the {kind} its artifact was built from", _PUSH_AGAIN)
            _check_listing(listed, manifest, origin)
            total = sum(size or 0 for size in listed.values())
            name = tags.get("artifact_name", "?")
            say(f"fetching {name} {artifact_id} ({total / 1e6:.0f} MB) from MLflow run {run.info.run_id}")
            folder = Path(download_quietly(client, run.info.run_id, FOLDER, download))
            verify_folder(folder, manifest, origin, damaged)
            for file, size in listed.items():
                if file != MANIFEST and (got := (folder / file).stat().st_size) != size:
                    raise UserError(f"{origin}: {file} arrived with {got} bytes, not {size}", "fetch it again")
            record = read_build_record(folder).model_dump(mode="json") | {"fetched_from": run_origin}
            for item in folder.iterdir():
                if item.name not in (MANIFEST, BUILD_RECORD):
                    shutil.move(str(item), tmp / item.name)
        return manifest.model_dump(mode="json", exclude={"files"}), record  # build_folder hashes the files again

    root.mkdir(parents=True, exist_ok=True)
    return open_artifact(build_folder(final, fill))  # a local copy, unless damaged since: then fetched again


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
    if spec in ids:  # a whole id is never ambiguous: others may extend it
        ids, runs = [spec], [r for r in runs if r.data.tags["artifact_id"] == spec]
    if len(ids) > 1:
        raise UserError(f"artifact id '{spec}' is ambiguous in {uri}: {', '.join(ids[:10])}", "give more of the id")
    # a push from an older version may name a place no fetch can use: another push of the id is taken first
    runs.sort(key=lambda r: not _placeable(r.data.tags.get("store_place", ""), r.data.tags["artifact_id"]))
    artifact = _fetch_run(client, runs[0], root, say)
    chain = stage_chain(artifact)
    if chain and chain[0].kind == "export" and chain[0].key != artifact.id:
        key = chain[0].key
        place = _store_place(Store(root).stage_path("export", key))
        reference = _pushed_runs(client, key, place=place) or _pushed_runs(client, key)
        if reference:
            _fetch_run(client, reference[0], root, say, kind="export")
        else:
            say(f"its fp32 export {key} was not pushed: it can be served here, not scored against fp32")
    return artifact
