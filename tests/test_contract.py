"""The pass contract as the build engine holds passes to it: cache keys follow the code that makes an output,
declared side files are carried forward by the engine, undeclared ones refused, capabilities derived."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from kokoro_opt.artifacts import open_artifact
from kokoro_opt.build import _Engine
from kokoro_opt.contract import Pass, check_order, source_closure
from kokoro_opt.errors import UserError
from kokoro_opt.store import Store


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "kokoro_opt" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_code_key_follows_the_code_a_pass_imports_not_its_comments(tmp_path: Path) -> None:
    def key(files: dict[str, str]) -> tuple:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        _package(root, files)
        return source_closure("kokoro_opt.passes.step", root)

    step = "from kokoro_opt.helper import scale\n\ndef run(x):\n    return scale(x)\n"
    base = key({"passes/step.py": step, "helper.py": "def scale(x):\n    return 2 * x\n", "other.py": "Y = 1\n"})
    assert [name for name, _ in base] == ["kokoro_opt.helper", "kokoro_opt.passes.step"]  # only what it imports
    documented = key(
        {"passes/step.py": step, "helper.py": '"""Doc."""\n# why\ndef scale(x):\n    """Twice."""\n    return 2 * x\n'}
    )
    assert documented == base
    changed = key({"passes/step.py": step, "helper.py": "def scale(x):\n    return 3 * x\n"})
    assert changed != base and changed[1] == base[1]
    lazy = "def run(x):\n    from kokoro_opt.helper import scale\n\n    return scale(x)\n"
    assert [n for n, _ in key({"passes/step.py": lazy, "helper.py": "def scale(x):\n    return x\n"})] == [
        "kokoro_opt.helper",
        "kokoro_opt.passes.step",
    ]


def test_every_real_pass_has_a_code_key_that_covers_its_own_module() -> None:
    from kokoro_opt.passes import PASSES

    for p in PASSES.values():
        assert p.run.__module__ in dict(source_closure(p.run.__module__)) and len(p.code_key()) == 16


class _Config(BaseModel):
    kind: str = "fake"


def _stage(store: Store, p: Pass, source=None, write=None):
    def runner(out: Path) -> dict:
        (out / "model.onnx").write_bytes(b"model")
        for name in write or []:
            (out / name).write_text(name)
        return {"stage": p.kind}

    return _Engine(store, {"id": "here"}).run(p, f"{p.kind}0000000000"[:16], source, runner, "e")


def test_the_engine_carries_declared_side_files_and_refuses_undeclared_ones(tmp_path: Path) -> None:
    store = Store(tmp_path)
    make = Pass("make", _Config, lambda *a: {}, produces=("map.json", "notes.json"), grants=("edges",))
    first = _stage(store, make, write=["map.json", "notes.json", "voices.npz", "kokoro.json"])
    assert first.manifest.side_files == ["map.json", "notes.json"] and first.capabilities.edges
    carry = Pass("carry", _Config, lambda *a: {}, carries=("map.json",), keeps=("edges",))
    second = _stage(store, carry, first)
    assert second.manifest.side_files == ["map.json"] and (second.path / "map.json").read_text() == "map.json"
    assert second.capabilities.edges and [s.kind for s in second.manifest.chain] == ["carry"]
    assert open_artifact(second.path).build.stages == [{"stage": "carry"}]
    plain = Pass("plain", _Config, lambda *a: {})
    third = _stage(store, plain, second)
    assert third.manifest.side_files == [] and not third.capabilities.edges
    sloppy = Pass("sloppy", _Config, lambda *a: {})
    with pytest.raises(UserError, match=r"stage 'sloppy' wrote stray\.json, which it does not declare"):
        _stage(store, sloppy, third, write=["stray.json"])
    assert not list(tmp_path.glob("_cache/sloppy-*"))


def test_a_stage_cannot_follow_one_whose_capability_it_drops() -> None:
    make = Pass("windows", _Config, lambda *a: {}, grants=("windowed",))
    convert = Pass("ort", _Config, lambda *a: {}, keeps=("windowed",))
    rewrite = Pass("simplify", _Config, lambda *a: {})
    passes = {p.kind: p for p in (make, convert, rewrite)}
    check_order(["windows", "ort"], passes)
    check_order(["simplify", "windows"], passes)
    with pytest.raises(UserError, match="stage 'simplify' after stage 'windows' drops what 'windows' made"):
        check_order(["windows", "ort", "simplify"], passes)


def test_a_stage_that_needs_a_capability_follows_a_stage_that_makes_it() -> None:
    make = Pass("windows", _Config, lambda *a: {}, grants=("windowed",))
    fuse = Pass("fuse", _Config, lambda *a: {}, grants=("fused",), keeps=("windowed",), needs=("windowed",))
    rewrite = Pass("simplify", _Config, lambda *a: {})
    passes = {p.kind: p for p in (make, fuse, rewrite)}
    check_order(["simplify", "windows", "fuse"], passes)
    for kinds in (["fuse"], ["simplify", "fuse", "windows"]):
        with pytest.raises(UserError, match=r"stage 'fuse' needs what a 'windows' stage makes \(windowed\)"):
            check_order(kinds, passes)


def test_a_stage_that_rewrites_another_stages_output_comes_after_it() -> None:
    """The fuse stage cuts the generator at the chains the snake and quantize stages make: without them it could
    only fail once it runs, after every stage before it."""
    from kokoro_opt.passes import PASSES

    check_order(["simplify", "snake", "quantize", "windows", "fuse"], PASSES)
    with pytest.raises(UserError, match=r"stage 'fuse' rewrites what a 'quantize' stage makes"):
        check_order(["simplify", "snake", "windows", "fuse"], PASSES)
    with pytest.raises(UserError, match=r"stage 'fuse' rewrites what a 'snake' stage makes"):
        check_order(["quantize", "windows", "fuse"], PASSES)


def test_a_gate_budget_is_out_of_the_decision_key_but_in_the_cache_key() -> None:
    """Loosening the windows gate re-checks the locked statistics (a new output) without measuring them again."""
    from kokoro_opt.passes import PASSES
    from kokoro_opt.recipe import WindowsStage

    windows = PASSES["windows"]
    base = WindowsStage(kind="windows")
    for judged in ({"min_sentence_pesq": 2.5}, {"check_phrases": 3}, {"default_budget": {"min_pesq": 4.0}}):
        other = WindowsStage(kind="windows", **judged)
        assert windows.decision_key(other, "in") == windows.decision_key(base, "in"), judged
        assert windows.cache_key(other, "in") != windows.cache_key(base, "in"), judged
    measured_otherwise = WindowsStage(kind="windows", calibration_sentences=3)
    assert windows.decision_key(measured_otherwise, "in") != windows.decision_key(base, "in")


_KEY = "make000000000000"


def _rerun(store: Store, p: Pass) -> tuple[bool, bytes]:
    engine = _Engine(store, {"id": "here"})
    out = engine.run(p, _KEY, None, lambda out: (out / "model.onnx").write_bytes(b"model") and {}, "e")
    return engine.steps[-1]["cached"], (out.path / "model.onnx").read_bytes()


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: (folder / "model.onnx").write_bytes(b"modem"),  # a changed byte, same size
        lambda folder: (folder / "model.onnx").unlink(),
        lambda folder: (folder / "stray.bin").write_bytes(b"x"),
        lambda folder: (folder / "manifest.json").write_text('{"id": "'),  # unreadable
    ],
)
def test_a_cached_output_damaged_since_is_built_again_not_carried_on(tmp_path: Path, damage) -> None:
    """A stage output is trusted by its manifest's file hashes, checked when it is reused: a damaged one would
    otherwise go into every artifact built from it under a fresh manifest, and 'build it again' would fix nothing."""
    store, p = Store(tmp_path), Pass("make", _Config, lambda *a: {})
    assert _rerun(store, p) == (False, b"model") and _rerun(store, p) == (True, b"model")
    damage(store.stage_path("make", _KEY))
    assert _rerun(store, p) == (False, b"model")  # built again, from scratch
    assert _rerun(store, p) == (True, b"model")


def test_a_killed_build_s_temporary_folders_are_removed_unless_their_build_runs(tmp_path: Path) -> None:
    import fcntl

    from kokoro_opt.artifacts import LOCKS, TEMPORARY, remove_stale_temporaries

    (tmp_path / LOCKS).mkdir()
    left, running = tmp_path / TEMPORARY / "_cache-export-aaaa-0123456789ab", tmp_path / TEMPORARY / "t-bbbb-0123456789ab"
    for folder in (left, running):
        (folder / "big").mkdir(parents=True)
    with open(tmp_path / LOCKS / "t-bbbb", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build of that slot holds it
        remove_stale_temporaries(tmp_path)
    assert not left.exists() and running.exists()


def test_locked_decisions_that_do_not_fit_their_stage_are_one_error() -> None:
    """A lock is a file anyone can edit: decisions of the right JSON types but the wrong shape stop the build with
    the fix, before the pass reads them, not with a traceback from inside it."""
    import json

    from kokoro_opt.passes import PASSES
    from kokoro_opt.paths import PROJECT_ROOT

    lock = PROJECT_ROOT / "recipes" / "int8-mixed.lock.json"
    for slot, entry in json.loads(lock.read_text(encoding="utf-8"))["stages"].items():
        PASSES[slot.split(":")[1]].check_decisions(entry["decisions"], lock)  # the committed lock fits
    quantize, windows = PASSES["quantize"], PASSES["windows"]
    ranged = {"ranges": {"data": {}}, "input_ranges": {}}
    cases = [
        (quantize, {"other": 1}, "field 'int8_units': Field required"),
        (quantize, {"int8_units": 5}, "field 'int8_units'"),
        (quantize, {"int8_units": [], "calibration": {"ranges": {}}}, "field 'calibration.ranges.data'"),
        (quantize, {"int8_units": [], "calibration": ranged}, "field 'calibration.output_ranges': Field required"),
        (quantize, {"int8_units": [], "calibration": ranged | {"output_ranges": {"t": ["AAAAAAAAAAA="]}}},
         "field 'calibration.output_ranges.t.1'"),
        (quantize, {"int8_units": [], "calibration": ranged | {"output_ranges": {"t": ["a", "AAAA"]}}},
         "field 'calibration.output_ranges.t.0': not base64"),
        (quantize, {"int8_units": [], "calibration": ranged | {"output_ranges": {"t": ["AAAA", "AAAA"]}}},
         "field 'calibration.output_ranges.t.0': 3 bytes, not whole float64s"),
        (windows, {"statistics": ["x"]}, "field 'statistics'"),
    ]  # fmt: skip
    for p, wrong, says in cases:
        with pytest.raises(UserError, match=rf"the decisions of stage '{p.kind}' do not fit it \({re.escape(says)}.*--reanalyze"):
            p.check_decisions(wrong, lock)
