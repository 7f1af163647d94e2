"""The windowed generator's per-job part runs once per job (kokoro_opt/passes/hoisting.py): the same output as
the uncut graph, with the lookup tables and style vectors computed apart and weights left in place."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from kokoro_opt.onnx_graph import GraphIndex
from kokoro_opt.passes.hoisting import hoist, merge_shared_gemms
from kokoro_opt.passes.int8_lookup import conv_channels, tabulate
from tests.test_int8_lookup import C, T, features_style_model


def conv_chain_model() -> onnx.ModelProto:
    """features -> INT8 Conv -> Q/DQ -> x * (style + 1) -> sin -> Q/DQ -> out: a resblock's conv-to-conv chain
    (its lookup table depends on the style alone) and a weight DequantizeLinear (which must stay put)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.integers(-100, 100, (C, C, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.full(C, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(C, np.int8), "w_zero"),
        numpy_helper.from_array(np.array(0.05, np.float32), "a_scale"),
        numpy_helper.from_array(np.array(128, np.uint8), "a_zero"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["features", "a_scale", "a_zero"], ["fq"]),
        helper.make_node("DequantizeLinear", ["fq", "a_scale", "a_zero"], ["fx"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], axis=0),
        helper.make_node("Conv", ["fx", "w"], ["conv"], pads=[1, 1]),
        helper.make_node("QuantizeLinear", ["conv", "a_scale", "a_zero"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "a_scale", "a_zero"], ["x"]),
        helper.make_node("Add", ["style", "one"], ["gain"]),
        helper.make_node("Mul", ["x", "gain"], ["scaled"]),
        helper.make_node("Sin", ["scaled"], ["sine"]),
        helper.make_node("QuantizeLinear", ["sine", "a_scale", "a_zero"], ["q_out"]),
        helper.make_node("DequantizeLinear", ["q_out", "a_scale", "a_zero"], ["out"]),
    ]
    return features_style_model(nodes, inits)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("tables", [False, True])
def test_the_per_job_part_runs_once_apart_and_the_output_is_the_same(tables: bool) -> None:
    model = conv_chain_model()
    if tables:
        assert tabulate(model, ["features"]) == 1
    hoisted = hoist(model, ["features"], ["style"])
    window_nodes = {n.op_type for n in hoisted.window.graph.node}
    constants_reads = {t for n in hoisted.constants.graph.node for t in n.input}
    assert "features" not in constants_reads  # nothing that moves with time runs once per job
    assert "DequantizeLinear" in window_nodes  # the weight's: ONNX Runtime fuses it into its INT8 Conv
    if tables:  # the table is computed from the style alone: only the lookup is left per window
        assert window_nodes == {"QuantizeLinear", "DequantizeLinear", "Conv", "Cast", "GatherElements"}
        assert any(name.endswith("/table/q_out") for name in hoisted.names)
    else:
        assert hoisted.names == ("gain",) and "Add" not in window_nodes

    rng = np.random.default_rng(1)
    window = session(hoisted.window)
    reads = {i.name for i in window.get_inputs()}
    for _ in range(3):
        feeds = {
            "features": rng.normal(0, 2, (1, C, T)).astype(np.float32),
            "style": rng.normal(0, 1, (1, C, 1)).astype(np.float32),
        }
        constants = dict(zip(hoisted.names, session(hoisted.constants).run(None, {"style": feeds["style"]}), strict=True))
        apart = window.run(None, {k: v for k, v in {**feeds, **constants}.items() if k in reads})[0]
        whole = session(model).run(None, feeds)[0]
        np.testing.assert_array_equal(apart, whole)
        assert np.abs(whole).max() > 0.1  # a real signal, not zeros on both sides


def test_a_graph_with_no_per_job_part_is_refused() -> None:
    model = conv_chain_model()
    with pytest.raises(KeyError, match="computed from"):
        hoist(model, ["features", "style"], [])


@pytest.mark.parametrize(
    ("op", "weight_shape", "group", "channels"),
    [
        ("Conv", (6, 2, 3), 2, 6),  # [C_out, C_in / group, k]: 6 out of 4 in, in 2 groups
        ("Conv", (3, 4, 1), 1, 3),
        ("ConvTranspose", (4, 6, 3), 1, None),  # [C_in, C_out / group, k]: not read, its table keeps the input's shape
    ],
)
def test_a_tables_channel_count_comes_from_the_convolution_weight(op, weight_shape, group, channels) -> None:
    weight = numpy_helper.from_array(np.ones(weight_shape, np.float32), "w")
    nodes = [
        helper.make_node(op, ["x", "w"], ["conv"], group=group),
        helper.make_node("QuantizeLinear", ["conv", "s", "z"], ["q"]),
    ]
    graph = helper.make_graph(nodes, "g", [], [], initializer=[weight])
    assert conv_channels(GraphIndex(helper.make_model(graph)), "q") == channels


def test_gemms_reading_one_input_run_as_one_gemm_with_the_same_outputs() -> None:
    """The per-job part's AdaIN projections of one style vector: one Gemm and a Split in place of one each. A Gemm of
    another input, with its weight the other way round, one bias for all rows or a weight computed from an input
    stays; a reader placed before the merged Gemm moves after it."""
    rng = np.random.default_rng(0)
    sizes = [8, 12, 4]
    inits = [numpy_helper.from_array(rng.normal(0, 1, (n, 16)).astype(np.float32), f"w{i}") for i, n in enumerate(sizes)]
    inits += [numpy_helper.from_array(rng.normal(0, 1, n).astype(np.float32), f"b{i}") for i, n in enumerate(sizes)]
    inits += [
        numpy_helper.from_array(rng.normal(0, 1, (16, 5)).astype(np.float32), "w_kn"),
        numpy_helper.from_array(rng.normal(0, 1, 5).astype(np.float32), "b_kn"),
        numpy_helper.from_array(rng.normal(0, 1, 1).astype(np.float32), "b_one"),
    ]
    nodes = [
        helper.make_node("Gemm", ["style", "w0", "b0"], ["y0"], transB=1),
        helper.make_node("Relu", ["y0"], ["r0"]),
        helper.make_node("Gemm", ["style", "w1", "b1"], ["y1"], transB=1),
        helper.make_node("Gemm", ["other", "w2", "b2"], ["y2"], transB=1),  # alone on its input
        helper.make_node("Gemm", ["style", "w2", "b2"], ["y3"], transB=1),
        helper.make_node("Gemm", ["style", "w_kn", "b_kn"], ["y4"]),  # [K, N]: not merged
        helper.make_node("Gemm", ["style", "w1", "b_one"], ["y5"], transB=1),  # one bias for every row: not merged
        helper.make_node("Add", ["w2", "delta"], ["w_moving"]),
        helper.make_node("Gemm", ["style", "w_moving", "b2"], ["y6"], transB=1),  # a weight computed from an input
    ]
    f = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [
            *(helper.make_tensor_value_info(name, f, [1, 16]) for name in ("style", "other")),
            helper.make_tensor_value_info("delta", f, [4, 16]),
        ],
        [
            helper.make_tensor_value_info(name, f, [1, n])
            for name, n in (("r0", 8), ("y1", 12), ("y2", 4), ("y3", 4), ("y4", 5), ("y5", 12), ("y6", 4))
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    merge_shared_gemms(merged)
    onnx.checker.check_model(merged)
    assert [n.op_type for n in merged.graph.node].count("Gemm") == 5
    feeds = {name: rng.normal(0, 1, (1, 16)).astype(np.float32) for name in ("style", "other")}
    feeds["delta"] = rng.normal(0, 1, (4, 16)).astype(np.float32)
    for before, after in zip(session(model).run(None, feeds), session(merged).run(None, feeds), strict=True):
        np.testing.assert_array_equal(after, before)
