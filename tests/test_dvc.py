"""dvc.yaml: a real `dvc repro` of the tiny stage rebuilds only when its inputs change."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent


def test_every_recipe_has_a_dvc_stage() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    recipes = {p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.startswith("tune")}
    assert recipes <= set(stages)
    for name, stage in stages.items():
        assert stage["cmd"].startswith(f"kokoro-opt build recipes/{name}.yaml")
        assert f"recipes/{name}.yaml" in stage["deps"]


def test_dvc_repro_runs_skips_and_reruns(tmp_path: Path) -> None:
    dvc = shutil.which("dvc") or str(Path(os.sys.executable).parent / "dvc")
    if not Path(dvc).exists():
        pytest.skip("dvc is not installed (pip install 'kokoro-opt[dev]')")
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["tiny"]
    stage["deps"] = ["recipes/tiny.yaml"]  # the package source is not copied into the scratch project
    (tmp_path / "recipes").mkdir()
    shutil.copy2(ROOT / "recipes" / "tiny.yaml", tmp_path / "recipes" / "tiny.yaml")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"tiny": stage}}))
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(os.sys.executable).parent}:{os.environ['PATH']}"}

    def dvc_run(*args: str) -> str:
        done = subprocess.run([dvc, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    dvc_run("init", "--no-scm", "-q")
    first = dvc_run("repro", "tiny")
    assert "Running stage 'tiny'" in first
    assert list((tmp_path / "artifacts" / "tiny").glob("*/manifest.json"))
    assert "didn't change" in dvc_run("repro", "tiny")
    recipe = tmp_path / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text() + "\n# touched\n")
    assert "Running stage 'tiny'" in dvc_run("repro", "tiny")
