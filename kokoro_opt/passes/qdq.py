"""Static QDQ INT8 through `onnxruntime.quantization`, and the calibration it reads.

Calibration runs once per quantize stage. Its side files live in the stage's output folder and
are named in one place, `CalibrationFiles`, so the sensitivity analysis can re-quantize dozens of
variants from them without calibrating again. The ranges the chosen INT8 nodes use are part of a
recipe's lock (`calibration_for_lock`): a locked build restores them instead of measuring, so it
makes the same bytes on every machine and skips the calibration passes.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.errors import UserError
from kokoro_opt.passes.clipping import input_ranges, percentile_key
from kokoro_opt.paths import project_file
from kokoro_opt.recipe import QuantizeStage
from kokoro_opt.runtime.feeds import model_feeds
from kokoro_opt.voices import style_for

CALIBRATION_CORPUS = "calibration/sentences.txt"
CALIBRATION_SPEEDS = (1.0, 0.9, 1.15)


@dataclass(frozen=True)
class CalibrationFiles:
    """The quantize stage's calibration side files, all in its output folder."""

    folder: Path

    @property
    def ranges(self) -> Path:
        """ORT's per-tensor activation ranges (its calibration_cache_path format)."""
        return self.folder / "calibration.json"

    @property
    def output_ranges(self) -> Path:
        """Per-channel Conv output ranges, for output equalization."""
        return self.folder / "output_ranges.json"

    @property
    def input_ranges(self) -> Path:
        """Percentile ranges of the quantized nodes' inputs, for input clipping."""
        return self.folder / "input_ranges.json"

    @property
    def clipped(self) -> Path:
        """Scratch: `ranges` with some inputs cut (see passes.clipping); removed when the stage ends."""
        return self.folder / ".calibration-clipped.json"


def read_corpus(relative: str) -> list[str]:
    """A committed sentence list (one per line, '#' comments), in file order."""
    lines = project_file(relative).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def calibration_corpus() -> list[str]:
    return read_corpus(CALIBRATION_CORPUS)


def calibration_feeds(artifact: Artifact, count: int) -> list[dict[str, np.ndarray]]:
    """Deterministic feeds: sentence i is spoken by voice i mod V at speed i mod 3."""
    from kokoro_opt.text import utterance_tokens

    sentences = calibration_corpus()
    if count > len(sentences):
        raise UserError(
            f"calibration_sentences is {count} but {CALIBRATION_CORPUS} has {len(sentences)}", "lower it or add sentences"
        )
    vocab = artifact.kokoro["vocab"]
    packs = artifact.voice_packs()
    voices = sorted(packs)
    feeds = []
    for i, sentence in enumerate(sentences[:count]):
        tokens = utterance_tokens(sentence, vocab)
        style = style_for(packs[voices[i % len(voices)]], len(tokens))
        feeds.append(model_feeds(tokens, style, CALIBRATION_SPEEDS[i % len(CALIBRATION_SPEEDS)]))
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


def clipped_calibration(calibration: CalibrationFiles, clips: dict[str, float]) -> Path:
    """ORT's calibration ranges with the inputs of `clips`' tensors cut at their percentile.

    Written beside the original (`calibration.clipped`), so the output ranges that equalization
    reads beside it are found."""
    if not clips:
        return calibration.ranges
    ranges_of_calibration = json.loads(calibration.ranges.read_text(encoding="utf-8"))
    ranges = json.loads(calibration.input_ranges.read_text(encoding="utf-8"))
    for tensor, percentile in clips.items():
        entry = ranges_of_calibration["data"].get(tensor)
        if entry is None or tensor not in ranges:
            continue  # not an input ORT quantizes
        entry["lowest"], entry["highest"] = ranges[tensor][percentile_key(percentile)]
    calibration.clipped.write_text(json.dumps(ranges_of_calibration), encoding="utf-8")
    return calibration.clipped


def quantizable_nodes(model_path: Path, op_types: list[str]) -> list[str]:
    """Top-level nodes of the given op types (subgraph nodes are left to ORT)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return [n.name for n in model.graph.node if n.op_type in op_types]


@contextlib.contextmanager
def private_input(source: Path, target: Path) -> Iterator[Path]:
    """`source` linked into a scratch folder beside `target`, for ORT's quantizers (and their temporary files).

    They write `<model>-inferred.onnx` beside their input and delete it after loading. Beside a
    cached stage's model, two builds reading that stage at once race on the one file (and the cache
    folder is not theirs to write)."""
    with tempfile.TemporaryDirectory(prefix=".quantize-input-", dir=target.parent) as scratch:
        private = Path(scratch) / source.name
        try:
            os.link(source, private)
        except OSError:  # another filesystem
            shutil.copyfile(source, private)
        # ORT's quantize_static copies the model it calibrates (as large as the model) into the system's temporary
        # folder, where a killed build left it for good: here it goes with the stage's temporary folder instead
        previous, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            yield private
        finally:
            tempfile.tempdir = previous


def quantize_static_qdq(
    source: Path,
    target: Path,
    cfg: QuantizeStage,
    calibration: CalibrationFiles,
    feeds: list[dict[str, np.ndarray]] | None,
    nodes_to_quantize: list[str] | None = None,
    clips: dict[str, float] | None = None,
) -> None:
    """Static QDQ INT8: per-channel int8 weights, uint8 activations (VNNI-friendly, no reduce_range).

    `clips` cuts the calibrated range of some tensors at a two-sided percentile (see passes.clipping)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    activation = QuantType.QUInt8 if cfg.activation_type == "uint8" else QuantType.QInt8
    with private_input(source, target) as model_input:
        quantize_static(
            str(model_input),
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
            calibration_cache_path=str(clipped_calibration(calibration, clips or {})),
            # One feed per collect: utterances differ in length, so the histogram calibrators (Entropy,
            # Percentile) cannot stack them, and MinMax keeps far less in memory.
            extra_options={"ActivationSymmetric": False, "WeightSymmetric": True, "CalibStridedMinMax": 1},
        )
    _finish_qdq(target, calibration.output_ranges if cfg.equalize_outputs else None)


def _finish_qdq(model_file: Path, equalize_ranges: Path | None) -> None:
    """The rewrites of a fresh QDQ model, in one load and at most one save (the analysis makes dozens):
    Conv output equalization, then the snake stage's last per-channel Mul into the QuantizeLinear
    an INT8 Conv reads."""
    import onnx

    from kokoro_opt.passes.equalize import equalize_conv_outputs
    from kokoro_opt.passes.snake import fold_scale_into_quantize

    model = onnx.load(str(model_file))
    ranges = json.loads(equalize_ranges.read_text(encoding="utf-8")) if equalize_ranges is not None else None
    changed = equalize_conv_outputs(model, ranges) if ranges is not None else 0
    changed += fold_scale_into_quantize(model)
    if changed:
        onnx.save(model, str(model_file))


def calibrate(source: Artifact, cfg: QuantizeStage, out: Path, seconds: dict[str, float] | None = None) -> CalibrationFiles:
    """Compute activation ranges once into `out`; later quantize calls read them. `seconds` receives
    each part's time (each is a pass of the fp32 model over the calibration sentences)."""
    files = CalibrationFiles(out)
    seconds = {} if seconds is None else seconds
    started = time.perf_counter()
    feeds = calibration_feeds(source, cfg.calibration_sentences)
    if cfg.equalize_outputs:
        from kokoro_opt.passes.equalize import channel_ranges

        channel_ranges(source.model_file, feeds, files.output_ranges)
        seconds["output_ranges"] = round(time.perf_counter() - started, 1)
    if cfg.mode == "mixed" and cfg.input_clip_percentiles:
        began = time.perf_counter()
        nodes = quantizable_nodes(source.model_file, cfg.op_types)
        input_ranges(source.model_file, nodes, feeds, cfg.input_clip_percentiles, files.input_ranges)
        seconds["input_ranges"] = round(time.perf_counter() - began, 1)
    if not files.ranges.exists():
        began = time.perf_counter()
        scratch = out / ".calibration-probe.onnx"
        quantize_static_qdq(source.model_file, scratch, cfg, files, feeds)
        scratch.unlink(missing_ok=True)
        seconds["ranges"] = round(time.perf_counter() - began, 1)
    return files


# ---- the calibration a lock pins ----------------------------------------------------------------


def _node_tensors(model_file: Path, nodes: list[str]) -> tuple[set[str], set[str]]:
    """(activation inputs and outputs of `nodes`, the outputs of those that are Conv)."""
    import onnx

    model = onnx.load(str(model_file), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    wanted = set(nodes)
    tensors, conv_outputs = set(), set()
    for node in model.graph.node:
        if node.name in wanted:
            tensors |= {t for t in [*node.input, *node.output] if t and t not in initializers}
            conv_outputs |= {node.output[0]} if node.op_type == "Conv" else set()
    return tensors, conv_outputs


def _f64_text(values: list[float]) -> str:
    return base64.b64encode(np.asarray(values, "<f8").tobytes()).decode("ascii")


def _f64_values(text: str) -> list[float]:
    return np.frombuffer(base64.b64decode(text), "<f8").tolist()


def calibration_for_lock(files: CalibrationFiles, model_file: Path, nodes: list[str], clips: dict[str, float]) -> dict:
    """The part of the calibration that quantizing `nodes` (clipped as `clips`) reads, for a lock.

    Per-channel output ranges are stored as base64 of their float64 bytes (as JSON numbers they would
    make the lock twice as large), exact: a 1e-6 change of the ranges moves the lock gate's PESQ by up
    to 0.1 (docs/reproducibility.md), so they are kept to the last bit."""
    tensors, conv_outputs = _node_tensors(model_file, nodes)
    ort_ranges = json.loads(files.ranges.read_text(encoding="utf-8"))
    locked: dict = {
        "ranges": {**ort_ranges, "data": {t: e for t, e in sorted(ort_ranges["data"].items()) if t in tensors}},
        "input_ranges": {},
        "output_ranges": {},
    }
    if files.output_ranges.exists():
        outputs = json.loads(files.output_ranges.read_text(encoding="utf-8"))
        locked["output_ranges"] = {
            t: [_f64_text(lo), _f64_text(hi)] for t, (lo, hi) in sorted(outputs.items()) if t in conv_outputs
        }
    if clips:
        inputs = json.loads(files.input_ranges.read_text(encoding="utf-8"))
        locked["input_ranges"] = {t: {percentile_key(p): inputs[t][percentile_key(p)]} for t, p in sorted(clips.items())}
    return locked


def restore_calibration(
    folder: Path, locked: dict | None, model_file: Path, nodes: list[str], clips: dict[str, float], cfg: QuantizeStage
) -> CalibrationFiles | None:
    """Write a lock's calibration into `folder`; None when the lock holds none or lacks a range the
    quantization of `nodes` reads (a hand-edited or older lock): then the stage calibrates."""
    if not locked:
        return None
    tensors, conv_outputs = _node_tensors(model_file, nodes)
    covered = (
        tensors <= set(locked["ranges"]["data"])
        and (not cfg.equalize_outputs or conv_outputs <= set(locked["output_ranges"]))
        and all(percentile_key(p) in locked["input_ranges"].get(t, {}) for t, p in clips.items())
    )
    if not covered:
        return None
    files = CalibrationFiles(folder)
    files.ranges.write_text(json.dumps(locked["ranges"]), encoding="utf-8")
    outputs = {t: [_f64_values(lo), _f64_values(hi)] for t, (lo, hi) in locked["output_ranges"].items()}
    files.output_ranges.write_text(json.dumps(outputs), encoding="utf-8")
    files.input_ranges.write_text(json.dumps(locked["input_ranges"]), encoding="utf-8")
    return files
