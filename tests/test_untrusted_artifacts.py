"""Artifacts from a tracking server are untrusted: a real MLflow server serves crafted runs (paths out of
the artifact folder, ids with path characters, files larger than their manifest says), and fetching
refuses each with a clear error and writes nothing outside the store."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kokoro_opt.artifacts import Artifact, link_or_copy, open_artifact
from kokoro_opt.errors import UserError
from kokoro_opt.evaluate.tracking_store import KIND_TAG
from kokoro_opt.hashing import file_sha256
from kokoro_opt.manifest import MANIFEST, RECORD_FILES
from kokoro_opt.remote import EXPERIMENT, PUSHED_KIND, fetch_artifact, push_artifact
from kokoro_opt.select import resolve_artifact
from tests.servers import mlflow_server

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("untrusted")
    with mlflow_server(f"sqlite:///{base / 'mlflow.db'}", base / "mlflow-artifacts") as url:
        yield url


def craft(tracking: str, artifact_id: str, files: dict[str, bytes], *, manifest_files: dict[str, str] | None = None,
          place: str | None = None, declared: dict[str, int] | None = None,
          manifest_text: str | None = None) -> None:  # fmt: skip
    """A finished push run as a hostile machine could make it: any tags, any manifest, any files. The manifest
    lists `manifest_files` (name: sha256) or the files themselves, each with its size or the `declared` one."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    found = client.get_experiment_by_name(EXPERIMENT)
    experiment = found.experiment_id if found else client.create_experiment(EXPERIMENT)
    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            (Path(folder) / name).write_bytes(data)
        content = [n for n in files if n not in RECORD_FILES]  # a build's records are not listed
        hashes = {n: file_sha256(Path(folder) / n) for n in content} if manifest_files is None else manifest_files
        sizes = {n: len(data) for n, data in files.items()} | (declared or {})
        listed = {name: {"sha256": sha, "size": sizes.get(name, 1)} for name, sha in hashes.items()}
        manifest = {"format": 2, "id": artifact_id, "kind": "recipe", "recipe": {"name": "tiny"}, "files": listed}
        (Path(folder) / MANIFEST).write_text(manifest_text or json.dumps(manifest), encoding="utf-8")
        run_tags = {KIND_TAG: PUSHED_KIND, "artifact_id": artifact_id, "artifact_name": "tiny",
                    "store_place": place or f"tiny/{artifact_id}"}  # fmt: skip
        run = client.create_run(experiment, tags=run_tags)
        client.log_artifacts(run.info.run_id, folder, "artifact")
        client.set_terminated(run.info.run_id)


def outside_is_untouched(machine: Path) -> None:
    """Nothing but lock files in the store (its .locks/), and nothing beside it."""
    assert sorted(p.name for p in machine.iterdir()) == ["artifacts"], list(machine.iterdir())
    left = [p for p in (machine / "artifacts").rglob("*") if p.is_file() and p.parent.name != ".locks"]
    assert not left, left


def refused(tracking: str, machine: Path, spec: str, match: str) -> None:
    root = machine / "artifacts"
    root.mkdir(parents=True, exist_ok=True)
    with pytest.raises(UserError, match=match):
        fetch_artifact(spec, root, tracking, say=lambda _: None)
    outside_is_untouched(machine)


@pytest.mark.parametrize(
    ("place", "match"),
    [("../../escaped", "refusing its store place"), ("/tmp/escaped/0123abcd0123abc1", "refusing its store place"),
     ("tiny/other-id", "refusing its store place"), (".hidden/0123abcd0123abc1", "refusing its store place")],
)  # fmt: skip
def test_a_store_place_outside_the_store_is_refused(tracking: str, tmp_path: Path, place: str, match: str) -> None:
    artifact_id = f"{abs(hash(place)) % 16**16:016x}"
    craft(tracking, artifact_id, {"voices.npz": b"x"}, place=place.replace("0123abcd0123abc1", artifact_id))
    refused(tracking, tmp_path / "machine", artifact_id, match)
    assert not (tmp_path / "escaped").exists()


def test_an_id_with_path_characters_is_refused(tracking: str, tmp_path: Path) -> None:
    craft(tracking, "aaaa1111/../../x", {"voices.npz": b"x"}, place="tiny/x")
    refused(tracking, tmp_path / "machine", "aaaa1111", "is not an artifact id")  # the run's id tag
    refused(tracking, tmp_path / "machine", "../aaaa", "is not an artifact id")  # what the user typed
    refused(tracking, tmp_path / "machine", "%", "is not an artifact id")  # no LIKE pattern either


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "sub/../../outside.bin"])
def test_a_manifest_naming_a_path_outside_the_folder_is_refused(tracking: str, tmp_path: Path, name: str) -> None:
    artifact_id = f"b{abs(hash(name)) % 16**15:015x}"
    craft(tracking, artifact_id, {"voices.npz": b"x"}, manifest_files={name: "0" * 64, "voices.npz": "0" * 64})
    refused(tracking, tmp_path / "machine", artifact_id, "is not a relative path inside the artifact folder")


@pytest.mark.parametrize(
    ("recipe", "match"),
    [({"name": "../../../../escaped/x"}, "recipe.name '../../../../escaped/x' is not a recipe name"),
     ({"name": "tiny[/]"}, r"recipe.name 'tiny\[/\]' is not a recipe name"),
     ({"name": "tiny", "evaluate": "fast"}, "recipe.evaluate is not a mapping")],
)  # fmt: skip
def test_a_manifest_whose_recipe_is_no_recipe_is_refused(tracking: str, tmp_path: Path, recipe: dict, match: str) -> None:
    """The recipe's name becomes MLflow experiment and artifact paths (`evaluate`) and is printed (Rich markup): a
    fetched manifest naming `../..` made `evaluate` write outside its store, and `tiny[/]` crashed `fetch`."""
    artifact_id = f"a{abs(hash(json.dumps(recipe))) % 16**15:015x}"
    manifest = {"format": 2, "id": artifact_id, "kind": "recipe", "recipe": recipe, "files": {}}
    craft(tracking, artifact_id, {"voices.npz": b"x"}, manifest_text=json.dumps(manifest))
    refused(tracking, tmp_path / "machine", artifact_id, match)


@pytest.mark.parametrize(
    ("place", "manifest", "match"),
    [("int8-mixed/{id}", {"kind": "recipe", "recipe": {"name": "tiny"}}, "is not where its manifest belongs"),
     ("_cache/export-{id}", {"kind": "recipe", "recipe": {"name": "tiny"}}, "is not where its manifest belongs"),
     ("_cache/simplify-{id}", {"kind": "export"}, "is not where its manifest belongs"),
     ("_peers/x-{id}", {"kind": "export"}, "is not where its manifest belongs"),
     ("tiny/{id}", {"kind": "peer"}, "a peer's, which no push sends"),
     ("_peers/x-{id}", {"kind": "peer"}, "a peer's, which no push sends")],
)  # fmt: skip
def test_a_store_place_that_is_not_the_manifests_is_refused(
    tracking: str, tmp_path: Path, place: str, manifest: dict, match: str
) -> None:
    """A push run says where a fetch puts it: it must be where its manifest belongs. A tiny artifact placed as
    int8-mixed/<id> became that recipe's newest build on the machine that fetched it (what `serve` and `voices`
    took), and any artifact could be placed as a stage output that builds reuse. A peer (kokoro-onnx's model, what
    `evaluate --peers` scores) is never pushed: one in a tracking store is refused wherever it says it goes."""
    artifact_id = f"c{abs(hash(place + json.dumps(manifest))) % 16**15:015x}"
    text = json.dumps({"format": 2, "id": artifact_id, "files": {}, **manifest})
    craft(tracking, artifact_id, {"voices.npz": b"x"}, place=place.format(id=artifact_id), manifest_text=text)
    refused(tracking, tmp_path / "machine", artifact_id, match)


def test_an_artifact_s_fp32_export_must_be_an_export(tracking: str, tmp_path: Path) -> None:
    """What a fetch brings as an artifact's fp32 export is the push of the id its chain names: a push of that id
    that is no export (here a recipe artifact, which would become that recipe's newest build) is refused."""
    reference, artifact_id = "c0de0000c0de0001", "c0de0000c0de0002"
    craft(tracking, reference, {"voices.npz": b"x"})  # a tiny recipe artifact, placed as tiny/<id>
    chain = [{"kind": "export", "key": reference}, {"kind": "ort", "key": artifact_id}]
    files = {"voices.npz": {"sha256": hashlib.sha256(b"x").hexdigest(), "size": 1}}
    text = json.dumps({"format": 2, "id": artifact_id, "kind": "recipe", "recipe": {"name": "tiny"}, "chain": chain,
                       "files": files})  # fmt: skip
    craft(tracking, artifact_id, {"voices.npz": b"x"}, manifest_text=text)
    machine = tmp_path / "machine"
    with pytest.raises(UserError, match="not the export its artifact was built from"):
        fetch_artifact(artifact_id, machine / "artifacts", tracking, say=lambda _: None)
    assert not (machine / "artifacts" / "tiny" / reference).exists()


def test_a_file_larger_than_its_manifest_says_is_refused_before_download(tracking: str, tmp_path: Path) -> None:
    artifact_id = "c0ffee00c0ffee00"
    big = os.urandom(300_000)
    craft(tracking, artifact_id, {"voices.npz": big}, declared={"voices.npz": 1000})
    refused(tracking, tmp_path / "machine", artifact_id, r"voices\.npz is 300000 bytes on the server; its manifest says 1000")
    craft(tracking, "c0ffee00c0ffee01", {"voices.npz": b"x", "build.json": b" " * (17 << 20)})  # a record: bounded
    refused(tracking, tmp_path / "machine", "c0ffee00c0ffee01", r"build\.json is 17825792 bytes on the server")


def test_a_file_the_manifest_does_not_name_is_refused_before_download(tracking: str, tmp_path: Path) -> None:
    artifact_id = "d00dd00dd00dd00d"
    craft(tracking, artifact_id, {"voices.npz": b"x", "extra.bin": b"y" * 1000}, manifest_files={"voices.npz": "0" * 64})
    refused(tracking, tmp_path / "machine", artifact_id, "extra.bin is not in its manifest")


def test_a_manifest_too_deep_or_too_large_to_read_is_refused(tracking: str, tmp_path: Path) -> None:
    craft(tracking, "e0e0e0e0e0e0e0e0", {"voices.npz": b"x"}, manifest_text="[" * 200_000)  # past the parser's recursion
    refused(tracking, tmp_path / "deep", "e0e0e0e0e0e0e0e0", "is not readable JSON")
    craft(tracking, "e0e0e0e0e0e0e0e1", {"voices.npz": b"x"}, manifest_text=" " * (2 << 20))
    refused(tracking, tmp_path / "large", "e0e0e0e0e0e0e0e1", r"its manifest\.json is 2097152 bytes")  # from the listing


def test_an_underscore_in_a_prefix_is_a_character_not_a_wildcard(tracking: str, tmp_path: Path) -> None:
    craft(tracking, "f0f0aaaaf0f0aaaa", {"voices.npz": b"x"})
    root = tmp_path / "machine" / "artifacts"
    assert fetch_artifact("f0f0_a", root, tracking, say=lambda _: None) is None  # SQL's LIKE would match f0f0aa...


def test_a_prefix_two_ids_share_is_ambiguous(tracking: str, tmp_path: Path) -> None:
    craft(tracking, "abab0000abab0001", {"voices.npz": b"x"})
    craft(tracking, "abab0000abab0002", {"voices.npz": b"x"})
    refused(tracking, tmp_path / "machine", "abab0000", "ambiguous in .*: abab0000abab0001, abab0000abab0002")
    craft(tracking, "abab0000abab00010", {"voices.npz": b"x"})  # an id extending another: the whole one is not ambiguous
    root = tmp_path / "whole" / "artifacts"
    fetched = fetch_artifact("abab0000abab0001", root, tracking, say=lambda _: None)
    assert fetched is not None and fetched.id == "abab0000abab0001"


def test_a_derived_artifact_arrives_with_its_fp32_export(
    tracking: str, tiny_recipe, artifacts_root: Path, tmp_path: Path
) -> None:
    """Pushing an artifact built from an export pushes that export too, and a fetch brings both, verified: the
    machine that fetched it can score it against fp32."""
    import shutil

    from typer.testing import CliRunner

    from kokoro_opt.build import build
    from kokoro_opt.cli import app
    from kokoro_opt.recipe import parse_recipe
    from kokoro_opt.select import artifact_by_id
    from kokoro_opt.store import Store

    data = tiny_recipe.model_dump(mode="json", by_alias=True) | {"name": "tiny-ort", "stages": [{"kind": "ort"}]}
    derived = build(parse_recipe(data), artifacts_root).artifact
    push_artifact(derived, tracking, say=lambda _: None)
    root = tmp_path / "machine" / "artifacts"
    fetched = fetch_artifact(derived.id[:12], root, tracking, say=lambda _: None)
    assert fetched is not None and fetched.manifest == derived.manifest
    built, reference = Store(artifacts_root).reference_export(derived), Store(root).reference_export(fetched)
    assert built is not None and reference is not None and reference.manifest == built.manifest  # byte for byte

    # a fetch killed before its export arrived: fetching it again completes it
    shutil.rmtree(reference.path)
    fetched_again = CliRunner().invoke(app, ["fetch", derived.id[:12], "--artifacts", str(root), "--tracking-uri", tracking])
    assert fetched_again.exit_code == 0, fetched_again.output
    assert (again := Store(root).reference_export(fetched)) is not None and again.manifest == built.manifest
    # changed since it arrived: `say` or `serve` by id fetch it again, never speak with it
    model = next(p for p in fetched.path.iterdir() if p.suffix in (".onnx", ".ort"))
    original = model.read_bytes()
    model.unlink()  # not the pushed copy's inode
    model.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert artifact_by_id(derived.id[:12], root, tracking, say=lambda _: None).id == derived.id
    assert model.read_bytes() == original
    model.unlink()
    model.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(UserError, match=r"changed|does not match|sha256"):  # never pushed to this store: refused
        artifact_by_id(derived.id[:12], root, f"sqlite:///{tmp_path / 'other.db'}", say=lambda _: None)


def test_a_build_takes_nothing_fetched_as_its_own(tracking: str, tiny_recipe, artifacts_root: Path, tmp_path: Path) -> None:
    """A stage output's id hashes its inputs, not its files: whoever pushed it could have put anything under it. So
    a build on the machine that fetched it builds every stage and the result again, and what it built replaces
    what was fetched; what a fetch brings stays what `say`, `serve` and `evaluate` read."""
    from kokoro_opt.build import build
    from kokoro_opt.recipe import parse_recipe
    from kokoro_opt.store import Store

    recipe = parse_recipe(tiny_recipe.model_dump(mode="json", by_alias=True) | {"name": "tiny-ort", "stages": [{"kind": "ort"}]})
    built = build(recipe, artifacts_root).artifact
    push_artifact(built, tracking, say=lambda _: None)  # a no-op when the test above pushed it
    root = tmp_path / "machine" / "artifacts"
    fetched = fetch_artifact(built.id, root, tracking, say=lambda _: None)
    assert fetched is not None and (export := Store(root).reference_export(fetched)) is not None
    assert fetched.build.fetched_from.startswith("MLflow run ") and export.build.fetched_from.startswith("MLflow run ")
    assert not built.build.fetched_from  # built here
    said: list[str] = []  # pushed on as it came, and said so
    push_artifact(fetched, f"sqlite:///{tmp_path / 'other.db'}", say=said.append)
    assert any(f"{built.id} was fetched from MLflow run " in line for line in said), said

    rebuilt = build(recipe, root)
    assert rebuilt.artifact.id == built.id and [s["cached"] for s in rebuilt.stages] == [False] * len(rebuilt.stages)
    again = Store(root).reference_export(rebuilt.artifact)
    assert again is not None and not again.build.fetched_from and not rebuilt.artifact.build.fetched_from
    assert all(s["cached"] for s in build(recipe, root).stages)  # and what it built is its cache from now on


def test_the_window_settings_kokoro_json_checks_are_the_decoder_s() -> None:
    from kokoro_opt.artifacts import WINDOW_STEP_SETTINGS
    from kokoro_opt.runtime.windowed import WindowSettings

    assert set(WINDOW_STEP_SETTINGS) == set(WindowSettings.__dataclass_fields__)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [("kokoro.json", b'{"vocab": {"a": 1}, "windows": "x"}', "windows is not a map"),
     ("kokoro.json", b'{"sample_rate": 24000}', "vocab is not a map"),
     ("kokoro.json", b'{"vocab": {"a": 1}, "windows": {"steps": NaN}}', r"windows.steps is nan, not a number of steps"),
     ("kokoro.json", b'{"vocab": {"a": 1}, "windows": {"overlap_steps": -100000}}', "windows.overlap_steps is -100000"),
     ("kokoro.json", b'{"vocab": {"a": 1}, "windows": {"steps": 80.5}}', "windows.steps is 80.5"),
     ("kokoro.json", b'{"vocab": {"a": "1"}}', "vocab is not a map"),
     ("kokoro.json", b'{"vocab": {"a": 1}, "edges": "zz"}', "edges is not a map"),
     ("kokoro.json", b'{"vocab": {"a": 1}, "edges": {"lead_frames": 1e30, "trail_frames": 8}}', "edges is not a map"),
     ("kokoro.json", b'{"vocab": {"a": 1}, "weights": "str"}', "weights is not a map with a source name"),
     ("kokoro.json", b"[" * 100_000, "is not readable JSON"),
     ("voices.npz", "strings", "does not hold voice style tables"),
     ("voices.npz", "two shapes", "does not hold voice style tables"),
     ("voices.npz", "truncated", "voices.npz is not readable"),
     ("voices.npz", "a huge header", r"tiny_0.npy claims an array of shape \(100000000000, 1, 256\)"),
     ("build.json", b"[" * 100_000, "is not readable JSON")],
)  # fmt: skip
def test_hostile_contents_of_an_artifact_are_one_clear_error(
    tiny_artifact: Artifact, tmp_path: Path, name: str, content: bytes | str, match: str
) -> None:
    """A pushed artifact's files match its manifest, but a hostile machine wrote both: what they hold is checked
    where it is read, and speaking with it is one UserError, not a traceback or a 500 per request."""
    import io

    import numpy as np

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.serve.config import mode_reason

    folder = tmp_path / "tiny" / tiny_artifact.id
    link_or_copy(tiny_artifact.path, folder)
    if content == "strings":
        buffer = io.BytesIO()
        np.savez(buffer, tiny_0=np.array(["a", "b"]))
        content = buffer.getvalue()
    elif content == "two shapes":
        buffer = io.BytesIO()
        np.savez(buffer, tiny_0=np.zeros((510, 1, 256), np.float32), tiny_1=np.zeros((10, 256), np.float32))
        content = buffer.getvalue()
    elif content == "a huge header":  # 1 KB claiming 100 GB: refused before numpy allocates it
        import zipfile

        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 1, 256)})
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("tiny_0.npy", header.getvalue() + bytes(100))
        content = buffer.getvalue()
    elif content == "truncated":  # a bad zip: neither an OSError nor a ValueError
        content = (tiny_artifact.path / name).read_bytes()[:60]
    (folder / name).unlink()  # a hard link to the fixture's file: replaced, not written through
    (folder / name).write_bytes(content)
    with pytest.raises(UserError, match=match):
        artifact = open_artifact(folder)
        mode_reason(artifact, None, artifact.windowed_by_default)
        assert artifact.build is not None  # what serve's start line and evaluate read
        assert artifact.voice_names  # what serve's voice list and tune's voice check read
        Synthesizer(artifact, load=False)


def test_a_genuine_push_fetches_with_its_record(tracking: str, tiny_artifact: Artifact, tmp_path: Path) -> None:
    push_artifact(tiny_artifact, tracking, say=lambda _: None)
    root = tmp_path / "machine" / "artifacts"
    fetched = fetch_artifact(tiny_artifact.id, root, tracking, say=lambda _: None)
    assert fetched is not None and fetched.manifest == tiny_artifact.manifest  # the same content, verified
    assert fetched.build.stages == tiny_artifact.build.stages  # and what its build measured
    voices = fetched.path / "voices.npz"
    original = voices.read_bytes()
    voices.unlink()  # not the pushed copy's inode: a fetched file may be linked to where it came from
    voices.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # damaged after it arrived
    with pytest.raises(UserError, match=r"voices\.npz does not match its manifest") as refused:
        resolve_artifact(str(fetched.path))  # named by its folder, as `say --artifact DIR` does
    assert f"kokoro-opt fetch {tiny_artifact.id} --artifacts {root}" in str(refused.value.hint)  # not a build: seconds
    again = fetch_artifact(tiny_artifact.id, root, tracking, say=lambda _: None)
    assert again is not None and (again.path / "voices.npz").read_bytes() == original  # fetched again, not refused


def test_pushing_an_id_again_with_other_files_says_which(tracking: str, tiny_artifact: Artifact, tmp_path: Path) -> None:
    """An id is pushed once; a build of it whose files differ (a stage not byte for byte reproducible, built on another
    machine) is not pushed over it, and the push says which files differ instead of claiming them."""
    from kokoro_opt.manifest import FileEntry

    push_artifact(tiny_artifact, tracking, say=lambda _: None)  # a no-op when another test pushed it
    other = tmp_path / "other" / "artifacts" / "tiny" / tiny_artifact.id
    link_or_copy(tiny_artifact.path, other)
    voices = other / "voices.npz"
    data = voices.read_bytes() + b"\0"
    voices.unlink()  # a hard link to the fixture's file: replaced, not written through
    voices.write_bytes(data)
    files = {**tiny_artifact.manifest.files, "voices.npz": FileEntry(sha256=file_sha256(voices), size=len(data))}
    (other / MANIFEST).unlink()
    (other / MANIFEST).write_text(tiny_artifact.manifest.model_copy(update={"files": files}).to_json(), encoding="utf-8")
    said: list[str] = []
    push_artifact(open_artifact(other), tracking, say=said.append)
    assert any("pushed before from another build" in line and "voices.npz differ" in line for line in said), said
    said.clear()
    push_artifact(tiny_artifact, tracking, say=said.append)  # the same files: nothing to say
    assert not any("differ" in line for line in said), said


def test_a_push_the_server_lost_part_of_is_pushed_again_as_fetch_says(tiny_artifact: Artifact, tmp_path: Path) -> None:
    """A file gone from the server's copy: fetch says to push it again, and pushing again (a no-op for a whole push)
    replaces that push, so the next fetch works. MLflow's own SQLite store and artifact folder on this machine."""
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    push_artifact(tiny_artifact, uri, say=lambda _: None)
    [lost] = (tmp_path / "store").rglob("artifact/voices.npz")
    lost.unlink()
    root = tmp_path / "machine" / "artifacts"
    with pytest.raises(UserError, match=r"voices\.npz is missing") as refused:
        fetch_artifact(tiny_artifact.id, root, uri, say=lambda _: None)
    assert "push it again" in str(refused.value.hint)
    said: list[str] = []
    push_artifact(tiny_artifact, uri, say=said.append)
    assert any("voices.npz is missing: that push is deleted" in line for line in said), said
    fetched = fetch_artifact(tiny_artifact.id, root, uri, say=lambda _: None)
    assert fetched is not None and fetched.manifest == tiny_artifact.manifest

    def pushed(name: str) -> Path:  # the file in the live push's folder (a deleted run's files stay until `mlflow gc`)
        return max((tmp_path / "store").rglob(f"artifact/{name}"), key=lambda path: path.stat().st_ctime)  # made when pushed

    pushed(MANIFEST).write_text("{")  # a manifest damaged on the server is replaced too
    said.clear()
    push_artifact(tiny_artifact, uri, say=said.append)
    assert any("manifest.json is not readable JSON" in line and "that push is deleted" in line for line in said), said
    import shutil

    shutil.rmtree(pushed(MANIFEST).parent)  # none of its files: rather an artifact store the server does not find than a loss
    with pytest.raises(UserError, match="lists none of its files, so nothing was pushed or deleted"):
        push_artifact(tiny_artifact, uri, say=lambda _: None)


def test_symlinks_in_the_store_are_refused(tracking: str, tiny_artifact: Artifact, tmp_path: Path) -> None:
    push_artifact(tiny_artifact, tracking, say=lambda _: None)  # a no-op when the test above pushed it
    outside = tmp_path / "outside"
    outside.mkdir()
    # a store whose recipe folder is a link elsewhere: the fetch would write outside the store
    root = tmp_path / "linked" / "artifacts"
    root.mkdir(parents=True)
    (root / "tiny").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError, match="leads outside"):
        fetch_artifact(tiny_artifact.id, root, tracking, say=lambda _: None)
    assert not any(outside.iterdir())
    # an artifact already in the store with a file that links outside it: verified before it is used
    root = tmp_path / "copied" / "artifacts"
    link_or_copy(tiny_artifact.path, root / "tiny" / tiny_artifact.id)
    voices = root / "tiny" / tiny_artifact.id / "voices.npz"
    (outside / "voices.npz").write_bytes(voices.read_bytes())
    voices.unlink()
    voices.symlink_to(outside / "voices.npz")
    fetched = fetch_artifact(tiny_artifact.id, root, tracking, say=lambda _: None)  # not trusted: fetched again
    assert fetched is not None and not (fetched.path / "voices.npz").is_symlink()
    assert (outside / "voices.npz").read_bytes() == (fetched.path / "voices.npz").read_bytes()  # left as it was


def test_text_others_wrote_is_printed_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    """A build record's reasons and MLflow tags reach serve's start lines and errors: brackets in them are text, not
    Rich markup (`[/]` stopped serve with a MarkupError), and escape sequences are dropped, not sent to the terminal."""
    from kokoro_opt.cli.app import _print_error, say_line

    say_line("windowed on request: PESQ 3.1 [/] \x1b]0;retitled\x07done")
    _print_error("ambiguous: \x1b[2Jabc [bold]", "give more")
    said = capsys.readouterr().err
    assert "PESQ 3.1 [/] ]0;retitleddone" in said and "abc [bold]" in said and "\x1b" not in said and "\x07" not in said
