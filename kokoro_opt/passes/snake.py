"""snake stage: the generator's AdaIN -> Snake chains in fewer, cheaper passes of stock ONNX ops.

After INT8, Kokoro's convolutions are no longer where the time goes: the elementwise work around
them is. Each of the generator's 48 Snake activations, exported as

    u = xt + sin(alpha * xt)^2 / alpha        (Mul -> Sin -> Pow -> Mul -> Add)

spends most of its time in ONNX Runtime's `Sin`, which runs scalar on one thread (measured: 8.8 ms
for 4.6 M floats, a `Mul` 0.5 ms). Three rewrites, all in standard ONNX ops:

* **Snake as a polynomial.** sin^2 has period pi, so with y = alpha * xt / pi and r = y - round(y)
  in [-1/2, 1/2], sin^2(alpha * xt) = sin^2(pi * r) = p(r^2), an even polynomial fitted once on
  [0, 1/4] (degree n in r^2, 2n in r). The chain becomes Add, Sub, Sub, Mul (round(y) as
  (y + 1.5 * 2^23) - 1.5 * 2^23) and a Horner scheme of Mul/Add: 2n + 5 threaded vector passes
  instead of 5 ops of which `Sin` alone cost more than all of them. The fit's worst relative
  error (`sin2_coefficients`) is recorded: 6e-2 of the Snake's own term at degree 2, 3e-3 at 3,
  8e-5 at 4.
* **alpha / pi absorbed upstream.** Where xt is made by an InstanceNormalization (scale and bias)
  or an AdaIN ([1, C, 1] gain and shift), that node makes y directly, and the Snake ends in one
  per-channel Mul by pi / |alpha|. After `quantize`, `fold_scale_into_quantize` moves that Mul into
  the QuantizeLinear an INT8 Conv reads, so the chain is one pass shorter where it matters. Where
  xt comes from elsewhere, 1/alpha goes into p's coefficients per channel instead.
* **AdaIN into InstanceNormalization (exact).** AdaIN computes (1 + gamma) * InstanceNorm(x) + beta
  with style-dependent [1, C, 1] vectors, two passes over the activations. InstanceNormalization
  takes its per-channel scale and bias as inputs, so the vectors go there (reshaped to [C]; the
  export has batch 1; shape inference must show [1, C, 1]) and both passes disappear, from every
  AdaIN of the decoder and predictor.

Run it after `smooth` (which needs the exported Snake) and before `quantize`, so calibration and
the sensitivity analysis score the graph that ships.
"""

from __future__ import annotations

import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.onnx_graph import PatternIndex, replace_nodes
from kokoro_opt.passes.common import stage_record
from kokoro_opt.recipe import SnakeStage


def snake_at(g: PatternIndex, sin: Any) -> dict[str, Any] | None:
    """The Snake around one `Sin` node, if the export's pattern holds and its links are used nowhere else."""
    scale_mul = g.producer.get(sin.input[0])
    power = g.sole(sin.output[0], "Pow")
    if scale_mul is None or scale_mul.op_type != "Mul" or power is None or g.sole(scale_mul.output[0], "Sin") is not sin:
        return None
    split, inv_mul = g.const_operand(scale_mul), g.sole(power.output[0], "Mul")
    exponent = g.const.get(power.input[1])
    if split is None or inv_mul is None or g.const_operand(inv_mul) is None or exponent is None or exponent.size != 1:
        return None
    alpha, xt = split
    add = g.sole(inv_mul.output[0], "Add")
    if add is None or xt not in add.input or float(exponent.ravel()[0]) != 2.0 or g.const[alpha].ndim != 3:
        return None
    inv_alpha = g.const_operand(inv_mul)[0]  # type: ignore[index]
    return {
        "scale_mul": scale_mul, "sin": sin, "power": power, "inv_mul": inv_mul, "add": add,
        "alpha": alpha, "inv_alpha": inv_alpha, "xt": xt,
    }  # fmt: skip


@cache
def sin2_coefficients(degree: int) -> tuple[np.ndarray, float]:
    """c_1..c_degree with sin^2(pi * r) ~= sum_k c_k * (r^2)^k for |r| <= 1/2, and the worst relative error.

    The fit is relative (q(t) = p(t) / t against sin^2(pi * sqrt(t)) / t, least squares on Chebyshev
    nodes of t = r^2 in [0, 1/4]) because 1/alpha reaches 1e4 in Kokoro: an absolute error would be
    multiplied by it, a relative one stays a fraction of the Snake's own term.
    """
    nodes = 0.125 * (1 - np.cos(np.pi * (np.arange(256) + 0.5) / 256))
    powers = np.stack([nodes**k for k in range(degree)], axis=1)
    coefficients, *_ = np.linalg.lstsq(powers, np.sin(np.pi * np.sqrt(nodes)) ** 2 / nodes, rcond=None)
    dense = np.linspace(1e-9, 0.25, 100_001)
    exact = np.sin(np.pi * np.sqrt(dense)) ** 2
    fitted = np.stack([dense ** (k + 1) for k in range(degree)], axis=1) @ coefficients
    coefficients.setflags(write=False)  # cached: shared by every caller
    return coefficients, float(np.abs(fitted / exact - 1).max())


def _node(op: str, inputs: list[str], output: str) -> Any:
    from onnx import helper

    return helper.make_node(op, inputs, [output], name=output)


ROUND_MAGIC = 1.5 * 2.0**23  # y + this lands where float32's spacing is 1: rounds y to nearest even for |y| < 2^22
CHANNEL_SCALE = "/pi_over_abs_alpha"  # the Snake's last factor, which fold_scale_into_quantize moves


def _reduce(p: str, y: str) -> list[Any]:
    """r = y - round(y), t = r * r. Round as (y + M) - M: ORT's `Round` is a scalar loop whose speed
    depends on the data (measured 1.0-3.4 ms for 4.2 M floats), two threaded vector passes take 0.9 ms."""
    return [
        _node("Add", [y, f"{p}/round_magic"], f"{p}/y_shifted"),
        _node("Sub", [f"{p}/y_shifted", f"{p}/round_magic"], f"{p}/k"),
        _node("Sub", [y, f"{p}/k"], f"{p}/r"),
        _node("Mul", [f"{p}/r", f"{p}/r"], f"{p}/t"),
    ]


def _horner(p: str, degree: int, t: str) -> list[Any]:
    """Nodes for (((c_d t + c_{d-1}) t + ...) + c_1) t into f"{p}/sin2", reading constants f"{p}/c{k}"."""
    nodes, acc = [], f"{p}/c{degree}"
    for k in range(degree - 1, 0, -1):
        nodes += [_node("Mul", [acc, t], f"{p}/m{k}"), _node("Add", [f"{p}/m{k}", f"{p}/c{k}"], f"{p}/h{k}")]
        acc = f"{p}/h{k}"
    return [*nodes, _node("Mul", [acc, t], f"{p}/sin2")]


def _polynomial_nodes(g: PatternIndex, snake: dict[str, Any], degree: int) -> tuple[list[Any], dict[str, np.ndarray]]:
    """Nodes and initializers computing the Snake's output tensor with the polynomial (1/alpha in its coefficients)."""
    from onnx import helper

    coefficients, _ = sin2_coefficients(degree)
    p = _scope(snake)
    consts = {f"{p}/alpha_over_pi": g.const[snake["alpha"]] / np.pi, f"{p}/round_magic": np.asarray(ROUND_MAGIC)}
    consts |= {f"{p}/c{k + 1}": coefficients[k] * g.const[snake["inv_alpha"]] for k in range(degree)}
    nodes = [
        _node("Mul", [snake["xt"], f"{p}/alpha_over_pi"], f"{p}/y"),
        *_reduce(p, f"{p}/y"),
        *_horner(p, degree, f"{p}/t"),
        helper.make_node("Add", [snake["xt"], f"{p}/sin2"], list(snake["add"].output), name=snake["add"].name),
    ]
    return nodes, consts


def _scope(snake: dict[str, Any]) -> str:
    return (snake["sin"].name or snake["sin"].output[0]) + "/poly"  # in the Sin's scope: profiles charge its block


def _absorbing_producer(g: PatternIndex, snake: dict[str, Any], shapes: dict[str, list[int | None]]) -> dict[str, Any] | None:
    """How the Snake's input xt is made, if that can take a per-channel factor for free: by an
    InstanceNormalization (through its scale and bias), or by an AdaIN's gain Mul and shift Add of
    [1, C, 1] vectors (where one InstanceNormalization is shared). None if xt is read outside the Snake."""
    xt, producer = snake["xt"], g.producer.get(snake["xt"])
    if producer is None or not g.read_only_by(xt, snake["scale_mul"], snake["add"]):
        return None
    if any(out.name == xt for out in g.graph.output):
        return None
    if producer.op_type == "InstanceNormalization":
        return {"nodes": [producer], "norm": producer}
    gain_mul = g.made_by(producer.input, "Mul") if producer.op_type == "Add" else None
    if gain_mul is None or g.sole(gain_mul.output[0], "Add") is not producer:
        return None
    vector = [1, g.const[snake["alpha"]].size, 1]
    shifts = [i for i in producer.input if i != gain_mul.output[0] and shapes.get(i) == vector]
    gains = [i for i in gain_mul.input if shapes.get(i) == vector]
    if len(shifts) != 1 or len(gains) != 1 or len(set(gain_mul.input)) != 2:
        return None
    signal = next(i for i in gain_mul.input if i != gains[0])
    return {"nodes": [gain_mul, producer], "signal": signal, "gain": gains[0], "shift": shifts[0]}


def _absorbed_nodes(
    g: PatternIndex, snake: dict[str, Any], producer: dict[str, Any], degree: int
) -> tuple[list[Any], dict[str, np.ndarray]]:
    """The Snake with y = |alpha| * xt / pi made by its producer, ending in one per-channel Mul:

        u = xt + sin^2(pi r) / alpha = (pi / |alpha|) * (y + sign(alpha) * p(t) / pi)

    so the chain loses its first Mul, and `fold_scale_into_quantize` can later move the last one
    into the QuantizeLinear that an INT8 Conv reads (sin^2 is even, hence |alpha|)."""
    from onnx import helper

    coefficients, _ = sin2_coefficients(degree)
    alpha = g.const[snake["alpha"]]
    p, k = _scope(snake), np.abs(alpha) / np.pi
    sign = np.sign(alpha) if np.any(alpha < 0) else np.ones(())  # a scalar broadcasts faster
    consts = {f"{p}/abs_alpha_over_pi": k, f"{p}{CHANNEL_SCALE}": 1 / k, f"{p}/round_magic": np.asarray(ROUND_MAGIC)}
    consts |= {f"{p}/c{i + 1}": coefficients[i] / np.pi * sign for i in range(degree)}
    if "norm" in producer:  # scale and bias are [C]
        norm = producer["norm"]
        consts[f"{p}/flat_abs_alpha_over_pi"] = k.reshape(-1)
        flat = f"{p}/flat_abs_alpha_over_pi"
        scaled = [_node("Mul", [norm.input[i], flat], f"{p}/norm_{what}") for i, what in ((1, "scale"), (2, "bias"))]
        inputs = [norm.input[0], f"{p}/norm_scale", f"{p}/norm_bias"]
        made = helper.make_node(norm.op_type, inputs, [f"{p}/y"], name=norm.name, domain=norm.domain)
        made.attribute.extend(norm.attribute)
        make_y = [*scaled, made]
    else:
        make_y = [
            _node("Mul", [producer["gain"], f"{p}/abs_alpha_over_pi"], f"{p}/adain_gain"),
            _node("Mul", [producer["shift"], f"{p}/abs_alpha_over_pi"], f"{p}/adain_shift"),
            _node("Mul", [producer["signal"], f"{p}/adain_gain"], f"{p}/adain_scaled"),
            _node("Add", [f"{p}/adain_scaled", f"{p}/adain_shift"], f"{p}/y"),
        ]
    nodes = [
        *make_y,
        *_reduce(p, f"{p}/y"),
        *_horner(p, degree, f"{p}/t"),
        _node("Add", [f"{p}/y", f"{p}/sin2"], f"{p}/u"),
        helper.make_node("Mul", [f"{p}/u", f"{p}{CHANNEL_SCALE}"], list(snake["add"].output), name=snake["add"].name),
    ]
    return nodes, consts


def polynomial_snakes(model: Any, degree: int) -> tuple[int, int]:
    """Replace every Snake's Mul -> Sin -> Pow -> Mul -> Add by the polynomial, in place.

    Returns (Snakes replaced, how many of them had alpha/pi absorbed by the node making their input)."""
    from onnx import numpy_helper

    g = PatternIndex(model)
    snakes = [s for s in (snake_at(g, n) for n in g.graph.node if n.op_type == "Sin") if s is not None]
    shapes = _inferred_shapes(model) if snakes else {}
    replaced: dict[str, list[Any]] = {}
    absorbed = 0
    for snake in snakes:
        producer = _absorbing_producer(g, snake, shapes) if np.all(g.const[snake["alpha"]] != 0) else None
        if producer is None:
            nodes, consts = _polynomial_nodes(g, snake, degree)
        else:
            nodes, consts = _absorbed_nodes(g, snake, producer, degree)
            replaced.update({n.output[0]: [] for n in producer["nodes"]})
            absorbed += 1
        model.graph.initializer.extend(numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in consts.items())
        replaced.update({snake[k].output[0]: [] for k in ("scale_mul", "sin", "power", "inv_mul")})
        replaced[snake["add"].output[0]] = nodes
    replace_nodes(model, replaced)
    return len(snakes), absorbed


def fold_scale_into_quantize(model: Any) -> int:
    """A Snake's last u * (pi / |alpha|) -> QuantizeLinear(s, z) becomes QuantizeLinear(u, s |alpha| / pi, z)
    per channel (axis 1), in place, where the product is read only there: the same uint8 codes
    without the Mul pass. The scale only changes how the codes are made; the DequantizeLinear that
    reads them, and so the Conv that ONNX Runtime fuses into `QLinearConv`, keep their single scale.
    Only the Snake's own factor qualifies: a [1, C, 1] vector means channels on axis 1 only for its
    [1, C, T] activations. Returns how many."""
    from onnx import helper, numpy_helper

    g = PatternIndex(model)
    replaced: dict[str, list[Any]] = {}
    for quant in [n for n in g.graph.node if n.op_type == "QuantizeLinear" and len(n.input) == 3]:
        mul, scale, zero = g.producer.get(quant.input[0]), g.const.get(quant.input[1]), g.const.get(quant.input[2])
        split = g.const_operand(mul) if mul is not None and mul.op_type == "Mul" else None
        if split is None or not split[0].endswith(CHANNEL_SCALE) or scale is None or zero is None:
            continue
        if scale.size != 1 or zero.size != 1:  # already per channel
            continue
        factor = g.const[split[0]]
        if factor.ndim != 3 or factor.shape[0] != 1 or factor.shape[2] != 1 or np.any(factor <= 0):
            continue
        if g.sole(mul.output[0], "QuantizeLinear") is not quant:
            continue
        where = quant.name or quant.output[0]
        model.graph.initializer.extend([
            numpy_helper.from_array((scale.reshape(()) / factor.reshape(-1)).astype(scale.dtype), f"{where}/channel_scale"),
            numpy_helper.from_array(np.full(factor.size, zero.reshape(()), dtype=zero.dtype), f"{where}/channel_zero_point"),
        ])  # fmt: skip
        folded = helper.make_node(
            "QuantizeLinear", [split[1], f"{where}/channel_scale", f"{where}/channel_zero_point"], list(quant.output),
            name=quant.name, domain=quant.domain, axis=1,
        )  # fmt: skip
        replaced.update({mul.output[0]: [], quant.output[0]: [folded]})
    replace_nodes(model, replaced)
    return len(replaced) // 2


def _inferred_shapes(model: Any) -> dict[str, list[int | None]]:
    """Static shapes ONNX shape inference finds for the top-level tensors (None for an unknown dim)."""
    from onnx import shape_inference

    graph = shape_inference.infer_shapes(model).graph
    return {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in [*graph.input, *graph.value_info]
    }


def _adain_at(g: PatternIndex, norm: Any, shapes: dict[str, list[int | None]]) -> tuple[Any, Any, str, str] | None:
    """(gain Mul, shift Add, gain, shift) after an InstanceNormalization with constant scale 1 and bias 0,
    when gain and shift are per-channel vectors [1, C, 1]: anything else (a mask, a residual) must
    stay a Mul/Add, since InstanceNormalization's scale and bias hold one value per channel."""
    scale, bias = (g.const.get(name) for name in norm.input[1:3])
    if scale is None or bias is None or np.any(scale != 1) or np.any(bias != 0):
        return None
    gain_mul = g.sole(norm.output[0], "Mul")
    shift_add = g.sole(gain_mul.output[0], "Add") if gain_mul is not None else None
    if shift_add is None:
        return None
    gain = next(i for i in gain_mul.input if i != norm.output[0])
    shift = next(i for i in shift_add.input if i != gain_mul.output[0])
    if gain in g.const or shift in g.const:
        return None  # a constant affine is not AdaIN; left as it is
    channels = (shapes.get(norm.input[0]) or [None, None])[1]
    vector = [1, scale.size, 1]
    if shapes.get(gain) != vector or shapes.get(shift) != vector or channels not in (None, scale.size):
        return None
    return gain_mul, shift_add, gain, shift


def fold_adain(model: Any) -> int:
    """Move every AdaIN's (1 + gamma) and beta into its InstanceNormalization's scale and bias, in place."""
    from onnx import helper, numpy_helper

    g, shapes = PatternIndex(model), _inferred_shapes(model)
    flat = "kokoro_opt/adain/flat_shape"
    if flat not in g.const:
        model.graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), flat))
    replaced: dict[str, list[Any]] = {}
    for norm in [n for n in g.graph.node if n.op_type == "InstanceNormalization"]:
        found = _adain_at(g, norm, shapes)
        if found is None:
            continue
        gain_mul, shift_add, gain, shift = found
        where = norm.name or norm.output[0]
        scale, bias = f"{where}/adain_scale", f"{where}/adain_bias"
        fused = helper.make_node(
            "InstanceNormalization", [norm.input[0], scale, bias], list(shift_add.output), name=norm.name, domain=norm.domain
        )
        fused.attribute.extend(norm.attribute)
        replaced.update({norm.output[0]: [], gain_mul.output[0]: []})
        replaced[shift_add.output[0]] = [  # where gain and shift are surely computed
            helper.make_node("Reshape", [gain, flat], [scale], name=scale),
            helper.make_node("Reshape", [shift, flat], [bias], name=bias),
            fused,
        ]
    replace_nodes(model, replaced)
    return sum(1 for nodes in replaced.values() if nodes)


def run_snake(source: Artifact, cfg: SnakeStage, out: Path) -> dict[str, Any]:
    import onnx

    started = time.perf_counter()
    model = onnx.load(str(source.model_file))
    facts: dict[str, Any] = {}
    if cfg.fold_adain:  # first, so the folded InstanceNormalization can take alpha / pi as well
        facts["adain_folded"] = fold_adain(model)
    if cfg.polynomial_degree is not None:
        facts["snakes"], facts["alpha_absorbed"] = polynomial_snakes(model, cfg.polynomial_degree)
        facts["max_sin2_relative_error"] = sin2_coefficients(cfg.polynomial_degree)[1]
        if not facts["snakes"]:
            raise UserError(
                "snake found no Snake (Mul -> Sin -> Pow -> Mul -> Add) to rewrite",
                "put it after `simplify` (and after `smooth` if the recipe has one) and before `quantize`, "
                "or set polynomial_degree: null",
            )
    onnx.save(model, str(out / "model.onnx"))
    return stage_record("snake", cfg, out, started, **facts)


PASS = Pass("snake", SnakeStage, run_snake, libraries=("onnx",))
