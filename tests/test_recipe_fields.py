"""No setting without an effect: every field of the export and stage configs is read by the code that
builds the artifact. Each pass runs on the tiny model with its config wrapped in a recorder of the
fields it reads; a field that no run reads is a setting that changes nothing, and fails here.

A field read by only one mode (quantize's budgets in `mixed`) counts once read. A value that would do
nothing in a given combination is refused by the schema instead (`fallback_precision: fp16` outside
`mixed`: tests/test_fp16_islands.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from kokoro_opt.build import prepare_output
from kokoro_opt.export import PASS as EXPORT
from kokoro_opt.passes import PASSES
from kokoro_opt.recipe import (
    CompressStage,
    CoreMLStage,
    EdgesStage,
    ExportConfig,
    Fp16Stage,
    FuseStage,
    OrtFormatStage,
    QuantizeStage,
    SimplifyStage,
    SmoothStage,
    SnakeStage,
    Stage,
    ValidationConfig,
    WindowsStage,
)
from kokoro_opt.weights.sources import resolve_weights
from tests.test_passes import build_with

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast


class FieldReads:
    """Stands in for a config: hands out its values and notes each field read (nested configs too)."""

    def __init__(self, config: BaseModel, seen: set[str]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name: str) -> Any:
        config = object.__getattribute__(self, "_config")
        value = getattr(config, name)
        if name in type(config).model_fields:
            object.__getattribute__(self, "_seen").add(f"{type(config).__name__}.{name}")
            if isinstance(value, BaseModel):
                return FieldReads(value, object.__getattribute__(self, "_seen"))
        return value


# One run per config that reaches different fields; quantize runs in each of its modes.
RUNS: list[BaseModel] = [
    SimplifyStage(kind="simplify", tool="onnxsim", ort_level="basic"),
    SmoothStage(kind="smooth", calibration_sentences=1),
    SnakeStage(kind="snake"),
    QuantizeStage(kind="quantize", mode="dynamic"),
    QuantizeStage(kind="quantize", mode="static", calibration_sentences=1, equalize_outputs=True),
    QuantizeStage(
        kind="quantize",
        mode="mixed",
        op_types=["Conv", "MatMul"],
        calibration_sentences=1,
        sensitivity_sentences=1,
        quality_budget_pesq=1.0,
        min_sentence_pesq=1.0,
        max_high_band_db=20,
        min_durations_equal=0.0,
        min_block_time_share=0.3,  # one block (a noise resblock, with branches): the budget fields decide something
        input_clip_percentiles=[99.9],
    ),
    CompressStage(kind="compress", min_elements=64),
    Fp16Stage(kind="fp16"),
    EdgesStage(kind="edges", check_sentences=2),
    WindowsStage(kind="windows", calibration_sentences=1, check_sentences=2, check_phrases=1),
    OrtFormatStage(kind="ort"),
    CoreMLStage(kind="coreml", max_tokens=16),
]
# the fuse stage reads a windowed INT8 chain (tests/test_fuse.py builds the same one)
FUSE_RUN = FuseStage(kind="fuse", check_sentences=2, check_phrases=1, min_pesq=1.0)
CLASSES = (ExportConfig, ValidationConfig, *Stage.__origin__.__args__)  # type: ignore[attr-defined]  (every stage)


def test_every_export_and_stage_field_is_read_when_building(tiny_recipe, artifacts_root, tmp_path: Path) -> None:
    seen: set[str] = set()
    weights = resolve_weights(tiny_recipe.weights, log=lambda _: None)
    EXPORT.run(weights, FieldReads(tiny_recipe.export, seen), _fresh(tmp_path / "export"))
    # the stages after simplify expect its folded graph, as in every recipe
    simplified = build_with(tiny_recipe, artifacts_root, "t-fields", [{"kind": "simplify", "ort_level": "basic"}]).artifact
    for i, config in enumerate(RUNS):
        out = _fresh(tmp_path / f"{i}-{config.kind}")
        prepare_output(simplified, out)  # as the engine does: the input's runtime files, for the pass to amend
        PASSES[config.kind].run(simplified, FieldReads(config, seen), out)
    from tests.test_fuse import INT8

    windowed = build_with(tiny_recipe, artifacts_root, "t-fused-source", INT8).artifact
    out = _fresh(tmp_path / "fuse")
    prepare_output(windowed, out)
    PASSES["fuse"].run(windowed, FieldReads(FUSE_RUN, seen), out)

    declared = {f"{cls.__name__}.{name}" for cls in CLASSES for name in cls.model_fields if name != "kind"}
    unread = sorted(declared - seen)
    assert not unread, f"recipe fields that no stage reads (make them work or reject them): {unread}"


def _fresh(folder: Path) -> Path:
    folder.mkdir(parents=True)
    return folder
