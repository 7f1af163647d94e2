"""Lookup tables for INT8 conv-to-conv chains (kokoro_opt/passes/int8_lookup.py): the same output as the chain,
on graphs made here and on the windowed generator of a quantized tiny Kokoro."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kokoro_opt.passes.int8_lookup import tabulate

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

C, T = 4, 300


def chain_model(dtype: np.dtype, residual: bool = False) -> onnx.ModelProto:
    """features -> Q -> DQ -> x * gain(style) -> sin -> (+ features) -> Q (per channel) -> DQ -> out."""
    zero = np.zeros((), dtype=dtype) if dtype == np.int8 else np.array(128, dtype=dtype)
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "in_scale"),
        numpy_helper.from_array(zero, "in_zero"),
        numpy_helper.from_array(np.linspace(0.01, 0.04, C).astype(np.float32), "out_scale"),
        numpy_helper.from_array(np.full(C, zero, dtype=dtype), "out_zero"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    last = "wave"
    nodes = [
        helper.make_node("QuantizeLinear", ["features", "in_scale", "in_zero"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "in_scale", "in_zero"], ["x"]),
        helper.make_node("Mul", ["x", "style"], ["scaled"]),
        helper.make_node("Sin", ["scaled"], ["sine"]),
        helper.make_node("Add", ["sine", "half"], ["wave"]),
    ]
    if residual:  # reads the activations themselves: not a function of q alone
        nodes.append(helper.make_node("Add", ["wave", "features"], ["mixed"]))
        last = "mixed"
    nodes += [
        helper.make_node("QuantizeLinear", [last, "out_scale", "out_zero"], ["q_out"], axis=1),
        helper.make_node("DequantizeLinear", ["q_out", "out_scale", "out_zero"], ["out"], axis=1),
    ]
    return features_style_model(nodes, inits)


def features_style_model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    """A graph of `nodes`: `features` [1, C, T] (moves with time) and `style` [1, C, 1] in, `out` [1, C, T] out."""
    graph = helper.make_graph(
        nodes,
        "chain",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, C, T]),
            helper.make_tensor_value_info("style", TensorProto.FLOAT, [1, C, 1]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, C, T])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_a_table_gives_the_chains_output_for_every_level(dtype) -> None:
    rng = np.random.default_rng(0)
    model = chain_model(dtype)
    tabled = chain_model(dtype)
    assert tabulate(tabled, ["features"]) == 1
    ops = [n.op_type for n in tabled.graph.node]
    assert "GatherElements" in ops and ops.count("Sin") == 1  # the one Sin left makes the table
    for _ in range(3):  # another style each run: the table is made in the run
        feeds = {
            "features": rng.uniform(-7, 7, (1, C, T)).astype(np.float32),  # every level, some clipped
            "style": rng.uniform(0.5, 3, (1, C, 1)).astype(np.float32),
        }
        tables, chains = run(tabled, feeds), run(model, feeds)
        # the same levels (equal here; a CPU whose kernels round a tail differently may move a rare one by one)
        step = float(np.linspace(0.01, 0.04, C).max())
        assert np.abs(tables - chains).max() <= step * 1.001 and np.mean(tables == chains) > 0.999


def test_a_chain_that_reads_the_activations_again_is_left_alone() -> None:
    model = chain_model(np.uint8, residual=True)
    assert tabulate(model, ["features"]) == 0
    assert "GatherElements" not in [n.op_type for n in model.graph.node]


def test_the_windowed_generator_of_a_quantized_kokoro_sounds_the_same_with_tables(tiny_recipe, artifacts_root) -> None:
    from kokoro_opt.passes.windows import MomentsProbe
    from kokoro_opt.passes.windows_split import split, window_graphs
    from kokoro_opt.runtime.norm_stats import stats_from_moments
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.runtime.windowed import FRONT_OUTPUTS, STATS_INPUT, WindowedDecoder
    from kokoro_opt.voices import style_for
    from tests.test_passes import TOKENS, build_with

    static = {
        "kind": "quantize",
        "mode": "static",
        "calibration_sentences": 2,
        "exclude_nodes": ["/decoder/generator/conv_post/Conv"],
    }  # test_passes builds the same: one build
    artifact = build_with(tiny_recipe, artifacts_root, "t-static", [static]).artifact
    model = onnx.load(str(artifact.model_file))
    synth = Synthesizer(artifact)
    decoder = WindowedDecoder(synth, window_graphs(model)[0])  # its generator has the tables
    tokens = TOKENS * 3
    style = style_for(decoder.synth.packs["tiny_0"], len(tokens))
    front = decoder.front(tokens, style)
    stats = stats_from_moments(*MomentsProbe(synth, model).moments(tokens, style)[1:])
    feeds = {
        FRONT_OUTPUTS[0]: front.features,
        FRONT_OUTPUTS[1]: front.f0,
        FRONT_OUTPUTS[2]: front.phase_from(0, front.steps),
        FRONT_OUTPUTS[3]: front.decoder_style,
        STATS_INPUT: stats,
    }
    tabled, chains = (split(onnx.load(str(artifact.path / "model.onnx")), lookup_tables=flag)[1] for flag in (True, False))
    lookups = [n for n in tabled.graph.node if n.op_type == "GatherElements"]
    assert len(lookups) >= 6  # every resblock's chain between its two INT8 convolutions
    assert not any(n.op_type == "GatherElements" for n in chains.graph.node)
    tables, reference = run(tabled, feeds), run(chains, feeds)
    np.testing.assert_allclose(tables, reference, atol=1e-3 * float(np.abs(reference).max()))  # equal here
    hoisted = decoder.window(front, 0, front.steps, stats)  # tables computed once per job, then looked up
    assert hoisted.size == front.steps * 300
    np.testing.assert_array_equal(hoisted, np.asarray(tables, dtype=np.float32).reshape(-1) / decoder.synth.audio_gain)
    tables_per_job = [name for name in decoder.constant_names if "/table/" in name]
    assert len(tables_per_job) == len(lookups)  # every table is computed once per job, not per window
