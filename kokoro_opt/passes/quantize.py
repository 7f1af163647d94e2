"""quantize stage: dynamic INT8 (the kokoro-onnx peer), static per-channel QDQ INT8, and `mixed`.

All three go through `onnxruntime.quantization`. Static calibration runs once per (model,
calibration set, method) and its tensor ranges are cached as JSON (`calibration_cache_path`), so
the sensitivity analysis can re-quantize dozens of variants without calibrating again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.errors import UserError
from kokoro_opt.passes.clipping import clipped_calibration, input_ranges
from kokoro_opt.passes.common import copy_runtime, graph_summary
from kokoro_opt.paths import repo_file
from kokoro_opt.recipe import QuantizeStage
from kokoro_opt.voices import style_for

CALIBRATION_SPEEDS = (1.0, 0.9, 1.15)


def calibration_corpus() -> list[str]:
    """The committed calibration sentences (calibration/sentences.txt), in file order."""
    path = repo_file("calibration/sentences.txt")
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def calibration_feeds(artifact: Artifact, count: int) -> list[dict[str, np.ndarray]]:
    """Deterministic feeds: sentence i is spoken by voice i mod V at speed i mod 3."""
    from kokoro_opt.text import phonemize, tokenize

    sentences = calibration_corpus()
    if count > len(sentences):
        raise UserError(
            f"quantize.calibration_sentences is {count} but calibration/sentences.txt has {len(sentences)}",
            "lower it or add sentences",
        )
    vocab = artifact.kokoro["vocab"]
    packs = artifact.voice_packs()
    voices = sorted(packs)
    feeds = []
    for i, sentence in enumerate(sentences[:count]):
        tokens = tokenize(phonemize(sentence), vocab)[:510]
        feeds.append(
            {
                "input_ids": np.array([[0, *tokens, 0]], dtype=np.int64),
                "style": style_for(packs[voices[i % len(voices)]], len(tokens)),
                "speed": np.array([CALIBRATION_SPEEDS[i % len(CALIBRATION_SPEEDS)]], dtype=np.float32),
            }
        )
    return feeds


class FeedReader:
    """onnxruntime's CalibrationDataReader protocol over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self._it: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self.feeds)

    def __len__(self) -> int:
        return len(self.feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._it = iter(itertools.islice(self.feeds, start_index, end_index))


def quantizable_nodes(model_path: Path, op_types: list[str]) -> list[str]:
    """Top-level nodes of the given op types (subgraph nodes are left to ORT)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return [n.name for n in model.graph.node if n.op_type in op_types]


def quantize_static_qdq(
    source: Path,
    target: Path,
    cfg: QuantizeStage,
    calibration_cache: Path,
    feeds: list[dict[str, np.ndarray]] | None,
    nodes_to_quantize: list[str] | None = None,
    clips: dict[str, float] | None = None,
) -> None:
    """Static QDQ INT8: per-channel int8 weights, uint8 activations (VNNI-friendly, no reduce_range).

    `clips` cuts the calibrated range of some tensors at a two-sided percentile (see passes.clipping)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    logging.getLogger("root").setLevel(logging.ERROR)  # ORT's "consider pre-processing" nag
    activation = QuantType.QUInt8 if cfg.activation_type == "uint8" else QuantType.QInt8
    quantize_static(
        str(source),
        str(target),
        FeedReader(feeds) if feeds is not None else None,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(cfg.op_types),
        per_channel=cfg.per_channel,
        activation_type=activation,
        weight_type=QuantType.QInt8,
        nodes_to_quantize=nodes_to_quantize,
        nodes_to_exclude=list(cfg.exclude_nodes) or None,
        calibrate_method=getattr(CalibrationMethod, cfg.calibrate_method),
        calibration_cache_path=str(clipped_calibration(calibration_cache, input_ranges_path(calibration_cache), clips or {})),
        # One feed per collect: utterances differ in length, so the histogram calibrators (Entropy,
        # Percentile) cannot stack them, and MinMax keeps far less in memory.
        extra_options={"ActivationSymmetric": False, "WeightSymmetric": True, "CalibStridedMinMax": 1},
    )
    _finish_qdq(target, output_ranges_path(calibration_cache) if cfg.equalize_outputs else None)


def _finish_qdq(model_file: Path, equalize_ranges: Path | None) -> None:
    """The rewrites of a fresh QDQ model, in one load and at most one save (the analysis makes dozens):
    Conv output equalization, then the snake stage's last per-channel Mul into the QuantizeLinear
    an INT8 Conv reads."""
    import json

    import onnx

    from kokoro_opt.passes.equalize import equalize_conv_outputs
    from kokoro_opt.passes.snake import fold_scale_into_quantize

    model = onnx.load(str(model_file))
    ranges = json.loads(equalize_ranges.read_text(encoding="utf-8")) if equalize_ranges is not None else None
    changed = equalize_conv_outputs(model, ranges) if ranges is not None else 0
    changed += fold_scale_into_quantize(model)
    if changed:
        onnx.save(model, str(model_file))


def output_ranges_path(calibration_cache: Path) -> Path:
    """Per-channel Conv output ranges live next to the calibration ranges they complement."""
    return calibration_cache.with_name("output_ranges.json")


def input_ranges_path(calibration_cache: Path) -> Path:
    """Clip-candidate ranges of the quantized nodes' inputs, next to the calibration ranges too."""
    return calibration_cache.with_name("input_ranges.json")


def calibrate(source: Artifact, cfg: QuantizeStage, out: Path) -> Path:
    """Compute activation ranges once; later quantize calls read the cached JSON."""
    cache = out / "calibration.json"
    feeds = calibration_feeds(source, cfg.calibration_sentences)
    if cfg.equalize_outputs:
        from kokoro_opt.passes.equalize import channel_ranges

        channel_ranges(source.model_file, feeds, output_ranges_path(cache))
    if cfg.mode == "mixed" and cfg.input_clip_percentiles:
        nodes = quantizable_nodes(source.model_file, cfg.op_types)
        input_ranges(source.model_file, nodes, feeds, cfg.input_clip_percentiles, input_ranges_path(cache))
    if not cache.exists():
        scratch = out / ".calibration-probe.onnx"
        quantize_static_qdq(source.model_file, scratch, cfg, cache, feeds)
        scratch.unlink(missing_ok=True)
    return cache


def run_quantize(source: Artifact, cfg: QuantizeStage, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    copy_runtime(source, out)
    record: dict[str, Any] = {"stage": "quantize", "config": cfg.model_dump(mode="json")}
    if cfg.mode == "dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # kokoro-onnx's recipe: per-tensor uint8 weights for Conv/MatMul/LSTM/Gather, ranges at run time.
        quantize_dynamic(
            str(source.model_file),
            str(out / "model.onnx"),
            weight_type=QuantType.QUInt8,
            per_channel=False,
            nodes_to_exclude=list(cfg.exclude_nodes) or None,
        )
    elif cfg.mode == "static":
        quantize_static_qdq(source.model_file, out / "model.onnx", cfg, calibrate(source, cfg, out), None)
    else:
        from kokoro_opt.passes.sensitivity import run_mixed

        record["mixed"] = run_mixed(source, cfg, out, calibrate(source, cfg, out))
    record["graph"] = graph_summary(out / "model.onnx")
    record["seconds"] = {"quantize": round(time.perf_counter() - started, 2)}
    return record
