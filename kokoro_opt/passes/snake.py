"""snake stage: the generator's AdaIN -> Snake chains in fewer, cheaper passes of stock ONNX ops.

After INT8, Kokoro's convolutions are no longer where the time goes: the elementwise work around
them is. Each of the generator's 48 Snake activations, exported as

    u = xt + sin(alpha * xt)^2 / alpha        (Mul -> Sin -> Pow -> Mul -> Add)

spends most of its time in ONNX Runtime's `Sin`, which runs scalar on one thread (measured: 8.8 ms
for 4.6 M floats, a `Mul` 0.5 ms). Two rewrites, both in standard ONNX ops:

* **Snake as a polynomial.** sin^2 has period pi, so with y = alpha * xt / pi and r = y - round(y)
  in [-1/2, 1/2], sin^2(alpha * xt) = sin^2(pi * r) = p(r^2), an even polynomial fitted once on
  [0, 1/4] (degree n in r^2, 2n in r). The 1/alpha is folded into p's coefficients (per channel),
  so the chain becomes Mul, Round, Sub, Mul and a Horner scheme of Mul/Add: 2n + 4 ops instead of
  5, all but one far cheaper than `Sin`. The fit's worst relative error (`sin2_coefficients`) is
  recorded: 3e-3 of the Snake's own term at degree 3, 8e-5 at degree 4, far below the INT8 step
  of the Conv input it feeds.
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
from kokoro_opt.errors import UserError
from kokoro_opt.onnx_graph import PatternIndex, replace_nodes
from kokoro_opt.passes.common import copy_runtime, stage_record
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


def _polynomial_nodes(g: PatternIndex, snake: dict[str, Any], degree: int) -> tuple[list[Any], dict[str, np.ndarray]]:
    """Nodes and initializers computing the Snake's output tensor with the polynomial."""
    from onnx import helper

    coefficients, _ = sin2_coefficients(degree)
    p = (snake["sin"].name or snake["sin"].output[0]) + "/poly"  # in the Sin's scope: profiles charge its block
    consts = {f"{p}/alpha_over_pi": g.const[snake["alpha"]] / np.pi}
    consts |= {f"{p}/c{k + 1}": coefficients[k] * g.const[snake["inv_alpha"]] for k in range(degree)}

    def node(op: str, inputs: list[str], output: str) -> Any:
        return helper.make_node(op, inputs, [output], name=output)

    nodes = [
        node("Mul", [snake["xt"], f"{p}/alpha_over_pi"], f"{p}/y"),
        node("Round", [f"{p}/y"], f"{p}/k"),
        node("Sub", [f"{p}/y", f"{p}/k"], f"{p}/r"),
        node("Mul", [f"{p}/r", f"{p}/r"], f"{p}/t"),
    ]
    acc = f"{p}/c{degree}"
    for k in range(degree - 1, 0, -1):  # Horner: (((c_d t + c_{d-1}) t + ...) + c_1) t
        nodes += [node("Mul", [acc, f"{p}/t"], f"{p}/m{k}"), node("Add", [f"{p}/m{k}", f"{p}/c{k}"], f"{p}/h{k}")]
        acc = f"{p}/h{k}"
    nodes += [node("Mul", [acc, f"{p}/t"], f"{p}/sin2_over_alpha")]
    nodes += [helper.make_node("Add", [snake["xt"], f"{p}/sin2_over_alpha"], list(snake["add"].output), name=snake["add"].name)]
    return nodes, consts


def polynomial_snakes(model: Any, degree: int) -> int:
    """Replace every Snake's Mul -> Sin -> Pow -> Mul -> Add by the polynomial, in place; returns how many."""
    from onnx import numpy_helper

    g = PatternIndex(model)
    snakes = [s for s in (snake_at(g, n) for n in g.graph.node if n.op_type == "Sin") if s is not None]
    replaced: dict[str, list[Any]] = {}
    for snake in snakes:
        nodes, consts = _polynomial_nodes(g, snake, degree)
        model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), k) for k, v in consts.items())
        replaced.update({snake[k].output[0]: [] for k in ("scale_mul", "sin", "power", "inv_mul")})
        replaced[snake["add"].output[0]] = nodes
    replace_nodes(model, replaced)
    return len(snakes)


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
    copy_runtime(source, out)
    model = onnx.load(str(source.model_file))
    facts: dict[str, Any] = {}
    if cfg.polynomial_degree is not None:
        facts["snakes"] = polynomial_snakes(model, cfg.polynomial_degree)
        facts["max_sin2_relative_error"] = sin2_coefficients(cfg.polynomial_degree)[1]
        if not facts["snakes"]:
            raise UserError(
                "snake found no Snake (Mul -> Sin -> Pow -> Mul -> Add) to rewrite",
                "put it after `simplify` (and after `smooth` if the recipe has one) and before `quantize`, "
                "or set polynomial_degree: null",
            )
    if cfg.fold_adain:
        facts["adain_folded"] = fold_adain(model)
    onnx.save(model, str(out / "model.onnx"))
    return stage_record("snake", cfg, out, started, **facts)
