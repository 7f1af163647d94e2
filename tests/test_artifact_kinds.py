"""Every command on every artifact kind works or says why not (the issue's item 8).

One tiny artifact per kind (plain ONNX, .ort, fp16, Core ML), built once for the module, driven through
the real CLI: `say`, `voices`, `evaluate`, `compare`, and `serve` (a real server for the kinds that run,
the command itself for Core ML, which must refuse before anything starts). Off macOS a Core ML artifact
must end in one clear line naming macOS and the ONNX artifact it was converted from, never in an
ONNX Runtime traceback.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner

from kokoro_opt.artifacts import Artifact
from kokoro_opt.errors import UserError
from tests import needs

KINDS = ("onnx", "ort", "fp16", "coreml")
RUNNABLE = ("onnx", "ort", "fp16")
STAGES: dict[str, list[dict[str, Any]]] = {
    "ort": [{"kind": "ort"}],
    "fp16": [{"kind": "fp16"}],
    "coreml": [{"kind": "coreml", "precision": "fp16", "int8_weights": True, "max_tokens": 32}],  # as test_coreml: one conversion
}
# the smallest evaluation: one sentence, one timed run, no warm-up, no ASR
FAST = ["--sentences", "1", "--runs", "1", "--warmup", "0", "--threads", "2", "--no-asr"]
SHORT_EDGE_TOKENS = 40  # the 500-token edge input takes most of an evaluation of the tiny model; its check has its own test

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*noload.*")]  # MLflow's own SQLAlchemy usage, not ours
OFF_MACOS = pytest.mark.skipif(platform.system() == "Darwin", reason="on macOS a Core ML artifact runs: this checks the refusal")


@pytest.fixture(scope="module")
def kinds(tiny_recipe: Any, tiny_artifact: Artifact, artifacts_root: Path) -> dict[str, Artifact]:
    """Each kind built once through the real pipeline; Core ML only where coremltools converts."""
    from kokoro_opt.build import build
    from kokoro_opt.recipe import parse_recipe

    built = {"onnx": tiny_artifact}
    for kind, stages in STAGES.items():
        if kind == "coreml":
            try:
                import coremltools  # noqa: F401
            except ImportError:
                continue
        data = tiny_recipe.model_dump(mode="json", by_alias=True) | {"name": f"tiny-{kind}", "stages": stages}
        built[kind] = build(parse_recipe(data), artifacts_root).artifact
    return built


@pytest.fixture
def artifact(request: pytest.FixtureRequest, kinds: dict[str, Artifact]) -> Artifact:
    if request.param == "coreml":
        needs.module("coremltools", "pip install 'kokoro-opt[coreml]'")
        if platform.system() == "Darwin":
            pytest.skip("on macOS a Core ML artifact runs: these cases check the refusal elsewhere")
    return kinds[request.param]


def cli(*args: str) -> Any:
    from kokoro_opt.cli import app

    return CliRunner().invoke(app, list(args))


@contextlib.contextmanager
def short_edge_inputs() -> Iterator[None]:
    from kokoro_opt.evaluate import edge

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(edge, "LONG_INPUT_TOKENS", SHORT_EDGE_TOKENS)
        yield


def squashed(text: str) -> str:
    """Output without whitespace: rich wraps long lines (and paths) at the console width."""
    return "".join(text.split())


def assert_refused(output: str, coreml: Artifact) -> None:
    """One clear line: Core ML needs macOS, use the ONNX artifact it was converted from. No traceback."""
    from kokoro_opt.runtime.availability import converted_from

    source = converted_from(coreml)
    assert source is not None
    assert "Traceback" not in output and "INVALID_PROTOBUF" not in output
    assert "macOS" in output
    assert f"convertedfrom:{source}" in squashed(output)


def test_the_coreml_source_is_the_onnx_it_was_converted_from(kinds: dict[str, Artifact]) -> None:
    needs.module("coremltools", "pip install 'kokoro-opt[coreml]'")
    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.runtime.availability import converted_from

    source = converted_from(kinds["coreml"])
    assert source is not None and open_artifact(source).id == kinds["onnx"].id


@OFF_MACOS
def test_no_loader_hands_model_mlpackage_to_onnx_runtime(kinds: dict[str, Artifact]) -> None:
    needs.module("coremltools", "pip install 'kokoro-opt[coreml]'")
    from kokoro_opt.runtime import open_synthesizer
    from kokoro_opt.runtime.availability import runtime_problem
    from kokoro_opt.runtime.synth import Synthesizer

    coreml = kinds["coreml"]
    for load in (open_synthesizer, Synthesizer):
        with pytest.raises(UserError, match="macOS") as raised:
            load(coreml)
        assert raised.value.hint and "converted from" in raised.value.hint
    assert all(runtime_problem(kinds[kind]) is None for kind in RUNNABLE)


@pytest.mark.parametrize("artifact", KINDS, indirect=True)
def test_say(artifact: Artifact, tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    done = cli("say", "Checkbox checked.", "--artifact", str(artifact.path), "--voice", "tiny_0", "-o", str(out))
    if artifact.name == "tiny-coreml":
        assert done.exit_code == 2, done.output
        assert_refused(done.output, artifact)
        assert not out.exists()
        return
    assert done.exit_code == 0, done.output
    audio, rate = sf.read(out)
    assert rate == 24_000 and len(audio) > 1000 and np.all(np.isfinite(audio))


@pytest.mark.parametrize("artifact", KINDS, indirect=True)
def test_voices(artifact: Artifact) -> None:
    from kokoro_opt.voices import openai_voice_map

    done = cli("voices", "--artifact", str(artifact.path))
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert [line for line in lines if " -> " not in line] == sorted(artifact.voice_packs())
    aliases = dict(line.split(" -> ") for line in lines if " -> " in line)  # then what OpenAI's names stand for
    assert aliases == openai_voice_map(list(artifact.voice_packs()))


@pytest.fixture(scope="module")
def evaluated(kinds: dict[str, Artifact], artifacts_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `evaluate` over every kind (a run per kind would measure the fp32 reference again each time)."""
    store = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    folders = [str(a.path) for a in kinds.values()]
    with short_edge_inputs():
        return cli("evaluate", *folders, "--artifacts", str(artifacts_root), "--tracking-uri", store, *FAST, "--json")


@pytest.fixture(scope="module")
def compared(kinds: dict[str, Artifact], artifacts_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `compare` over every kind, as a user would run it: one interleaved session."""
    folders = [str(a.path) for a in kinds.values()]
    plot = tmp_path_factory.mktemp("plot") / "pareto.png"
    with short_edge_inputs():
        return cli("compare", *folders, "--artifacts", str(artifacts_root), *FAST, "--plot", str(plot), "--no-log", "--json")


@pytest.mark.parametrize("artifact", KINDS, indirect=True)
@pytest.mark.parametrize("command", ["evaluate", "compare"])
def test_evaluate_and_compare(command: str, artifact: Artifact, request: pytest.FixtureRequest) -> None:
    """The kinds that run get numbers; Core ML is skipped with its reason and the others still succeed."""
    import json

    done = request.getfixturevalue("evaluated" if command == "evaluate" else "compared")
    assert done.exit_code == 0, done.output
    assert "Traceback" not in done.output
    measured = {r["artifact_id"]: r for r in json.loads(done.stdout)["results"]}
    if artifact.name == "tiny-coreml":
        assert artifact.id not in measured  # no number for a model that did not run
        assert_refused(done.output, artifact)
    else:
        assert measured[artifact.id]["metrics"]["rtf_p50"] > 0


@pytest.mark.parametrize("artifact", RUNNABLE, indirect=True)
def test_serve(artifact: Artifact) -> None:
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig, running

    config = ServeConfig(max_queue=2, first_chunk_tokens=20, chunk_tokens=60)
    with running(resolve_artifact(str(artifact.path)), config) as url:
        body = {"model": "tts-1", "voice": "tiny_0", "input": "Checkbox checked.", "response_format": "wav", "stream": False}
        response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.content[:4] == b"RIFF" and len(response.content) > 44 + 2000


@OFF_MACOS
def test_serve_refuses_coreml_before_starting(kinds: dict[str, Artifact], monkeypatch: pytest.MonkeyPatch) -> None:
    needs.module("coremltools", "pip install 'kokoro-opt[coreml]'")
    import kokoro_opt.serve as serve
    from kokoro_opt.select import Selection, resolve_artifact
    from kokoro_opt.serve import ServeConfig, running

    coreml = kinds["coreml"]

    def started(*_: object, **__: object) -> None:
        raise AssertionError("a server was started for an artifact that cannot run here")

    monkeypatch.setattr(serve, "serve_forever", started)  # what `kokoro-opt serve` would block in
    done = cli("serve", "--artifact", str(coreml.path), "--port", "0")
    assert done.exit_code == 2, done.output
    assert_refused(done.output, coreml)
    with pytest.raises(UserError, match="macOS"):
        resolve_artifact(str(coreml.path))
    with pytest.raises(UserError, match="macOS"), running(Selection(coreml), ServeConfig()):  # a hand-made selection too
        pass
