"""Export stage: KModel -> fp32 ONNX (legacy exporter, dynamic token axis), validated against PyTorch."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.model import SAMPLE_RATE, deterministic_noise, load_kmodel, strip_weight_norm, style_for
from kokoro_opt.recipe import ExportConfig, ValidationConfig
from kokoro_opt.runtime.feeds import INPUT_NAMES, OUTPUT_NAMES, feed_arrays
from kokoro_opt.weights.sources import ResolvedWeights


def write_runtime_files(folder: Path, weights: ResolvedWeights) -> None:
    """What synthesis needs beside the model: voices.npz and kokoro.json (vocab + provenance)."""
    packs = weights.load_voices()
    np.savez(folder / "voices.npz", **packs)
    meta = {
        "vocab": weights.config["vocab"],
        "sample_rate": SAMPLE_RATE,
        "audio_gain": 1.0,
        "weights": {
            "source": weights.source,
            "sha256": weights.sha256,
            "int8_rounded": weights.int8_rounded,
            "note": weights.note,
            # how stages that convert from torch find the PyTorch weights again (weights_directory): no folder of this
            # machine, but a `path` source's own
            "found_again": weights.found_again,
            **({"rebuilt_from": weights.rebuilt_from} if weights.rebuilt_from else {}),
        },
    }
    (folder / "kokoro.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """The exporter's C++ shape-inference warnings about PackPadded are expected; keep the terminal clean."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class _TorchWithStockAlignment(types.ModuleType):
    """torch as kokoro.model sees it during an export with `alignment: stock`: repeat_interleave(values,
    repeats) rebuilt from stock ops. Frame f belongs to the number of tokens that end at or before it,
    the same indices for every repeats >= 1 (Kokoro clamps durations to 1)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def repeat_interleave(values: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
        ends = torch.cumsum(repeats, 0)
        frames = torch.arange(ends[-1], device=repeats.device)
        return values[(ends.unsqueeze(0) <= frames.unsqueeze(1)).sum(1)]


@contextlib.contextmanager
def _alignment(kind: str) -> Iterator[None]:
    import kokoro.model

    if kind == "loop":
        yield
        return
    kokoro.model.torch = _TorchWithStockAlignment("torch")
    try:
        yield
    finally:
        kokoro.model.torch = torch


def export_onnx(
    model: torch.nn.Module,
    path: Path,
    opset: int,
    sample_tokens: list[int],
    style: np.ndarray,
    deterministic: bool = True,
    alignment: str = "loop",
) -> None:
    from kokoro.model import KModelForONNX

    wrapper = KModelForONNX(model).eval()
    args = tuple(torch.from_numpy(a) for a in feed_arrays(sample_tokens, style, 1.0))
    noise = deterministic_noise() if deterministic else contextlib.nullcontext()
    with warnings.catch_warnings(), noise, torch.no_grad(), _alignment(alignment), quiet_native_stderr():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper,
            args,
            str(path),
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_axes={"input_ids": {1: "tokens"}, "audio": {0: "samples"}, "durations": {0: "tokens"}},
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )


def validate_export(
    model: torch.nn.Module, onnx_path: Path, vocab: dict[str, int], packs: dict[str, np.ndarray], cfg: ValidationConfig
) -> dict[str, Any]:
    """ORT vs PyTorch (same CustomSTFT path, noise off) on real phonemised sentences: see validation.py."""
    from kokoro_opt.validation import onnx_synthesize, torch_synthesizer, validate, validation_cases

    cases = validation_cases(cfg, vocab, packs)
    return validate(torch_synthesizer(model), onnx_synthesize(onnx_path), cases, cfg, SAMPLE_RATE)


def run_export(weights: ResolvedWeights, cfg: ExportConfig, out: Path) -> dict[str, Any]:
    """Fill `out` with model.onnx + runtime files; returns the stage record for the manifest."""
    from kokoro_opt.text import utterance_tokens

    started = time.perf_counter()
    packs = weights.load_voices()
    validated = cfg.validate_export and cfg.deterministic  # with random noise on, samples cannot match
    voice = cfg.validation.voice
    if voice not in packs and validated:  # before the export, which it would otherwise fail after
        raise UserError(f"unknown voice '{voice}' in export.validation.voice", f"choose from: {', '.join(sorted(packs))}")
    voice = voice if voice in packs else sorted(packs)[0]  # the export traces with any voice: validation only reads
    model = strip_weight_norm(load_kmodel(weights.config, weights.model_path, disable_complex=True))
    write_runtime_files(out, weights)
    sample_tokens = utterance_tokens(cfg.validation.sentences[0], weights.config["vocab"])
    export_onnx(
        model,
        out / "model.onnx",
        cfg.opset,
        sample_tokens,
        style_for(packs[voice], len(sample_tokens)),
        cfg.deterministic,
        cfg.alignment,
    )
    exported = time.perf_counter()
    record: dict[str, Any] = {
        "stage": "export",
        "config": cfg.model_dump(mode="json", by_alias=True),
        "noise": "deterministic: SineGen random phase and noise zeroed" if cfg.deterministic else "random",
        "seconds": {"export": round(exported - started, 2)},
    }
    if validated:
        report = validate_export(model, out / "model.onnx", weights.config["vocab"], packs, cfg.validation)
        record["validation"] = report
        record["seconds"]["validate"] = round(time.perf_counter() - exported, 2)
        if not report["passed"] and weights.source != "tiny":
            raise UserError(
                f"export validation failed: {'; '.join(report['reasons'])} (the ONNX graph does not compute "
                "what the PyTorch model does)",
                "check the export settings (opset) and the kokoro version; thresholds: export.validation in the recipe",
            )
    return record


PASS = Pass(
    "export",
    ExportConfig,
    run_export,
    libraries=("torch", "kokoro", "onnx", "onnxruntime", "transformers", "phonemizer-fork", "espeakng-loader"),
    judged_by=("validate_export", "validation"),  # the export gate: it judges the graph and decides nothing after it
)
