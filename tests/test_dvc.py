"""dvc.yaml: a real `dvc repro` of the tiny stage, in a git checkout as users run it, rebuilds only when
its inputs change and leaves exactly one new file for git: dvc.lock."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.needs import missing

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent
# What the tiny stage reads, plus the files that make the folder a DVC project inside git.
PROJECT_FILES = ["dvc.yaml", ".gitignore", ".dvcignore", ".dvc/config", ".dvc/.gitignore", "recipes/tiny.yaml"]


def test_every_recipe_has_a_dvc_stage() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    recipes = {p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.startswith("tune")}
    assert recipes <= set(stages)
    for name, stage in stages.items():
        assert stage["cmd"].startswith(f"kokoro-opt build recipes/{name}.yaml")
        assert f"recipes/{name}.yaml" in stage["deps"]


def test_each_dvc_stage_depends_on_what_its_build_reads() -> None:
    """`dvc repro` reruns a stage only when a dep changed: each must name every file its build's cache keys read (the
    recipes it extends, the data its passes read, the locks it applies), or DVC skips a rebuild kokoro-opt would do."""
    from kokoro_opt.build import chain_of
    from kokoro_opt.export import PASS as EXPORT
    from kokoro_opt.locks import lock_path, parent_locks
    from kokoro_opt.recipe import load_recipe

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        recipe_file = ROOT / "recipes" / f"{name}.yaml"
        deps = set(stage["deps"])
        reads = {read for p in [EXPORT, *chain_of(load_recipe(recipe_file))] for read in p.reads}
        for read in sorted(reads):
            assert any(read == dep or read.startswith(dep.rstrip("/") + "/") for dep in deps), (name, read)
        for lock in [lock_path(recipe_file), *parent_locks(lock_path(recipe_file))]:
            if lock.is_file():
                assert str(lock.relative_to(ROOT)) in deps, (name, lock)
        parent = yaml.safe_load(recipe_file.read_text()).get("extends")
        while parent:
            assert f"recipes/{parent}" in deps, (name, parent)
            parent = yaml.safe_load((ROOT / "recipes" / parent).read_text()).get("extends")


def _tool(name: str) -> str:
    found = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if found is None:
        missing(name, "pip install 'kokoro-opt[dev]'" if name == "dvc" else "install it")
    return found


def _checkout(dest: Path, git: str, env: dict[str, str]) -> None:
    """A git repository holding the project files the tiny stage needs, committed, as in a fresh clone.

    Copied from the working tree rather than cloned, so that uncommitted changes are what is tested."""
    for rel in PROJECT_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    shutil.copytree(ROOT / "kokoro_opt", dest / "kokoro_opt", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for args in (["init", "-q"], ["add", "-A"], ["-c", "commit.gpgsign=false", "commit", "-q", "-m", "project"]):
        subprocess.run([git, *args], cwd=dest, env=env, check=True, capture_output=True, timeout=60)


def test_dvc_repro_in_a_git_checkout(tmp_path: Path) -> None:
    dvc, git = _tool("dvc"), _tool("git")
    env = {
        **os.environ,
        "DVC_NO_ANALYTICS": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the stage's `kokoro-opt`
        "GIT_AUTHOR_NAME": "test",
        "GIT_AUTHOR_EMAIL": "test@example.invalid",
        "GIT_COMMITTER_NAME": "test",
        "GIT_COMMITTER_EMAIL": "test@example.invalid",
    }
    _checkout(tmp_path, git, env)

    def run(*args: str, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode in ok, f"{args}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        return done

    first = run(dvc, "repro", "tiny").stdout
    assert "Running stage 'tiny'" in first
    assert list((tmp_path / "artifacts" / "tiny").glob("*/manifest.json"))
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())
    assert "tiny" in lock["stages"]
    # dvc.lock belongs in git; the stage's outputs do not (cache: false outs must stay git-ignored).
    assert run(git, "check-ignore", "-q", "dvc.lock", ok=(1,)).returncode == 1
    assert run(git, "status", "--porcelain", "--untracked-files=all").stdout.splitlines() == ["?? dvc.lock"]

    # Bytecode beside the source is .dvcignore'd: it does not change the kokoro_opt dependency.
    (tmp_path / "kokoro_opt" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "kokoro_opt" / "__pycache__" / "stray.cpython-311.pyc").write_bytes(b"\0")
    assert "didn't change" in run(dvc, "repro", "tiny").stdout
    run(git, "add", "dvc.lock")
    run(git, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "dvc.lock")
    assert run(git, "status", "--porcelain", "--untracked-files=all").stdout == ""

    # Built again from nothing, at another time: the outputs hash by content only (the build's records and
    # locks are not content), so the committed lock still matches, as another machine's identical build would.
    shutil.rmtree(tmp_path / "artifacts")
    assert "Running stage 'tiny'" in run(dvc, "repro", "tiny").stdout
    assert run(git, "status", "--porcelain", "--untracked-files=all").stdout == ""
    assert "didn't change" in run(dvc, "repro", "tiny").stdout

    recipe = tmp_path / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text() + "\n# touched\n")
    assert "Running stage 'tiny'" in run(dvc, "repro", "tiny").stdout
    assert run(git, "status", "--porcelain").stdout.splitlines() == [" M dvc.lock", " M recipes/tiny.yaml"]
