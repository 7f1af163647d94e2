"""Recipe validation: every mistake becomes one line naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.recipe import load_recipe

RECIPES = Path(__file__).parent.parent / "recipes"


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("path", sorted(p for p in RECIPES.glob("*.yaml") if not p.stem.startswith("tune")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.name == path.stem


def test_extends_merges_and_append_stages_adds_after_the_parent() -> None:
    mixed = load_recipe(RECIPES / "int8-mixed.yaml")
    ort = load_recipe(RECIPES / "int8-mixed-ort.yaml")
    assert [s.kind for s in ort.stages] == [*(s.kind for s in mixed.stages), "ort"]
    assert ort.weights == mixed.weights
    assert ort.config_hash() != mixed.config_hash()


def test_unknown_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"unknown field 'export.opsett'"):
        load_recipe(write(tmp_path, "name: x\nexport:\n  opsett: 17\n"))


def test_wrong_type_is_named_with_the_value(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"field 'export.opset'.*'seventeen'"):
        load_recipe(write(tmp_path, "name: x\nexport:\n  opset: seventeen\n"))


def test_unknown_stage_kind_and_source_are_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"stages.0"):
        load_recipe(write(tmp_path, "name: x\nstages:\n  - kind: prune\n"))
    with pytest.raises(UserError, match=r"weights.source"):
        load_recipe(write(tmp_path, "name: x\nweights:\n  source: s3\n"))


def test_missing_recipe_file_and_missing_weights_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match=r"weights.path.*does not exist"):
        load_recipe(write(tmp_path, f"name: x\nweights:\n  source: path\n  path: {tmp_path / 'missing'}\n"))
    with pytest.raises(UserError, match=r"needs weights\.path"):
        load_recipe(write(tmp_path, "name: x\nweights:\n  source: path\n"))
    (tmp_path / "weights").mkdir()
    (tmp_path / "sub").mkdir()
    relative = load_recipe(write(tmp_path / "sub", "name: x\nweights:\n  source: path\n  path: ../weights\n"))
    assert relative.weights.path is not None and relative.weights.path.resolve() == (tmp_path / "weights").resolve()


def test_bad_yaml_and_self_extension(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(write(tmp_path, "name: [x\n"))
    with pytest.raises(UserError, match="a key on line 1 is a list, not a name"):
        load_recipe(write(tmp_path, "? [a, b]\n: 1\n"))
    with pytest.raises(UserError, match="nests too deep to read"):
        load_recipe(write(tmp_path, "stages: " + "[" * 3000 + "]" * 3000 + "\n"))
    with pytest.raises(UserError, match="extends itself"):
        load_recipe(write(tmp_path, "extends: loop.yaml\nname: loop\n", "loop.yaml"))
    # a key given twice: PyYAML would keep the last, so a second `stages:` would replace the first unsaid
    with pytest.raises(UserError, match=r"'stages' is given twice \(lines 2 and 4\)"):
        load_recipe(write(tmp_path, "name: x\nstages: [{kind: simplify}]\nevaluate: {runs: 1}\nstages: [{kind: ort}]\n"))
    with pytest.raises(UserError, match=r"'kind' is given twice"):  # in a nested mapping too
        load_recipe(write(tmp_path, "name: x\nstages:\n  - kind: simplify\n    kind: ort\n"))
    # the wrong kind of file (a lock parses as YAML): what was found is quoted by its start, not the whole section
    with pytest.raises(UserError, match="field 'stages'") as refused:
        load_recipe(Path(__file__).parent.parent / "recipes" / "int8-mixed.lock.json")
    assert len(str(refused.value)) < 1_000
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_recipe(latin1)
    with pytest.raises(UserError, match="is a folder, not a recipe file"):
        load_recipe(tmp_path)
    with pytest.raises(UserError, match=r"orphan.yaml: extends nope.yaml, which is not a file"):
        load_recipe(write(tmp_path, "extends: nope.yaml\n", "orphan.yaml"))
    for empty in ("", "# only a comment\n"):  # else the defaults, an fp32 export, built unasked
        with pytest.raises(UserError, match=r"empty.yaml is empty: it names no recipe fields"):
            load_recipe(write(tmp_path, empty, "empty.yaml"))
    with pytest.raises(UserError, match=r"named after its file, and 'Bad Name' is not a plain name.*add name:"):
        load_recipe(write(tmp_path, "description: x\n", "Bad Name.yaml"))
    assert load_recipe(write(tmp_path, "name: good\n", "Bad Name.yaml")).name == "good"
    with pytest.raises(UserError, match=r"export.validation.sentences.1"):  # a blank sentence validates nothing
        load_recipe(write(tmp_path, "name: x\nexport:\n  validation:\n    sentences: [Hello there., '   ']\n"))


def test_a_recipe_that_extends_another_is_named_after_its_own_file(tmp_path: Path) -> None:
    """Not after its parent: its builds would land in the parent's folder and pass for the parent's."""
    child = load_recipe(write(tmp_path, f"extends: {RECIPES / 'tiny.yaml'}\nappend_stages: [{{kind: simplify}}]\n", "child.yaml"))
    assert child.name == "child"


@pytest.mark.parametrize(
    "stages", ["[{kind: ort}, {kind: simplify}]", "[{kind: ort}, {kind: ort}]", "[{kind: coreml}, {kind: simplify}]"]
)
def test_a_conversion_out_of_onnx_is_the_last_stage(tmp_path: Path, stages: str) -> None:
    with pytest.raises(UserError, match="must be the last stage"):
        load_recipe(write(tmp_path, f"name: x\nstages: {stages}\n"))


def test_config_hash_ignores_name_and_description(tmp_path: Path) -> None:
    a = load_recipe(write(tmp_path, "name: a\ndescription: one\n", "a.yaml"))
    b = load_recipe(write(tmp_path, "name: b\ndescription: two\n", "b.yaml"))
    c = load_recipe(write(tmp_path, "name: c\nexport:\n  opset: 18\n", "c.yaml"))
    assert a.config_hash() == b.config_hash() != c.config_hash()
