"""The graph side of the windowed decoder: the front once per sentence, the generator window by window.

On CPU the generator (the upsampling HiFi-GAN half of the decoder) is 82-91% of the compute. Run whole,
an utterance's first sound waits for all of it. `split` cuts the model into two graphs, and
`window_graphs` makes the graphs the runtime loads (the `windows` stage writes them into the artifact):

- the front: ALBERT, the LSTMs, the duration, F0 and energy predictors and the decoder's frame-rate
  blocks, on the whole sentence. Outputs the generator's inputs, all at its step rate.
- the generator: the harmonic source and the generator on any span of those inputs. Its InstanceNorms
  normalize with statistics fed as `norm_stats` instead of the span's own: a window's own statistics
  are far off the sentence's (measured PESQ 2.0-2.7 on 1 s windows), per-voice statistics measured on
  calibration utterances of about the same length are close (kokoro_opt/runtime/windowed.py, docs/serving.md).
  With the statistics fed, its chains between two INT8 convolutions become per-channel lookup tables
  (kokoro_opt/passes/int8_lookup.py). What depends on the style and statistics alone (the norms' gains,
  those tables) is computed once per job, not per window (kokoro_opt/passes/hoisting.py).
- the whole generator: the same cut with its own norms, for the jobs that finish with one run over the
  whole utterance after their first window (kokoro_opt/runtime/windowed.py).

SineGen's phase is a running sum from the sentence's first frame. SineGen sums it per step and then
interpolates it to audio samples, so the front stops at that per-step phase and each window turns its
slice into sines, the source and the source's STFT. That work is per audio sample, and moving it out
took a quarter of the front's time off (docs/serving.md). A window [a, b) is decoded with `overlap`
steps of context on each side and cut back to [a, b): the generator's receptive field is a few steps
wide.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kokoro_opt.onnx_graph import cut
from kokoro_opt.passes.edge_input import PREFIX as EDGES_PREFIX
from kokoro_opt.passes.edge_input import SOURCE_CONSUMER, float_source
from kokoro_opt.passes.hoisting import hoist
from kokoro_opt.passes.int8_lookup import tabulate
from kokoro_opt.runtime.windowed import FRONT_OUTPUTS, STATS_INPUT, WindowGraphs

log = logging.getLogger(__name__)

GENERATOR_ENTRY = "/decoder/generator/LeakyRelu"  # input 0: the frame-rate blocks' output, 2 steps per frame
GENERATOR_PREFIX = "/decoder/generator/"
F0_ENTRY = "/decoder/generator/f0_upsamp/Resize"  # input 0: F0 per step, repeated to audio samples
SINE = "/decoder/generator/m_source/l_sin_gen/Sin"  # reads the phase interpolated to audio samples


@dataclass(frozen=True)
class GeneratorAnchors:
    features: str  # (1, C, steps): the generator's input
    f0: str  # (1, 1, steps): F0 in Hz
    phase: str  # (1, harmonics, steps): SineGen's running phase per harmonic, before it is interpolated
    style: str  # (1, 128): the decoder's half of the style vector
    norms: tuple[str, ...]  # the generator's InstanceNormalization nodes, in graph order


def _sample_rate_input(sine: Any, producers: dict[str, Any]) -> str:
    """The per-step tensor the Resize ahead of `sine` interpolates to audio samples (through Transposes)."""
    node = producers.get(sine.input[0])
    while node is not None and node.op_type == "Transpose":
        node = producers.get(node.input[0])
    if node is None or node.op_type != "Resize":
        raise KeyError(f"the Resize ahead of {SINE}")
    return str(node.input[0])


def anchors(model: Any) -> GeneratorAnchors:
    """The generator's boundary tensors; a KeyError names what is missing."""
    by_name = {node.name: node for node in model.graph.node}
    producers = {out: node for node in model.graph.node for out in node.output}
    for name in (GENERATOR_ENTRY, F0_ENTRY, SINE):
        if name not in by_name:
            raise KeyError(name)
    style_readers = [
        n
        for n in model.graph.node
        if n.name.startswith(GENERATOR_PREFIX) and "/fc/" in n.name and n.op_type in ("Gemm", "MatMul")
    ]
    if not style_readers:
        raise KeyError(GENERATOR_PREFIX + "*/fc/Gemm")
    norms = tuple(
        n.name for n in model.graph.node if n.op_type == "InstanceNormalization" and n.name.startswith(GENERATOR_PREFIX)
    )
    return GeneratorAnchors(
        features=by_name[GENERATOR_ENTRY].input[0],
        f0=by_name[F0_ENTRY].input[0],
        phase=_sample_rate_input(by_name[SINE], producers),
        style=style_readers[0].input[0],
        norms=norms,
    )


def _edge_slice(model: Any) -> Any:
    """The Slice the edges stage puts between the harmonic source and the generator, if any. It keeps every
    frame unless `edge_keep` is fed, which windowed decoding never does, so windows bypass it."""
    producers = {out: node for node in model.graph.node for out in node.output}
    by_name = {node.name: node for node in model.graph.node}
    node = producers.get(float_source(by_name[SOURCE_CONSUMER].input[0], producers))
    return node if node is not None and node.op_type == "Slice" and node.name.startswith(EDGES_PREFIX) else None


def _bypass(model: Any, node: Any) -> None:
    """Drop `node` (one data input, one output) from `model`: its readers read its data input instead."""
    g = model.graph
    kept = [n for n in g.node if n.name != node.name]
    for reader in kept:
        reader.input[:] = [node.input[0] if t == node.output[0] else t for t in reader.input]
    del g.node[:]
    g.node.extend(kept)
    read = {t for n in g.node for t in n.input}
    inputs = [v for v in g.input if v.name in read]
    del g.input[:]
    g.input.extend(inputs)


class SplitModel(NamedTuple):
    front: Any
    generator: Any  # normalizes with fed statistics
    channels: tuple[int, ...]  # of each generator norm, in graph order
    whole_generator: Any  # the same cut with its own norms: a whole utterance's audio, as whole decoding makes it


def split(model: Any, lookup_tables: bool = True) -> SplitModel:
    """The front and the generator cut from a whole-model graph. With fed statistics the generator's INT8
    conv-to-conv chains become per-channel lookup tables (kokoro_opt/passes/int8_lookup.py: the same output,
    ~10% less time); `lookup_tables=False` keeps the chains."""
    import onnx

    found = anchors(model)
    constants = {i.name for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in constants]
    boundary = (found.features, found.f0, found.phase, found.style)
    front = cut(model, inputs, [*boundary, "durations"], FRONT_OUTPUTS)
    edge_slice = _edge_slice(model)
    held = list(edge_slice.input[1:]) if edge_slice is not None else []
    generator = cut(model, [*boundary, *held], ["audio"], ["audio"], input_names=[*FRONT_OUTPUTS[:4], *held])
    if edge_slice is not None:
        _bypass(generator, edge_slice)
    g = generator.graph
    known = {"", *(i.name for i in g.initializer), *(v.name for v in g.input), *(o for n in g.node for o in n.output)}
    strays = [t for n in g.node for t in n.input if t not in known]
    if strays or len(g.input) != len(boundary):  # the cut walked past the boundary into the front
        raise KeyError(f"the generator reads {strays[:1] or [v.name for v in g.input]} besides its boundary")
    whole_generator = onnx.ModelProto()
    whole_generator.CopyFrom(generator)

    shapes = norm_channels(model, found.norms)
    feed_norm_stats(g, shapes)
    if lookup_tables:
        tabulate(generator, list(FRONT_OUTPUTS[:3]))
    return SplitModel(front, generator, tuple(shapes[n] for n in found.norms), whole_generator)


def window_graphs(model: Any, lookup_tables: bool = True, hoisting: bool = True) -> tuple[WindowGraphs, tuple[int, ...]]:
    """The graphs windowed decoding runs, serialized, and the channels of each generator norm (graph order).
    `lookup_tables` / `hoisting` off exist to measure what each saves (benchmarks/generator_variants.py). A
    generator whose per-job part cannot be cut out (a tensor whose type shape inference cannot tell) keeps it
    in every window: correct, only slower (logged)."""
    front, generator, channels, whole_generator = split(model, lookup_tables)
    job = None
    if hoisting:
        try:
            hoisted = hoist(generator, list(FRONT_OUTPUTS[:3]), [FRONT_OUTPUTS[3], STATS_INPUT])
        except KeyError as exc:
            log.warning("the generator's per-job part stays in its windows: %s not found", exc)
        else:
            generator, job = hoisted.window, hoisted.constants.SerializeToString()
    graphs = WindowGraphs(front.SerializeToString(), generator.SerializeToString(), job, whole_generator.SerializeToString())
    return graphs, channels


def feed_norm_stats(graph: Any, channels: dict[str, int]) -> None:
    """Make the InstanceNormalization nodes named in `channels` normalize with statistics fed as the graph
    input `norm_stats` (2, total channels; rows in graph order) instead of their input's own.

    Each norm becomes x * gain + (bias - mean * gain), two passes over the activations instead of three. The
    gains and shifts of all norms are computed as one vector and split: per norm, the same arithmetic on the
    same numbers, in a few nodes instead of a dozen each (in the windowed generator they run once per job,
    where ONNX Runtime's cost per node is most of their time)."""
    from onnx import TensorProto, helper, numpy_helper

    from kokoro_opt.onnx_graph import sort_topologically

    norms = [node for node in graph.node if node.op_type == "InstanceNormalization" and node.name in channels]
    counts = [channels[node.name] for node in norms]
    total = sum(counts)
    if not norms:
        raise KeyError(f"none of the norms {sorted(channels)[:3]}")
    p = STATS_INPUT + "/"
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([1, 1], dtype=np.int64), p + "rows"),
            numpy_helper.from_array(np.array([1, total, 1], dtype=np.int64), p + "shape"),
            numpy_helper.from_array(np.array(counts, dtype=np.int64), p + "counts"),
        ]
        + [numpy_helper.from_array(np.array([1, n, 1], dtype=np.int64), f"{p}affine_shape_{n}") for n in sorted(set(counts))]
    )

    def node(op: str, inputs: list[str], output: str, **attrs: Any) -> Any:
        return helper.make_node(op, inputs, [output], name=output, **attrs)

    # norm_stats rows: the mean and 1/sqrt(var + eps) of each norm's input, per channel
    shared = [helper.make_node("Split", [STATS_INPUT, p + "rows"], [p + "mean_row", p + "inv_row"], name=p + "rows", axis=0)]
    shared += [node("Reshape", [p + f"{row}_row", p + "shape"], p + row) for row in ("mean", "inv")]
    rewritten: dict[str, list[Any]] = {}  # by name: what `channels` names
    for norm, count in zip(norms, counts, strict=True):
        x, scale, bias = norm.input
        q = norm.name + "/fixed/"
        shared += [node("Reshape", [t, f"{p}affine_shape_{count}"], q + role) for t, role in ((scale, "scale"), (bias, "bias"))]
        rewritten[norm.name] = [
            node("Mul", [x, q + "gain"], q + "scaled"),
            node("Add", [q + "scaled", q + "shift"], norm.output[0]),
        ]
    shared += [
        node("Concat", [n.name + "/fixed/scale" for n in norms], p + "scale", axis=1),
        node("Concat", [n.name + "/fixed/bias" for n in norms], p + "bias", axis=1),
        node("Mul", [p + "inv", p + "scale"], p + "gain"),
        node("Mul", [p + "mean", p + "gain"], p + "mean_gain"),
        node("Sub", [p + "bias", p + "mean_gain"], p + "shift"),
    ]
    for role in ("gain", "shift"):
        outputs = [n.name + f"/fixed/{role}" for n in norms]
        shared.append(helper.make_node("Split", [p + role, p + "counts"], outputs, name=p + role + "s", axis=1))
    nodes = []
    for old in graph.node:
        fed = old.op_type == "InstanceNormalization" and old.name in rewritten
        nodes += rewritten[old.name] if fed else [old]
    del graph.node[:]
    graph.node.extend(shared + nodes)
    sort_topologically(graph)
    graph.input.append(helper.make_tensor_value_info(STATS_INPUT, TensorProto.FLOAT, [2, total]))


def norm_channels(model: Any, norms: tuple[str, ...]) -> dict[str, int]:
    """Channels of each named norm, read from its scale's producer shape by a shape-inferred copy."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(_without_weights(model))
    known = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    by_name = {node.name: node for node in model.graph.node}
    inits = {i.name: i for i in model.graph.initializer}
    channels = {}
    for name in norms:
        scale = by_name[name].input[1]
        if scale in inits:
            channels[name] = int(inits[scale].dims[-1])
            continue
        dims = known[scale].type.tensor_type.shape.dim
        if not dims or not dims[-1].dim_value:
            raise KeyError(f"the channel count of {name}")
        channels[name] = int(dims[-1].dim_value)
    return channels


def _without_weights(model: Any) -> Any:
    """The graph with its large initializers turned into typed inputs: what shape inference needs, without
    copying the weights (a whole copy was the peak of loading a windowed server)."""
    from onnx import helper

    inputs = {i.name for i in model.graph.input}
    small = [i for i in model.graph.initializer if np.prod(i.dims) <= 64]
    weights = [
        helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
        for i in model.graph.initializer
        if np.prod(i.dims) > 64 and i.name not in inputs
    ]
    graph = helper.make_graph(
        model.graph.node, model.graph.name, [*model.graph.input, *weights], model.graph.output, initializer=small
    )
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)


def moments_model(model: Any, norms: tuple[str, ...] | None = None) -> tuple[Any, list[str]]:
    """The whole model plus, per norm (the generator's by default), the per-channel mean and (centred)
    variance of its input."""
    import onnx
    from onnx import helper, numpy_helper

    norms = anchors(model).norms if norms is None else norms
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = copy.graph
    by_name = {node.name: node for node in g.node}
    opset = max((o.version for o in copy.opset_import if o.domain in ("", "ai.onnx")), default=13)

    def reduce_mean(x: str, out: str, keepdims: int) -> Any:  # axes became an input in opset 18
        if opset >= 18:
            return helper.make_node("ReduceMean", [x, "/moments/axes"], [out], name=out, keepdims=keepdims)
        return helper.make_node("ReduceMean", [x], [out], name=out, keepdims=keepdims, axes=[0, 2])

    g.initializer.append(numpy_helper.from_array(np.array([0, 2], dtype=np.int64), "/moments/axes"))
    outputs = []
    for name in norms:
        x = by_name[name].input[0]
        p = name + "/moments/"
        g.node.extend(
            [
                reduce_mean(x, p + "mean_kept", 1),
                helper.make_node("Sub", [x, p + "mean_kept"], [p + "centred"], name=p + "centred"),
                helper.make_node("Mul", [p + "centred", p + "centred"], [p + "square"], name=p + "square"),
                reduce_mean(x, p + "mean", 0),
                reduce_mean(p + "square", p + "var", 0),
            ]
        )
        outputs += [p + "mean", p + "var"]
    for out in outputs:
        g.output.append(helper.make_empty_tensor_value_info(out))
    return copy, outputs
