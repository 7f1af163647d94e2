"""Each optimisation stage on the tiny Kokoro, and the mixed-precision selector on a known case."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kokoro_opt.build import build
from kokoro_opt.passes.sensitivity import Quality, block_of, part_of, select_blocks
from kokoro_opt.recipe import QuantizeStage, parse_recipe
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.store import Store

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

TOKENS = list(range(40, 80))


def build_with(tiny_recipe, root: Path, name: str, stages: list[dict]):
    data = tiny_recipe.model_dump(mode="json", by_alias=True)
    data.update(name=name, stages=stages)
    return build(parse_recipe(data), root)


def runs(artifact) -> np.ndarray:
    result = Synthesizer(artifact).run_tokens(TOKENS, "tiny_0")
    assert np.all(np.isfinite(result.audio)) and result.audio.size > 0
    return result.audio


def ops(record: dict) -> dict[str, int]:
    return record["graph"]["op_counts"]


def test_simplify_with_onnxsim_then_ort_basic(tiny_recipe, artifacts_root, tiny_artifact) -> None:
    result = build_with(tiny_recipe, artifacts_root, "t-simplify", [{"kind": "simplify", "tool": "onnxsim"}])
    record = result.artifact.build.stages[-1]
    assert record["graph"]["nodes"] < record["before"]["nodes"]
    np.testing.assert_allclose(runs(result.artifact), runs(tiny_artifact), atol=1e-3)


def test_dynamic_and_static_quantization_write_integer_ops(tiny_recipe, artifacts_root, tiny_artifact) -> None:
    # The quantizers read the cached export and never write beside it: ORT's scratch file there was a
    # race between two builds quantizing the same export at once.
    export = Store(artifacts_root).stage_path("export", tiny_artifact.path.name)
    export_written = export.stat().st_mtime_ns
    dynamic = build_with(tiny_recipe, artifacts_root, "t-dyn", [{"kind": "quantize", "mode": "dynamic"}])
    assert "ConvInteger" in ops(dynamic.artifact.build.stages[-1])
    static = build_with(
        tiny_recipe,
        artifacts_root,
        "t-static",
        [
            {
                "kind": "quantize",
                "mode": "static",
                "calibration_sentences": 2,
                "exclude_nodes": ["/decoder/generator/conv_post/Conv"],
            }
        ],
    )
    counts = ops(static.artifact.build.stages[-1])
    assert counts["QuantizeLinear"] > 0 and counts["DequantizeLinear"] > 0
    assert export.stat().st_mtime_ns == export_written
    assert (static.artifact.path / "calibration.json").is_file()
    runs(static.artifact)


# A mixed quantize stage the tiny model's noise can pass: the analysis runs, the budget holds.
TINY_MIXED = {
    "kind": "quantize",
    "mode": "mixed",
    "op_types": ["MatMul"],
    "calibration_sentences": 2,
    "sensitivity_sentences": 1,
    "quality_budget_pesq": 1.0,
    "min_sentence_pesq": 1.0,
    "max_high_band_db": 20,
}


def test_mixed_writes_a_precision_map(tiny_recipe, artifacts_root) -> None:
    result = build_with(tiny_recipe, artifacts_root, "t-mixed", [TINY_MIXED])
    mixed = result.artifact.build.stages[-1]["mixed"]
    import json

    precision = json.loads((result.artifact.path / "precision_map.json").read_text())
    assert set(precision["nodes"].values()) <= {"int8", "fp32"}
    assert mixed["int8_nodes"] + mixed["fallback_nodes"] == len(precision["nodes"])
    # ORT's profile leaves out a MatMul's weight operand: the ALBERT's work is still counted
    assert precision["blocks"]["bert"]["compute_share"] > 0
    runs(result.artifact)


def test_mixed_scores_resblocks_with_cut_inputs_and_retries_their_branches(tiny_recipe, artifacts_root) -> None:
    """An unreachable budget: every block falls back and each resblock is retried branch by branch."""
    stage = {
        "kind": "quantize",
        "mode": "mixed",
        "op_types": ["Conv"],
        "calibration_sentences": 2,
        "sensitivity_sentences": 1,
        "min_block_time_share": 0.15,  # the noise_res resblocks (36% and 15% of the MACs; next 10%), retried by branch
        "quality_budget_pesq": 4.64,
        "input_clip_percentiles": [99.9],
    }
    result = build_with(tiny_recipe, artifacts_root, "t-mixed-clip", [stage])
    import json

    precision = json.loads((result.artifact.path / "precision_map.json").read_text())
    ranges = json.loads((result.artifact.path / "input_ranges.json").read_text())
    resblock_inputs = [t for t in ranges if "/generator/resblocks." in t]
    assert resblock_inputs and all(ranges[t]["99.9"][0] <= ranges[t]["99.9"][1] for t in resblock_inputs)
    tried = [h["part"] for h in precision["fallback_history"] if "part" in h]
    assert tried and all("/branch." in p for p in tried)
    assert set(precision["input_clips"].values()) <= {99.9} and not (result.artifact.path / ".calibration-clipped.json").exists()


def test_fp16_keeps_io_types_and_runs(tiny_recipe, artifacts_root) -> None:
    # as recipes/fp16.yaml: node names kept (no onnxsim), so SineGen is found and kept FP32
    result = build_with(tiny_recipe, artifacts_root, "t-fp16", [{"kind": "simplify"}, {"kind": "fp16"}])
    import onnx

    model = onnx.load(str(result.artifact.model_file))
    assert model.graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    import json

    kept = json.loads((result.artifact.path / "precision_map.json").read_text())["fp32_exceptions"]
    assert any("/m_source/" in name for name in kept) and all(kept.values())
    # The random tiny weights overflow FP16's range, so only the structure of the output is checked here;
    # FP16 quality on the real weights is measured by `kokoro-opt evaluate`.
    out = Synthesizer(result.artifact).run_tokens(TOKENS, "tiny_0")
    assert len(out.durations) == len(TOKENS) + 2 and len(out.audio) == int(out.durations.sum()) * 600


def test_ort_format_runs_and_keeps_required_operators(tiny_recipe, artifacts_root) -> None:
    result = build_with(tiny_recipe, artifacts_root, "t-ort", [{"kind": "ort"}])
    assert result.artifact.model_file.suffix == ".ort"
    assert list(result.artifact.path.glob("required_operators*.config"))
    runs(result.artifact)


def test_block_grouping() -> None:
    assert block_of("/decoder/generator/resblocks.0/convs1.0/Conv") == "decoder/generator/resblocks.0"
    assert block_of("/decoder/generator/conv_post/Conv") == "decoder/generator/conv_post"
    assert block_of("/decoder/decode.3/conv1/Conv") == "decoder/decode.3"
    assert block_of("/bert/encoder/albert_layer_groups.0/albert_layers.0/attention/query/MatMul") == "bert"
    assert block_of("/F0.1/conv1/Conv") == "F0.1"


def test_selector_excludes_the_known_sensitive_blocks() -> None:
    """conv_post adds static (PESQ looks fine, high band does not); b only hurts in combination."""
    cfg = QuantizeStage(kind="quantize", mode="mixed")
    drop = {"a": 0.14, "b": 0.64, "c": 0.24, "conv_post": 0.3}

    def score(blocks: set[str]) -> Quality:
        pesq = 4.64 - sum(drop[b] for b in blocks)
        static = 6.0 if "conv_post" in blocks else 0.1
        return Quality(pesq, pesq, static, 1.0, True)

    chosen, alone, history = select_blocks(sorted(drop), score, cfg, log=lambda _: None)
    assert sorted(chosen) == ["a", "c"]
    assert not alone["conv_post"].passes(cfg)
    assert history[0]["int8_blocks"] == 3 and not history[0]["passes"] and history[-1]["passes"]


def test_selector_takes_the_parts_of_a_fallen_block_that_fit_the_budget() -> None:
    """`big` costs too much as a whole, but one of its branches fits next to `a`; the other does not."""
    cfg = QuantizeStage(kind="quantize", mode="mixed")
    drop = {"a": 0.3, "big": 0.7, "big/branch.0": 0.6, "big/branch.1": 0.2}

    def score(units: set[str]) -> Quality:
        pesq = 4.64 - sum(drop[u] for u in units)
        return Quality(pesq, pesq, 0.0, 1.0, True)

    parts = {"big": ["big/branch.0", "big/branch.1"], "a": ["a"]}
    chosen, _, history = select_blocks(["a", "big"], score, cfg, log=lambda _: None, parts=parts)
    assert chosen == ["a", "big/branch.1"]
    assert [h.get("part") for h in history] == [None, None, "big/branch.0", "big/branch.1"]
    assert [h["passes"] for h in history] == [False, True, False, True]


def test_selector_drops_the_block_that_costs_most_quality_per_unit_of_compute() -> None:
    """`small` hurts less alone than `big` but does a tenth of its work: it is the one to fall back."""
    cfg = QuantizeStage(kind="quantize", mode="mixed")
    drop = {"a": 0.2, "big": 0.5, "small": 0.4}

    def score(units: set[str]) -> Quality:
        pesq = 4.64 - sum(drop[u] for u in units)
        return Quality(pesq, pesq, 0.0, 1.0, True)

    shares = {"a": 0.3, "big": 0.6, "small": 0.06}
    chosen, _, history = select_blocks(sorted(drop), score, cfg, log=lambda _: None, shares=shares)
    assert sorted(chosen) == ["a", "big"]
    assert history[0]["falls_back"] == "small" and history[-1]["passes"]
    # Without shares the most sensitive block goes first, and the model keeps less of its work in INT8.
    chosen, _, history = select_blocks(sorted(drop), score, cfg, log=lambda _: None)
    assert sorted(chosen) == ["a", "small"] and history[0]["falls_back"] == "big"


def test_selector_keeps_plain_ranges_when_the_cut_fails_the_gate() -> None:
    """Cut, `big` scores better on average but one sentence drops below 3.0: the plain ranges stay."""
    cfg = QuantizeStage(kind="quantize", mode="mixed")

    def score(units: set[str]) -> Quality:
        return Quality(4.54, 2.9, 0.0, 1.0, True) if "big@99.9" in units else Quality(4.34, 4.3, 0.0, 1.0, True)

    parts = {"big": ["big/branch.0", "big/branch.1"]}
    chosen, alone, _ = select_blocks(["big"], score, cfg, log=lambda _: None, parts=parts, clip_percentiles=[99.9])
    assert chosen == ["big"]
    assert alone["big@99.9"].sensitivity < alone["big"].sensitivity and not alone["big@99.9"].passes(cfg)


def test_parts_are_dilation_branches() -> None:
    assert part_of("/decoder/generator/resblocks.5/convs1.2/Conv") == "decoder/generator/resblocks.5/branch.2"
    assert part_of("/decoder/generator/resblocks.5/convs2.2/Conv") == "decoder/generator/resblocks.5/branch.2"
    assert part_of("/decoder/decode.0/conv1/Conv") == "/decoder/decode.0/conv1/Conv"


def test_smooth_keeps_the_output_and_moves_ranges_into_the_weights(tiny_recipe, artifacts_root) -> None:
    simplify = {"kind": "simplify"}  # folds 1/alpha into an initializer, as in recipes/int8-mixed.yaml
    plain = build_with(tiny_recipe, artifacts_root, "t-simplify-basic", [simplify])
    result = build_with(tiny_recipe, artifacts_root, "t-smooth", [simplify, {"kind": "smooth", "calibration_sentences": 1}])
    record = result.artifact.build.stages[-1]
    assert record["chains"] >= 12  # every AdaIN -> Snake -> Conv of the generator's resblocks
    np.testing.assert_allclose(runs(result.artifact), runs(plain.artifact), rtol=1e-3, atol=1e-4)


def test_selector_falls_back_everything_when_nothing_passes() -> None:
    cfg = QuantizeStage(kind="quantize", mode="mixed")
    chosen, _, history = select_blocks(["x"], lambda _: Quality(2.0, 2.0, 0.0, 0.0, True), cfg, log=lambda _: None)
    assert chosen == [] and history == []


def test_selector_rejects_a_block_that_changes_durations() -> None:
    """Sounding fine is not enough: a block that changes a predicted duration stays in higher precision."""
    cfg = QuantizeStage(kind="quantize", mode="mixed")
    equal = {"a": 1.0, "front": 2 / 3}

    def score(units: set[str]) -> Quality:
        return Quality(4.5, 4.4, 0.0, min(equal[u] for u in units), True)

    chosen, alone, _ = select_blocks(["a", "front"], score, cfg, log=lambda _: None)
    assert chosen == ["a"] and not alone["front"].passes(cfg)
    assert alone["front"].passes(cfg.model_copy(update={"min_durations_equal": 0.6}))


@pytest.mark.parametrize(
    "bad",
    [
        {"quality_budget_pesq": 9},
        {"mode": "fast"},
        {"calibrate_method": "Magic"},
        {"input_clip_percentiles": [100]},
        {"min_durations_equal": 1.5},
    ],
)
def test_quantize_config_is_validated(bad: dict) -> None:
    from kokoro_opt.errors import UserError

    with pytest.raises(UserError):
        parse_recipe({"name": "x", "stages": [{"kind": "quantize", "mode": "static", **bad}]})


@pytest.mark.parametrize(
    ("stage", "unread"),
    [({"mode": "dynamic", "per_channel": True, "op_types": ["MatMul"]}, "mode 'dynamic' does not read op_types, per_channel"),
     ({"mode": "dynamic", "quality_budget_pesq": 4.5}, "mode 'dynamic' does not read quality_budget_pesq"),
     ({"mode": "static", "min_durations_equal": 0.5}, "mode 'static' does not read min_durations_equal")],
)  # fmt: skip
def test_a_quantize_field_its_mode_never_reads_is_refused(stage: dict, unread: str) -> None:
    """Dynamic mode (kokoro-onnx's recipe) took per_channel and op_types and quantized per tensor, every op type:
    a field that would change nothing is refused, not recorded as if it had been applied."""
    from kokoro_opt.errors import UserError

    with pytest.raises(UserError, match=re.escape(unread)):
        parse_recipe({"name": "x", "stages": [{"kind": "quantize", **stage}]})
    kept = parse_recipe({"name": "x", "stages": [{"kind": "quantize", "mode": "dynamic", "exclude_nodes": ["/a"]}]})
    assert kept.stages[0].exclude_nodes == ["/a"]  # what dynamic mode reads


def test_selector_cuts_the_inputs_of_a_fallen_block_when_that_scores_better() -> None:
    """Cut at 99.9, `big` scores better alone; it still falls back, and its branches get the cut."""
    cfg = QuantizeStage(kind="quantize", mode="mixed")
    drop = {"a": 0.3, "big": 0.7, "big@99.9": 0.55, "big@99": 0.6, "big/branch.0": 0.6, "big/branch.1": 0.6}
    drop |= {"big/branch.0@99.9": 0.6, "big/branch.1@99.9": 0.3}

    def score(units: set[str]) -> Quality:
        pesq = 4.64 - sum(drop[u] for u in units)
        return Quality(pesq, pesq, 0.0, 1.0, True)

    parts = {"big": ["big/branch.0", "big/branch.1"]}
    chosen, _, history = select_blocks(["a", "big"], score, cfg, log=lambda _: None, parts=parts, clip_percentiles=[99, 99.9])
    assert chosen == ["a", "big/branch.1@99.9"]
    assert history[0]["falls_back"] == "big@99.9"
    assert [h.get("part") for h in history][-2:] == ["big/branch.0@99.9", "big/branch.1@99.9"]

    drop["big@99.9"] = 0.45  # cut, the whole block now fits next to `a`
    chosen, _, _ = select_blocks(["a", "big"], score, cfg, log=lambda _: None, parts=parts, clip_percentiles=[99, 99.9])
    assert chosen == ["a", "big@99.9"]

    drop |= {"big@99.9": 0.9, "big@99": 0.8}  # cutting hurts: the branches are tried with plain ranges
    chosen, _, history = select_blocks(["a", "big"], score, cfg, log=lambda _: None, parts=parts, clip_percentiles=[99, 99.9])
    assert chosen == ["a"] and [h.get("part") for h in history][-2:] == ["big/branch.0", "big/branch.1"]


def test_ort_s_temporary_files_go_with_the_stage_s_folder(tmp_path: Path) -> None:
    """quantize_static copies the model it calibrates into the system's temporary folder; a killed build left that
    copy there (330 MB for the real model). Within a quantizer's input, temporary files go beside the target."""
    import tempfile

    from kokoro_opt.passes.qdq import private_input

    source, target = tmp_path / "source.onnx", tmp_path / "stage" / "model.onnx"
    source.write_bytes(b"model")
    target.parent.mkdir()
    before = tempfile.gettempdir()
    with private_input(source, target) as model_input:
        assert Path(tempfile.gettempdir()) == model_input.parent and model_input.parent.parent == target.parent
        with tempfile.TemporaryDirectory(prefix="ort.quant.") as made:
            assert Path(made).parent == model_input.parent
    assert tempfile.gettempdir() == before and list(target.parent.iterdir()) == []
