"""The build pipeline on the tiny random Kokoro: export, manifest, cache, atomic folders, CLI errors."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kokoro_opt.artifacts import build_folder, link_or_copy, open_artifact
from kokoro_opt.build import build
from kokoro_opt.hashing import file_sha256
from kokoro_opt.manifest import MANIFEST, FileEntry
from kokoro_opt.recipe import load_recipe
from kokoro_opt.runtime.synth import Synthesizer

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

ROOT = Path(__file__).parent.parent


def test_export_writes_a_complete_manifest(tiny_artifact) -> None:
    manifest, record = tiny_artifact.manifest, tiny_artifact.build
    assert manifest.id == tiny_artifact.path.name and manifest.kind == "recipe"
    assert manifest.weights.source == "tiny" and len(manifest.weights.sha256) == 64
    assert {"torch", "onnx", "onnxruntime", "kokoro"} <= set(record.versions)
    export = record.stages[0]
    assert export["stage"] == "export" and export["config"]["opset"] == 17
    assert export["noise"].startswith("deterministic")
    assert export["validation"]["durations_equal"] is True
    for name, entry in manifest.files.items():
        path = tiny_artifact.path / name
        assert path.is_file() and entry.size == path.stat().st_size and len(entry.sha256) == 64
    assert "build.json" not in manifest.files and record.created and record.machine["id"]


def test_exported_graph_has_dynamic_tokens_and_no_random_ops(tiny_artifact) -> None:
    import onnx

    model = onnx.load(str(tiny_artifact.model_file), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"RandomUniformLike", "RandomNormalLike", "RandomUniform", "RandomNormal"}
    assert [i.name for i in model.graph.input] == ["input_ids", "style", "speed"]
    assert [o.name for o in model.graph.output] == ["audio", "durations"]
    assert model.graph.input[0].type.tensor_type.shape.dim[1].dim_param == "tokens"


def test_an_export_runs_deterministically_and_its_audio_is_its_durations(tiny_artifact) -> None:
    """(ORT against torch: the export's own validation, and test_evaluate's eager peer.)"""
    synth = Synthesizer(tiny_artifact)
    tokens = list(range(40, 90))
    a = synth.run_tokens(tokens, "tiny_0")
    b = synth.run_tokens(tokens, "tiny_0")
    assert np.array_equal(a.audio, b.audio)
    assert len(a.durations) == len(tokens) + 2
    assert len(a.audio) == int(a.durations.sum()) * 600


def test_rebuild_is_a_cache_hit_and_a_changed_stage_rebuilds_only_itself(
    tiny_recipe, artifacts_root, tiny_artifact, tmp_path
) -> None:
    again = build(tiny_recipe, artifacts_root)
    assert again.artifact.path == tiny_artifact.path
    assert [s["cached"] for s in again.stages] == [True]

    stage = load_recipe(ROOT / "recipes" / "int8-dynamic.yaml").stages[0]
    quantized = tiny_recipe.model_copy(update={"name": "tiny-dyn", "stages": [stage]})
    first = build(quantized, tmp_path)  # an empty store: nothing another test built is reused
    assert [(s["kind"], s["cached"]) for s in first.stages] == [("export", False), ("quantize", False)]
    second = build(quantized, tmp_path)
    assert all(s["cached"] for s in second.stages)
    changed = quantized.model_copy(update={"stages": [stage.model_copy(update={"exclude_nodes": ["/bert/Gather"]})]})
    third = build(changed, tmp_path)
    assert [(s["kind"], s["cached"]) for s in third.stages] == [("export", True), ("quantize", False)]


def test_build_folder_is_atomic(tmp_path: Path) -> None:
    """A killed fill leaves nothing in the output's place; its lock and temporary folder live beside the
    store's folders (`.locks/`, `.tmp/`), never inside an output that DVC or a reader hashes."""
    final = tmp_path / "recipe" / "thing"

    def crash(out: Path) -> tuple[dict, dict]:
        (out / "model.onnx").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_folder(final, crash)
    assert not (tmp_path / "recipe").exists() and list((tmp_path / ".tmp").iterdir()) == []  # not even an empty folder

    def ok(out: Path) -> tuple[dict, dict]:
        (out / "model.onnx").write_bytes(b"whole")
        return {"id": "thing", "kind": "test"}, {"created": "now"}

    build_folder(final, ok)
    assert sorted(p.name for p in (tmp_path / "recipe").iterdir()) == ["thing"]
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["files"]["model.onnx"]["size"] == 5 and json.loads((final / "build.json").read_text())["created"] == "now"


def test_a_folder_whose_build_record_cannot_be_read_is_built_again(tmp_path: Path) -> None:
    """build.json is not among the hashed files, but every build that reuses the folder reads it: a truncated one
    used to stop every later build with a hint ("rebuild") that could not work."""
    from kokoro_opt.artifacts import folder_damage

    final = tmp_path / "recipe" / "thing"
    fills = []

    def fill(out: Path) -> tuple[dict, dict]:
        fills.append(out)
        (out / "model.onnx").write_bytes(b"whole")
        return {"id": "thing", "kind": "test"}, {"created": f"fill {len(fills)}"}

    build_folder(final, fill)
    record = final / "build.json"
    record.write_text(record.read_text()[:20])  # as a crash before the disk wrote it all
    assert "build.json is not readable JSON" in (folder_damage(final) or "")
    build_folder(final, fill)
    assert len(fills) == 2 and json.loads(record.read_text())["created"] == "fill 2" and folder_damage(final) is None


def test_evaluate_refuses_a_reference_changed_since_it_was_built(tiny_artifact, tmp_path: Path) -> None:
    """Scores against a changed fp32 export would be logged under its id, and found again as measured after
    `build` repaired it."""
    from kokoro_opt.evaluate.runners import reference_folder

    store, recipe = tmp_path / "store", tmp_path / "simplified.yaml"
    shutil.copytree(tiny_artifact.path.parent.parent, store, ignore=shutil.ignore_patterns(".locks", ".tmp"))
    tiny = ROOT / "recipes" / "tiny.yaml"
    recipe.write_text(f"extends: {tiny}\nname: simplified\nstages:\n  - {{kind: simplify, tool: none}}\n")
    built = run_cli("build", str(recipe), "--artifacts", str(store), "--no-evaluate")
    assert built.returncode == 0, built.stderr
    copy = next((store / "simplified").iterdir())
    reference = reference_folder(open_artifact(copy))
    assert reference is not None and reference.is_relative_to(store / "_cache")
    with (reference / "model.onnx").open("r+b") as model:  # a weight changed, the file still loads
        model.seek(-64, os.SEEK_END)
        model.write(bytes(64))
    result = run_cli("evaluate", str(copy), "--artifacts", str(store), "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}")
    said = " ".join(result.stderr.split())
    assert result.returncode == 2 and "model.onnx does not match its manifest" in said and "kokoro-opt build" in said, said


def test_a_store_folder_on_another_file_system_is_refused_before_the_work(tmp_path: Path) -> None:
    """`_cache` linked to a larger disk: no folder could be renamed into it from the store's `.tmp` (EXDEV), and
    every build used to fail after its first stage's work."""
    from kokoro_opt.errors import UserError

    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system here")
    elsewhere = Path(tempfile.mkdtemp(dir=other))
    try:
        (tmp_path / "_cache").symlink_to(elsewhere)
        filled = []
        with pytest.raises(UserError, match=r"on another file system than .*keep a store on one file system"):
            build_folder(tmp_path / "_cache" / "export-x", lambda out: filled.append(out) or ({}, {}))
        assert filled == [] and list(elsewhere.iterdir()) == []
    finally:
        shutil.rmtree(elsewhere)


def test_a_killed_build_leaves_nothing_and_resumes(tmp_path: Path) -> None:
    """SIGKILL a real `kokoro-opt build` mid-export: no artifact appears; the rerun completes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "kokoro_opt.cli",
        "build",
        str(ROOT / "recipes" / "tiny.yaml"),
        "--artifacts",
        str(tmp_path),
        "--no-evaluate",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = 120
    import time

    start = time.time()
    while time.time() - start < deadline and not list((tmp_path / ".tmp").glob("_cache-export-*")):
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert list(tmp_path.glob(".tmp/_cache-export-*")), "the build was not killed mid-export"
    assert not list(tmp_path.glob("_cache/export-*/manifest.json"))
    assert not (tmp_path / "tiny").exists()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert open_artifact(tmp_path / "tiny").manifest.weights.source == "tiny"
    assert not list(tmp_path.glob(".tmp/*"))  # the killed build's temporary folder is gone


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kokoro_opt.cli", *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_fresh_store_is_readable_by_others_and_the_weights_cache_keeps_to_itself(tmp_path: Path) -> None:
    """Folders as the umask makes them (a serving account reads the store), and the weights cache's lock and
    scratch inside KOKORO_OPT_CACHE, not beside it."""
    env = {**os.environ, "KOKORO_OPT_CACHE": str(tmp_path / "cache")}
    result = run_cli("build", str(ROOT / "recipes" / "tiny.yaml"), "--artifacts", str(tmp_path / "a"), "--no-evaluate", env=env)
    assert result.returncode == 0, result.stderr
    umask = os.umask(0)
    os.umask(umask)
    built = [p for p in (tmp_path / "a").rglob("*") if p.is_dir() and (p / "manifest.json").is_file()]
    assert built and all(stat.S_IMODE(p.stat().st_mode) == 0o777 & ~umask for p in built)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "cache"]


def test_cli_mistakes_outside_recipes_are_one_line_too(tiny_artifact, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (["build", str(ROOT / "recipes" / "tiny.yaml"), "--artifacts", str(a_file)], "Not a directory"),
        (["evaluate", str(tiny_artifact.path), "--runs", "0"], "--runs input should be greater than or equal to 1"),
        (["compare", str(tiny_artifact.path), "--sentences", "49"], "--sentences input should be less than or equal to 48"),
        (["tune", str(ROOT / "recipes" / "tiny.yaml")], "is a build recipe, not a tuning recipe"),
        # nothing listens on port 9: at once, not after MLflow's minutes of retries
        (["push", str(tiny_artifact.path), "--tracking-uri", "http://127.0.0.1:9"], "does not answer"),
        (
            ["fetch", "abcdef12", "--tracking-uri", "foo://bar", "--artifacts", str(tmp_path / "f")],
            "no tracking store for foo://",
        ),
        (
            ["build", str(ROOT / "recipes" / "tiny.yaml"), "--no-evaluate", "--tracking-uri", "http://127.0.0.1:9"],
            "--tracking-uri would change nothing",
        ),
        # checked before the build whose evaluation it would log
        (
            [
                "build",
                str(ROOT / "recipes" / "tiny.yaml"),
                "--artifacts",
                str(tmp_path / "b"),
                "--tracking-uri",
                "http://127.0.0.1:9",
            ],
            "does not answer",
        ),
        (["build", str(ROOT / "recipes" / "tune-cpu.yaml")], "is a tuning recipe, not a build recipe"),
        (["build", str(ROOT / "recipes" / "tiny.yaml"), "--reanalyze"], "--reanalyze would change nothing: recipe tiny"),
        (["compare", str(tiny_artifact.path), "--no-log", "--tracking-uri", "http://127.0.0.1:9"], "with --no-log"),
        (["tune", "--show", "--seed", "3"], "--show alone runs no trial: --seed would change nothing"),
        (["serve", "--public-metrics"], "--public-metrics changes nothing without --api-key"),
        (["voices", "--artifact", ""], "the artifact given is an empty name"),
        # measuring commands: what they are given and where results go, before anything is built or measured
        (["evaluate", str(ROOT / "recipes" / "tiny.yaml"), "--runs", "0", "--artifacts", str(tmp_path / "b")], "--runs"),
        (["evaluate", str(tiny_artifact.path), "--peer", "bogus"], "unknown peer(s) bogus"),
        (["compare", str(tiny_artifact.path), "--tracking-uri", "http://127.0.0.1:9"], "does not answer"),
        (["evaluate", str(tiny_artifact.path.parent.parent / "_cache")], "_cache is not an artifact folder"),
        # a recipe's name where its folder or an id belongs: the hint names the folder
        (
            [
                "say",
                "Hi.",
                "-o",
                str(tmp_path / "hi.wav"),
                "--artifact",
                tiny_artifact.path.parent.name,
                "--artifacts",
                str(tiny_artifact.path.parent.parent),
            ],
            f"{tiny_artifact.path.parent} is that recipe's folder",
        ),
    ]
    for args, message in cases:
        result = run_cli(*args)
        said = " ".join(result.stderr.split())  # the console wraps long lines
        assert result.returncode == 2 and message in said and "Traceback" not in said, (args, result.stderr)
    assert not (tmp_path / "b").exists()
    damaged = tmp_path / "copy" / tiny_artifact.path.name
    shutil.copytree(tiny_artifact.path, damaged)
    (damaged / "model.onnx").write_bytes(b"not a model")
    for command in ("evaluate", "compare"):
        result = run_cli(command, str(damaged), "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}")
        assert result.returncode == 2 and "model.onnx does not match its manifest" in result.stderr, result.stderr
        assert "build it again" in result.stderr
    fetched = run_cli("fetch", tiny_artifact.id, "--artifacts", str(tmp_path), "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}")
    said = " ".join(fetched.stderr.split())  # built here and never pushed: nothing to fetch it from
    assert fetched.returncode == 2 and "model.onnx does not match its manifest" in said and "build it again" in said, said
    manifest = json.loads((damaged / "manifest.json").read_text())
    (damaged / "manifest.json").unlink()
    (damaged / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))  # as an older kokoro-opt wrote it
    fetched = run_cli("fetch", tiny_artifact.id, "--artifacts", str(tmp_path), "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}")
    said = " ".join(fetched.stderr.split())
    assert fetched.returncode == 2 and "its manifest lists no file hashes" in said, said
    renamed = tmp_path / "elsewhere" / "good"  # no fetch could place it: refused before anything is sent
    shutil.copytree(tiny_artifact.path, renamed)
    result = run_cli("push", str(renamed), "--tracking-uri", f"sqlite:///{tmp_path / 'new' / 'p.db'}")
    assert result.returncode == 2 and "is not where a store keeps artifact" in result.stderr, result.stderr
    assert not (tmp_path / "new").exists()  # refused before a tracking store was made for it


def test_cli_user_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nexport:\n  opsett: 3\n")
    result = run_cli("build", str(bad), "--artifacts", str(tmp_path / "a"))
    assert result.returncode == 2
    assert "unknown field 'export.opsett'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "a").exists()
    bad.write_text("extends: [fp32.yaml]\n")
    result = run_cli("build", str(bad), "--artifacts", str(tmp_path / "a"))
    assert result.returncode == 2 and "field 'extends' must be one recipe file" in result.stderr

    voice = tmp_path / "voice.yaml"
    voice.write_text(f"extends: {ROOT / 'recipes' / 'tiny.yaml'}\nname: voice\nweights:\n  source: tiny\n  voices: [af_nobody]\n")
    result = run_cli("build", str(voice), "--artifacts", str(tmp_path / "a"), "--no-evaluate")
    assert result.returncode == 2 and "unknown voice(s) af_nobody" in result.stderr and "tiny_0" in result.stderr
    assert "Traceback" not in result.stderr


def test_what_a_user_mistypes_is_one_line_before_any_work(tiny_artifact, tmp_path: Path) -> None:
    """Outputs, ports, client lists and recipes are checked before a model loads; a model file that does not
    load is named, not a traceback."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir.wav").mkdir()
    empty = tmp_path / "append.yaml"
    empty.write_text(f"extends: {ROOT / 'recipes' / 'tiny.yaml'}\nname: append\nstages: 5\nappend_stages: [{{kind: ort}}]\n")
    broken = tmp_path / "tiny" / tiny_artifact.id
    link_or_copy(tiny_artifact.path, broken)
    (broken / "model.onnx").unlink()  # a hard link to the fixture's file: replaced, not written through
    (broken / "model.onnx").write_bytes(b"not a model")
    files = {**tiny_artifact.manifest.files, "model.onnx": FileEntry(sha256=file_sha256(broken / "model.onnx"), size=11)}
    (broken / MANIFEST).unlink()  # its manifest says so: the folder is intact, its model does not load
    (broken / MANIFEST).write_text(tiny_artifact.manifest.model_copy(update={"files": files}).to_json(), encoding="utf-8")
    say = ("say", "Hi.", "--artifact", str(tiny_artifact.path), "-o")
    cases = {
        (*say, str(tmp_path / "x.mp3")): "is not a .wav file name",
        (*say, str(tmp_path / "adir")): "adir is a folder",
        (*say, str(tmp_path / "adir.wav")): "adir.wav is a folder",
        # checked before the measuring (a minute and more), not when the plot is saved after it
        ("compare", str(tiny_artifact.path), "--no-log", "--plot", str(tmp_path / "pareto.txt")): "is not a .png file name",
        (*say, str(tmp_path / "afile" / "x.wav")): "is a file, not a folder",
        ("say", "Hi.", "--artifact", str(broken), "-o", str(tmp_path / "y.wav")): "model.onnx does not load in ONNX Runtime",
        ("build", str(empty), "--artifacts", str(tmp_path / "a"), "--no-evaluate"): "field 'stages' must be a list",
        ("bench-serve", "--clients", "1,x"): "is not a list of client counts",
        ("bench-serve", "--format", "mp3", "--no-full"): "bench-serve measures playback on pcm or wav",
        ("serve", "--port", "99999"): "less than or equal to 65535",
        # before an artifact is sought: none is under this root
        ("serve", "--allowed-host", "https://tts.example.com", "--artifacts", str(tmp_path / "none")): (
            "'https://tts.example.com' is not a host name"
        ),
        ("serve", "--allowed-host", "", "--artifacts", str(tmp_path / "none")): "'' is not a host name",
        # an empty artifacts folder is named in full, with how to point at the one a build filled
        ("say", "Hi.", "--artifacts", str(tmp_path / "none"), "-o", str(tmp_path / "z.wav")): (
            f"no artifacts under {tmp_path.resolve() / 'none'} — build the flagship with `make build` in the checkout, and "
            "run from there or pass --artifacts DIR"
        ),
        ("serve", "--artifact", str(broken), "--port", "0"): "model.onnx does not load in ONNX Runtime",  # then ends
    }
    for command, message in cases.items():
        result = run_cli(*command)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, (command, result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "adir.wav", "afile", "append.yaml", "tiny"]  # nothing written


def test_say_writes_a_24khz_wav_and_rejects_a_bad_voice(tiny_artifact, tmp_path: Path) -> None:
    import soundfile as sf

    out = tmp_path / "hello.wav"
    result = run_cli("say", "Hello world.", "--artifact", str(tiny_artifact.path), "--voice", "tiny_0", "-o", str(out))
    assert result.returncode == 0, result.stderr
    audio, rate = sf.read(out)
    assert rate == 24000 and len(audio) > 2400
    result = run_cli("say", "Hello.", "--artifact", str(tiny_artifact.path), "--voice", "nobody", "-o", str(out))
    assert result.returncode == 2 and "unknown voice 'nobody'" in result.stderr and "or an OpenAI name: alloy" in result.stderr
    assert "speaking with" not in result.stderr  # refused before the model loads
    # OpenAI's names speak as the server speaks them; alloy, the server's default, is say's too: any artifact has it
    result = run_cli("say", "Hello.", "--artifact", str(tiny_artifact.path), "-o", str(out))
    assert result.returncode == 0, result.stderr


def test_say_reads_text_piped_in_and_writes_the_wav_to_standard_output(tiny_artifact, tmp_path: Path) -> None:
    """`kokoro-opt say - < chapter.txt -o - | player`: nothing is written to the working folder."""
    import io

    import soundfile as sf

    command = [sys.executable, "-m", "kokoro_opt.cli", "say", "-", "--artifact", str(tiny_artifact.path), "-o", "-"]
    done = subprocess.run(command, input=b"Hello world.\n", capture_output=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode()
    audio, rate = sf.read(io.BytesIO(done.stdout))
    assert rate == 24000 and len(audio) > 2400 and b"to standard output" in done.stderr
    assert list(tmp_path.iterdir()) == []
    for piped, says in ((b"", "nothing was piped in"), (b"\xff\xfe", "not UTF-8")):
        done = subprocess.run(command, input=piped, capture_output=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 2 and says in done.stderr.decode() and not done.stdout, done.stderr.decode()
    latin1 = [*command[:4], b"caf\xe9 au lait", *command[5:]]  # an argument in another encoding: one line, as piped in
    done = subprocess.run(latin1, capture_output=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2 and "the text given is not UTF-8 (byte 3)" in done.stderr.decode(), done.stderr.decode()
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path) as early:
        early.stdout.close()  # type: ignore[union-attr]  # the player quit before the WAV came (`| head -c 0`)
        _, said = early.communicate(b"Hello world.", timeout=300)
    assert early.returncode == 0 and b"Traceback" not in said, said.decode()
    if Path("/dev/full").exists():  # a full disk is one line naming the cause, as any the file system refuses
        with open("/dev/full", "wb") as full:
            done = subprocess.run(command, input=b"Hi.", stdout=full, stderr=subprocess.PIPE, timeout=300, cwd=tmp_path)
        said = " ".join(done.stderr.decode().split())
        assert done.returncode == 2 and "No space left on device — free space there" in said and "Traceback" not in said, said


def test_an_artifact_path_that_is_not_one_says_what_it_is(tiny_artifact, tmp_path: Path) -> None:
    recipe = Path(__file__).parent.parent / "recipes" / "tiny.yaml"
    cases = {
        str(tmp_path / "missing" / "x"): "no such folder",  # a path, not taken for an id
        str(recipe): "is a recipe, not an artifact — build it first: kokoro-opt build",
        str(tmp_path): "is not an artifact folder",
    }
    for spec, message in cases.items():
        for command in (["say", "Hi.", "-o", str(tmp_path / "x.wav")], ["voices"]):
            result = run_cli(*command, "--artifact", spec)
            assert result.returncode == 2 and message in result.stderr, (command, spec, result.stderr)
    assert not (tmp_path / "x.wav").exists()


def test_a_folder_changed_since_it_was_built_is_never_spoken_with(tiny_artifact, tmp_path: Path) -> None:
    """What `say` and `serve` take by path or as `best` is checked against its manifest, as `evaluate` and an id
    are: a changed file is one error naming it, not audio from what the id no longer names."""
    copy = tmp_path / "artifacts" / "tiny" / tiny_artifact.id
    link_or_copy(tiny_artifact.path, copy)
    voices = copy / "voices.npz"
    data = voices.read_bytes()
    voices.unlink()  # a hard link to the fixture's file: replaced, not written through
    voices.write_bytes(data + b"\0")
    out = tmp_path / "x.wav"
    for spec in (str(copy), "best"):
        result = run_cli("say", "Hi.", "--artifact", spec, "--artifacts", str(tmp_path / "artifacts"), "-o", str(out))
        assert result.returncode == 2 and "voices.npz" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not out.exists()


def test_an_id_prefix_two_artifacts_share_is_refused(tiny_artifact, tmp_path: Path) -> None:
    from kokoro_opt.errors import UserError
    from kokoro_opt.select import artifact_by_id

    root = tmp_path / "artifacts"
    for artifact_id in ("aaaa0000aaaa0001", "aaaa0000aaaa0002"):
        folder = root / "tiny" / artifact_id
        link_or_copy(tiny_artifact.path, folder)
        (folder / MANIFEST).unlink()
        (folder / MANIFEST).write_text(tiny_artifact.manifest.model_copy(update={"id": artifact_id}).to_json())
    with pytest.raises(UserError, match="matches aaaa0000aaaa0001, aaaa0000aaaa0002"):
        artifact_by_id("aaaa", root)
    assert artifact_by_id("aaaa0000aaaa0002", root).id == "aaaa0000aaaa0002"
    with pytest.raises(UserError, match="an empty artifact id"):
        artifact_by_id("", root)


def test_an_interrupted_command_says_what_it_kept(capsys) -> None:
    """Ctrl-C exits with 130; only a command that keeps its finished work says how to go on from it."""
    import typer

    from kokoro_opt.cli.app import user_errors

    def build() -> None:
        raise KeyboardInterrupt

    def say() -> None:
        raise KeyboardInterrupt

    for command, said in ((build, "interrupted: completed stages stay cached; rerun"), (say, "interrupted\n")):
        with pytest.raises(typer.Exit) as stopped:
            user_errors(command)()
        assert stopped.value.exit_code == 130 and said in capsys.readouterr().err


def test_evaluate_fails_when_a_target_was_not_measured(tiny_artifact, tmp_path: Path) -> None:
    """A model ONNX Runtime will not load is reported and skipped, so the other targets are still measured, and the
    command then ends with an error naming it: a script must not read "nothing measured" as success."""
    from onnx import TensorProto, helper

    from kokoro_opt.hashing import file_sha256
    from kokoro_opt.manifest import FileEntry, read_manifest

    folder = tmp_path / "store" / tiny_artifact.path.parent.name / tiny_artifact.id
    shutil.copytree(tiny_artifact.path, folder)
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [value], [value])
    model = folder / "model.onnx"
    model.unlink()
    model.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 99)]).SerializeToString())
    manifest = read_manifest(folder)
    manifest.files["model.onnx"] = FileEntry(sha256=file_sha256(model), size=model.stat().st_size)
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").write_text(manifest.to_json())
    result = run_cli("evaluate", str(folder), "--artifacts", str(tmp_path / "store"), "--runs", "1", "--sentences", "1",
                     "--phrases", "1", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}")  # fmt: skip
    assert "cannot be loaded, skipped" in result.stderr, result.stderr
    assert result.returncode == 2 and f"not evaluated: {manifest.name} {tiny_artifact.id[:8]}" in result.stderr


def test_evaluate_all_refuses_a_damaged_artifact_before_measuring_any(tiny_artifact, tmp_path: Path) -> None:
    """Not after measuring the ones listed before it, whose results would then never be shown."""
    store = tmp_path / "store"
    good = store / tiny_artifact.path.parent.name / tiny_artifact.id
    shutil.copytree(tiny_artifact.path, good)
    damaged = store / "zz-damaged" / tiny_artifact.id
    shutil.copytree(tiny_artifact.path, damaged)
    (damaged / "voices.npz").unlink()
    (damaged / "voices.npz").write_bytes(b"not the voices")
    tracking = tmp_path / "mlflow.db"
    result = run_cli("evaluate", "all", "--artifacts", str(store), "--runs", "1", "--sentences", "1", "--phrases", "1",
                     "--tracking-uri", f"sqlite:///{tracking}")  # fmt: skip
    assert result.returncode == 2 and f"at {damaged}" in result.stderr and "build it again" in result.stderr
    assert not tracking.exists()  # nothing measured, nothing logged


def test_the_validation_voice_is_checked_before_the_export_and_only_when_it_validates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown voice stops a validated export before minutes of tracing (on the real weights), not after; an
    export that is not validated traces with any voice, as before."""
    from kokoro_opt import export
    from kokoro_opt.errors import UserError
    from kokoro_opt.recipe import ExportConfig, WeightsConfig
    from kokoro_opt.weights.sources import resolve_weights

    weights = resolve_weights(WeightsConfig(source="tiny"), log=lambda _: None)
    traced = export.export_onnx
    monkeypatch.setattr(export, "export_onnx", lambda *_: pytest.fail("traced before the voice was checked"))
    with pytest.raises(UserError, match=r"unknown voice 'nobody' in export.validation.voice.*tiny_0"):
        export.run_export(weights, ExportConfig.model_validate({"validation": {"voice": "nobody"}}), tmp_path)
    monkeypatch.setattr(export, "export_onnx", traced)
    unvalidated = ExportConfig.model_validate({"validate": False, "validation": {"voice": "nobody"}})
    assert "validation" not in export.run_export(weights, unvalidated, tmp_path)
    assert (tmp_path / "model.onnx").is_file()


def test_plain_output_reads_well_to_a_screen_reader(tiny_artifact, tmp_path: Path, monkeypatch) -> None:
    """KOKORO_OPT_PLAIN=1: no box-drawing characters (read out one by one) and no live bar (every redraw read out
    again); each step on a line of its own."""
    import io
    import re

    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.tables import PLAIN_ENV, print_table

    drawing = re.compile("[\u2500-\u259f\u2800-\u28ff]")  # box drawing, blocks, the spinner's braille
    env = {**os.environ, PLAIN_ENV: "1"}
    done = run_cli("build", str(ROOT / "recipes" / "tiny.yaml"), "--artifacts", str(tmp_path / "a"), "--no-evaluate", env=env)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "tiny: weights (0 of " in said and "tiny: done (" in said and not drawing.search(said), said
    helped = run_cli("say", "--help", env=env)  # Click's plain help, not Rich's boxed panels
    assert helped.returncode == 0 and "--voice" in helped.stdout and not drawing.search(helped.stdout), helped.stdout
    for plain in ("1", ""):
        table = Table("artifact", "speed-up")
        table.add_row("int8-mixed", "3.10x")
        out = io.StringIO()
        monkeypatch.setenv(PLAIN_ENV, plain)
        print_table(Console(file=out, width=80), table)
        assert "int8-mixed" in out.getvalue() and bool(drawing.search(out.getvalue())) == (not plain)
