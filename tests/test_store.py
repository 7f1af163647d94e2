"""The store and pass contract: cache keys that cover every input, locks for measured decisions,
one place for feeds, no import cycles."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest

from kokoro_opt import paths
from kokoro_opt.artifacts import folder_damage
from kokoro_opt.build import build
from kokoro_opt.errors import UserError
from kokoro_opt.locks import lock_path, read_lock
from kokoro_opt.passes import PASSES
from kokoro_opt.recipe import Stage, load_recipe, parse_recipe
from kokoro_opt.store import Store, stage_chain
from tests.test_passes import TINY_MIXED

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "kokoro_opt"


def recipe_with(tiny_recipe, name: str, stages: list[dict]):
    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name=name, stages=stages)
    return parse_recipe(data)


@pytest.fixture
def project_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout whose data files a test may edit: the package reads them relative to the project."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "calibration", project / "calibration")
    monkeypatch.setattr(paths, "PROJECT_ROOT", project)
    return project


@pytest.fixture
def seeded(tiny_artifact):
    """`seeded(root)`: a new artifact root holding the session's tiny export, nothing else. What these
    tests check happens after the export, which costs ~10 s a build on a fresh root."""
    source = Store(tiny_artifact.path.parent.parent)
    key = stage_chain(tiny_artifact)[0].key

    def seed(root: Path) -> Path:
        shutil.copytree(source.stage_path("export", key), Store(root).stage_path("export", key))
        return root

    return seed


def cached(result) -> dict[str, bool]:
    return {entry["kind"]: entry["cached"] for entry in result.stages}


def test_editing_the_calibration_corpus_rebuilds_smooth_and_quantize_not_export(
    tiny_recipe, project_copy, tmp_path, seeded
) -> None:
    recipe = recipe_with(
        tiny_recipe,
        "t-keys",
        [
            {"kind": "simplify"},  # folds Snake's 1/alpha, which smooth needs
            {"kind": "smooth", "calibration_sentences": 1},  # the first sentence, edited below
            {"kind": "quantize", "mode": "static", "op_types": ["MatMul"], "calibration_sentences": 1},
        ],
    )
    root = seeded(tmp_path / "artifacts")
    first = build(recipe, root)
    assert cached(build(recipe, root)) == {"export": True, "simplify": True, "smooth": True, "quantize": True}

    corpus = project_copy / "calibration" / "sentences.txt"
    lines = corpus.read_text(encoding="utf-8").splitlines()
    first_sentence = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    lines[first_sentence] = "A different first calibration sentence, about seven purple kites."
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    edited = build(recipe, root)
    assert cached(edited) == {"export": True, "simplify": True, "smooth": False, "quantize": False}
    assert edited.artifact.id != first.artifact.id

    # the sensitivity sentences are read by quantize only
    sensitivity = project_copy / "calibration" / "sensitivity.txt"
    sensitivity.write_text(sensitivity.read_text(encoding="utf-8") + "One more held-out sentence.\n", encoding="utf-8")
    assert cached(build(recipe, root)) == {"export": True, "simplify": True, "smooth": True, "quantize": False}


def test_data_files_are_found_relative_to_the_project_not_the_working_directory(tmp_path, monkeypatch) -> None:
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "sentences.txt").write_text("Not the project's corpus.\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    from kokoro_opt.passes.qdq import calibration_corpus

    assert "Not the project's corpus." not in calibration_corpus()
    assert len(calibration_corpus()) >= 12


def test_every_stage_kind_declares_one_pass_with_its_inputs() -> None:
    kinds = {t.model_fields["kind"].annotation.__args__[0] for t in Stage.__origin__.__args__}  # type: ignore[attr-defined]
    assert kinds == set(PASSES)
    for kind, p in PASSES.items():
        assert p.kind == kind and len(p.code_key()) == 16 and p.libraries
        for name in p.reads:
            assert (ROOT / name).is_file(), f"{kind} reads {name}, which is not in the project"
    produced = {name for p in PASSES.values() for name in p.produces}
    for p in PASSES.values():
        assert set(p.consumes) <= produced, f"{p.kind} consumes a side file no pass produces"
    assert PASSES["quantize"].decides and "precision_map.json" in PASSES["quantize"].produces


def test_manifest_records_chain_parent_reference_and_machine(tiny_recipe, artifacts_root, tiny_artifact) -> None:
    result = build(recipe_with(tiny_recipe, "t-chain", [{"kind": "simplify"}]), artifacts_root)
    manifest = result.artifact.manifest
    chain = stage_chain(result.artifact)
    assert [e.kind for e in chain] == ["export", "simplify"]
    assert manifest.parent == chain[0].key == manifest.reference_export == tiny_artifact.id
    store = Store(artifacts_root)
    assert store.reference_export(result.artifact).id == tiny_artifact.id
    assert store.parent(result.artifact).id == tiny_artifact.id
    machine = result.artifact.build.machine
    assert machine["id"] and machine["cores"] >= 1
    assert "directory" not in result.artifact.kokoro["weights"]  # no folder of the building machine in an artifact
    assert not (result.artifact.path / "stage.log").exists()  # simplify says nothing: an empty log is not kept


def test_what_libraries_print_during_a_stage_goes_to_its_log_not_the_terminal(tmp_path: Path, capfd) -> None:
    """docs/stages.md: a stage's library chatter (print, warnings, logging, native code writing to fd 1) goes to
    the artifact's stage.log; the terminal keeps the build's own progress. Everything is restored afterwards."""
    import logging
    import os
    import sys

    from kokoro_opt.build import third_party_output

    log_file = tmp_path / "stage.log"
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with third_party_output(log_file):
        print("from print")
        sys.stderr.write("from stderr\n")
        logging.getLogger("some.library").info("from logging")
        sys.stdout.flush()
        os.write(1, b"from native code\n")
    print("after the stage")
    written, terminal = log_file.read_text(), capfd.readouterr()
    for line in ("from print", "from stderr", "INFO some.library: from logging", "from native code"):
        assert line in written and line not in terminal.out + terminal.err
    assert "after the stage" in terminal.out and "after the stage" not in written
    assert root.handlers == handlers and root.level == level


def test_a_recipe_edited_outside_its_stages_is_packaged_again_under_the_same_id(tiny_recipe, artifacts_root) -> None:
    """Its stages are cached and its id is theirs; its manifest records the recipe as it is now, since `evaluate` and
    `tune` read the recipe's evaluation settings there. A server may be reading the folder: its files stay."""
    first = build(recipe_with(tiny_recipe, "t-edited", [{"kind": "simplify"}]), artifacts_root).artifact
    model = (first.path / "model.onnx").stat().st_ino
    edited = recipe_with(tiny_recipe, "t-edited", [{"kind": "simplify"}])
    edited = edited.model_copy(update={"evaluate": edited.evaluate.model_copy(update={"runs": 7})})
    again = build(edited, artifacts_root).artifact
    assert again.id == first.id and again.path == first.path
    assert first.manifest.recipe["evaluate"]["runs"] != 7 and again.manifest.recipe["evaluate"]["runs"] == 7
    assert (again.path / "model.onnx").stat().st_ino == model  # the manifest rewritten, the files left in place
    assert again.build.stages == first.build.stages and folder_damage(again.path) is None


def test_lock_applies_measured_decisions_on_a_new_machine_without_reanalysis(tiny_recipe, tmp_path, capsys, seeded) -> None:
    recipe = recipe_with(tiny_recipe, "t-lock", [TINY_MIXED])
    lock = lock_path(tmp_path / "t-lock.yaml")
    analysed = build(recipe, seeded(tmp_path / "a"), lock=lock)
    assert analysed.lock_written == lock
    entry = read_lock(lock)["0:quantize"]
    record = analysed.artifact.build.stages[-1]
    assert record["mixed"]["decisions_from"] == "analysis"
    assert entry.decisions == record["decisions"] and entry.machine["id"]

    # another machine: an artifact root without the quantize stage, the committed lock
    locked = build(recipe, seeded(tmp_path / "b"), lock=lock)
    record = locked.artifact.build.stages[-1]
    assert record["mixed"]["decisions_from"] == "lock" and record["mixed"]["final_quality"]["passes"]
    assert record["mixed"]["calibration_from"] == "lock" and not record["seconds"]["calibration"]
    assert locked.lock_written is None
    same = (analysed.artifact.path / "model.onnx").read_bytes() == (locked.artifact.path / "model.onnx").read_bytes()
    assert same, "the locked build must make the analysed model"

    # a lock without calibration ranges (written before they were pinned): measured here, lock completed
    data = json.loads(lock.read_text())
    del data["stages"]["0:quantize"]["decisions"]["calibration"]
    lock.write_text(json.dumps(data))
    completed = build(recipe, seeded(tmp_path / "c"), lock=lock)
    assert completed.lock_written == lock and read_lock(lock)["0:quantize"] == entry
    assert completed.artifact.build.stages[-1]["mixed"]["calibration_from"] == "measured"
    assert (completed.artifact.path / "model.onnx").read_bytes() == (analysed.artifact.path / "model.onnx").read_bytes()

    # other weights (the official ones where Hugging Face answers) measure their own decisions, locked beside
    assert json.loads(lock.read_text())["weights"] == "tiny"
    committed = json.loads(lock.read_text()) | {"weights": "pypi-int8"}
    lock.write_text(json.dumps(committed))
    capsys.readouterr()
    beside = build(recipe, tmp_path / "a", lock=lock)  # this machine's own analysis, cached
    assert "t-lock.lock.json holds decisions measured on other weights" in capsys.readouterr().err
    assert beside.locks == (beside.lock_written,) == (tmp_path / "t-lock.tiny.lock.json",)
    assert json.loads(lock.read_text()) == committed
    assert read_lock(beside.lock_written)["0:quantize"].decisions == entry.decisions
    applied = build(recipe, seeded(tmp_path / "d"), lock=lock)  # applied from the weights' lock
    assert applied.lock_written is None and applied.locks == (beside.lock_written,)
    beside.lock_written.unlink()
    lock.write_text(json.dumps(committed | {"weights": "tiny"}))

    # --reanalyze measures again, and rewrites a lock that no longer reads
    lock.write_text("{")
    again = build(recipe, tmp_path / "a", lock=lock, reanalyze=True)  # this machine's own analysis, cached
    assert again.artifact.build.stages[-1]["mixed"]["decisions_from"] == "analysis"
    assert again.lock_written == lock and read_lock(lock)["0:quantize"].decisions == entry.decisions

    # a changed input makes the lock stale: analysed again and rewritten
    changed = recipe_with(tiny_recipe, "t-lock", [{**TINY_MIXED, "min_block_time_share": 0.02}])
    rebuilt = build(changed, tmp_path / "a", lock=lock)
    assert rebuilt.artifact.build.stages[-1]["mixed"]["decisions_from"] == "analysis"
    assert read_lock(lock)["0:quantize"].decision_key != entry.decision_key


def test_a_recipe_that_extends_a_locked_one_applies_its_lock(tiny_recipe, tmp_path, seeded) -> None:
    """`int8-mixed-ort.yaml` appends a stage to `int8-mixed.yaml`: its quantize stage is the same, and so
    are its decisions, taken from `int8-mixed.lock.json` instead of analysed again."""
    import yaml

    parent = recipe_with(tiny_recipe, "t-parent", [TINY_MIXED])
    parent_file = tmp_path / "t-parent.yaml"
    parent_file.write_text(yaml.safe_dump(parent.model_dump(mode="json", by_alias=True)))
    build(parent, seeded(tmp_path / "a"), lock=lock_path(parent_file))
    child_file = tmp_path / "t-child.yaml"
    child_file.write_text(yaml.safe_dump({"extends": "t-parent.yaml", "name": "t-child", "append_stages": [{"kind": "ort"}]}))
    child = build(load_recipe(child_file), seeded(tmp_path / "b"), lock=lock_path(child_file))
    quantize = next(record for record in child.artifact.build.stages if record["stage"] == "quantize")
    assert quantize["mixed"]["decisions_from"] == "lock" and quantize["mixed"]["calibration_from"] == "lock"
    assert child.lock_written is None and not lock_path(child_file).exists()
    assert child.locks == (lock_path(parent_file),)  # what `build --push` sends beside the artifact

    from mlflow import MlflowClient

    from kokoro_opt.remote import push_artifact

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = push_artifact(child.artifact, tracking, say=lambda _: None, locks=child.locks)
    assert [f.path for f in MlflowClient(tracking).list_artifacts(run_id, "lock")] == ["lock/t-parent.lock.json"]


def test_a_lock_that_no_longer_holds_fails_the_build_clearly(tiny_recipe, tmp_path, seeded) -> None:
    # No block does half the work, so the analysis scores none: the lock is edited below, not measured.
    # Every block in INT8 moves the tiny model's 4-12 kHz energy by 0.0011-0.0013 dB (torch's vector and default
    # kernel paths): 5.5x this budget.
    strict = {**TINY_MIXED, "op_types": ["Conv", "MatMul"], "max_high_band_db": 0.0002, "min_block_time_share": 0.5}
    recipe = recipe_with(tiny_recipe, "t-lock-gate", [strict])
    lock = lock_path(tmp_path / "t-lock-gate.yaml")
    analysed = build(recipe, seeded(tmp_path / "a"), lock=lock)
    blocks = analysed.artifact.build.stages[-1]["mixed"]
    every_block = sorted(set(blocks["int8_blocks"]) | set(blocks["fallback_blocks"]))
    data = json.loads(lock.read_text())
    data["stages"]["0:quantize"]["decisions"]["int8_units"] = every_block  # what a stale analysis would say
    lock.write_text(json.dumps(data))
    with pytest.raises(UserError, match="no longer meets the quality budget on this machine"):
        build(recipe, seeded(tmp_path / "b"), lock=lock)
    assert not list((tmp_path / "b" / "t-lock-gate").glob("*/manifest.json"))

    data["stages"]["0:quantize"]["decisions"]["int8_units"] = ["no/such/block"]
    lock.write_text(json.dumps(data))
    with pytest.raises(UserError, match="this graph does not have"):
        build(recipe, tmp_path / "b", lock=lock)


def _imports(module: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kokoro_opt"):
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kokoro_opt"))
    return found


def test_the_import_graph_has_no_cycle() -> None:
    """Deferred imports inside functions count too: a cycle is a design knot wherever it is written."""
    modules = {}
    for file in PACKAGE.rglob("*.py"):
        name = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = file

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges = {m: {t for i in _imports(f) if (t := resolve(i)) and t != m} for m, f in modules.items()}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(target) :], target]))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])


HAND_BUILT_FEED = re.compile(r"\[\[\s*(0|PAD_ID)\s*,\s*\*|[\"']input_ids[\"']\s*:\s*(np|torch)\.")


def test_model_feeds_are_built_in_one_place() -> None:
    """Token ids wrapped in their pads ([[0, *ids, 0]], for numpy, torch or anything else) or an input_ids feed
    spelled out: only kokoro_opt/runtime/feeds.py does that."""
    feeds = PACKAGE / "runtime" / "feeds.py"
    builders = [
        str(f.relative_to(ROOT))
        for f in PACKAGE.rglob("*.py")
        if f != feeds and HAND_BUILT_FEED.search(f.read_text(encoding="utf-8"))
    ]
    assert builders == [], f"build feeds with kokoro_opt.runtime.feeds.model_feeds, not in {builders}"
    assert HAND_BUILT_FEED.search(feeds.read_text(encoding="utf-8"))  # the pattern finds what it looks for
    assert HAND_BUILT_FEED.search("tokens = torch.tensor([[0, *range(16, 64), 0]], dtype=torch.long)")


def test_a_childs_lock_entry_overrides_its_parents_and_a_broken_lock_is_one_error(tmp_path: Path) -> None:
    """int8-mixed-ort.yaml extends int8-mixed.yaml: a slot both locks hold is the child's; a lock that cannot be
    read stops the build with its name and the fix."""
    from kokoro_opt.errors import UserError
    from kokoro_opt.locks import StageLock, lock_path, read_lock, read_locks, write_lock

    parent, child = tmp_path / "base.yaml", tmp_path / "child.yaml"
    parent.write_text("name: base\n")
    child.write_text("extends: base.yaml\nname: child\n")
    write_lock(
        lock_path(parent), "base", {"2-quantize": StageLock("parent-key", {"int8": ["a"]}), "3-windows": StageLock("w", {})}
    )
    write_lock(lock_path(child), "child", {"2-quantize": StageLock("child-key", {"int8": ["b"]})})
    entries = read_locks(lock_path(child))
    assert entries["2-quantize"] == (read_lock(lock_path(child))["2-quantize"], lock_path(child))
    assert entries["3-windows"][1] == lock_path(parent)  # what the child does not hold comes from its parent
    cases = [
        ("{", "is not readable JSON"),
        ("[" * 100_000, "is not readable"),
        ("[]", "has no 'stages'"),
        ('"x"', "has no 'stages'"),
        ('{"stages": {"2-quantize": {"bogus": 1}}}', "under 'stages': field '2-quantize.decision_key': Field required"),
        ('{"stages": {"2-quantize": {"decision_key": "k", "decisions": "int8"}}}', "field '2-quantize.decisions'"),
        ('{"stages": {"2-quantize": {"decision_key": "k", "decisions": {}, "files": ["a"]}}}', "'2-quantize.files'"),
        ('{"weights": 5, "stages": {}}', "'weights' must name the weights"),  # not passed over as another source's
    ]
    for broken, says in cases:
        lock_path(child).write_text(broken)
        with pytest.raises(UserError, match=r"restore it from git, or rebuild with --reanalyze") as refused:
            read_locks(lock_path(child), "pypi-int8")
        assert str(lock_path(child)) in refused.value.message and says in refused.value.message
    lock_path(child).write_text('{"weights": null, "stages": {}}')  # as a lock from before locks named their weights
    assert read_locks(lock_path(child), "pypi-int8")["3-windows"][1] == lock_path(parent)


def test_decision_files_that_cannot_be_copied_leave_the_ones_the_lock_names(tmp_path: Path) -> None:
    from kokoro_opt.locks import files_folder, keep_files

    lock, output = tmp_path / "r.lock.json", tmp_path / "out"
    (output / "windows").mkdir(parents=True)
    (output / "windows" / "p.npz").write_bytes(b"first")
    first = keep_files(lock, "4:windows", output, ("windows/p.npz",))
    (output / "windows" / "p.npz").write_bytes(b"second")
    with pytest.raises(OSError):  # one of the files is not there: as a full disk would stop the copy
        keep_files(lock, "4:windows", output, ("windows/p.npz", "windows/missing.npz"))
    kept = files_folder(lock, "4:windows")
    assert (kept / "windows" / "p.npz").read_bytes() == b"first" and list(kept.parent.iterdir()) == [kept]
    assert keep_files(lock, "4:windows", output, ("windows/p.npz",)) != first
    assert (kept / "windows" / "p.npz").read_bytes() == b"second" and list(kept.parent.iterdir()) == [kept]
