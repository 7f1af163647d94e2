"""smooth stage: SmoothQuant for the generator's AdaIN -> Snake -> Conv chains, before quantization.

A Conv input quantized per tensor loses the channels whose range is small next to the loudest
channel's. SmoothQuant (Xiao et al., 2023) divides each input channel by a factor s_c and multiplies
the matching weight column by it, so activation ranges even out while the product is unchanged:
s_c = max|u_c|^m / max|W[:, c]|^(1-m), with the migration strength m from the recipe.

In Kokoro the division costs no pass over the activations. The Snake input comes from AdaIN:

    xt = (1 + gamma) * InstanceNorm(x) + beta
    u  = xt + sin(alpha * xt)^2 / alpha        -> Conv(W, u)

and with gain' = (1 + gamma) / s, beta' = beta / s, alpha' = alpha * s and W' = W * s (per input
channel), the chain computes exactly u / s, and Conv(W', u / s) = Conv(W, u). gamma and beta are
per-channel vectors, so only [1, C, 1] tensors gain a Mul. The ranges come from running the fp32
model on calibration sentences.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.onnx_graph import PatternIndex, replace_nodes
from kokoro_opt.passes.common import intermediate_values, stage_record
from kokoro_opt.passes.snake import snake_at
from kokoro_opt.recipe import SmoothStage


def _chain_at(g: PatternIndex, sin: Any) -> dict[str, Any] | None:
    snake = snake_at(g, sin)
    if snake is None:
        return None
    scale_mul, snake_add, xt = snake["scale_mul"], snake["add"], snake["xt"]
    conv = g.sole(snake_add.output[0], "Conv")
    if conv is None or conv.input[0] != snake_add.output[0] or conv.input[1] not in g.const:
        return None
    if any(a.name == "group" and a.i != 1 for a in conv.attribute):
        return None
    if not g.read_only_by(xt, scale_mul, snake_add):
        return None
    beta_add = g.producer.get(xt)
    gain_mul = g.made_by(beta_add.input, "Mul") if beta_add is not None and beta_add.op_type == "Add" else None
    if gain_mul is None or g.sole(gain_mul.output[0], "Add") is not beta_add:
        return None
    norm = g.made_by(gain_mul.input, "InstanceNormalization")
    if norm is None or g.sole(norm.output[0], "Mul") is not gain_mul:
        return None
    return {
        "gain_mul": gain_mul, "gain": next(i for i in gain_mul.input if i != norm.output[0]),
        "beta_add": beta_add, "beta": next(i for i in beta_add.input if i != gain_mul.output[0]),
        "scale_mul": scale_mul, "alpha": snake["alpha"], "inv_mul": snake["inv_mul"],
        "inv_alpha": snake["inv_alpha"], "u": snake_add.output[0], "conv": conv,
    }  # fmt: skip


def match_chains(model: Any) -> list[dict[str, Any]]:
    """Every AdaIN -> Snake -> Conv chain whose links are used nowhere else. alpha and 1/alpha must be
    initializers, as ONNX Runtime's constant folding leaves them: run after `simplify`."""
    return _chains(PatternIndex(model))


def _chains(g: PatternIndex) -> list[dict[str, Any]]:
    return [c for c in (_chain_at(g, n) for n in g.graph.node if n.op_type == "Sin") if c is not None]


def channel_peaks(model: Any, tensors: list[str], feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """max |t[0, c, :]| over the feeds for each named [1, C, T] tensor of the fp32 model."""
    peaks: dict[str, np.ndarray] = {}
    for values in intermediate_values(model, tensors, feeds):
        for name, value in values.items():
            peak = np.abs(value).max(axis=(0, 2))
            peaks[name] = np.maximum(peaks[name], peak) if name in peaks else peak
    return peaks


def smooth_model(model: Any, peaks: dict[str, np.ndarray], migration: float) -> int:
    """Apply the per-channel factors in place (see the module docstring); returns chains rewritten."""
    from onnx import helper, numpy_helper

    g = PatternIndex(model)
    replaced: dict[str, list[Any]] = {}  # a consumer's output -> [its [1, C, 1] vector Mul, itself]
    chains = [c for c in _chains(g) if c["u"] in peaks]
    for c in chains:
        conv = c["conv"]
        weight = g.const[conv.input[1]].astype(np.float64)
        act = np.maximum(peaks[c["u"]].astype(np.float64), 1e-5)
        wmax = np.maximum(np.abs(weight).max(axis=(0, 2)), 1e-5)
        s = act**migration / wmax ** (1 - migration)
        s = np.clip(s / np.exp(np.mean(np.log(s))), 1e-2, 1e2).reshape(1, -1, 1)  # geometric mean 1
        prefix = conv.name.rsplit("/", 1)[0] + "/smooth"
        new = {
            "inv_s": 1.0 / s, "alpha": g.const[c["alpha"]] * s, "inv_alpha": g.const[c["inv_alpha"]] / s, "weight": weight * s,
        }  # fmt: skip
        model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), f"{prefix}/{k}") for k, v in new.items())
        for key, consumer in (("gain", c["gain_mul"]), ("beta", c["beta_add"])):  # [1, C, 1] vectors: cheap
            vector = helper.make_node("Mul", [c[key], f"{prefix}/inv_s"], [f"{prefix}/{key}"], name=f"{prefix}/{key}")
            replaced[consumer.output[0]] = [vector, consumer]
            _swap_input(consumer, c[key], f"{prefix}/{key}")
        _swap_input(c["scale_mul"], c["alpha"], f"{prefix}/alpha")
        _swap_input(c["inv_mul"], c["inv_alpha"], f"{prefix}/inv_alpha")
        _swap_input(conv, conv.input[1], f"{prefix}/weight")
    replace_nodes(model, replaced)
    return len(chains)


def _swap_input(node: Any, old: str, new: str) -> None:
    for i, name in enumerate(node.input):
        if name == old:
            node.input[i] = new


def run_smooth(source: Artifact, cfg: SmoothStage, out: Path) -> dict[str, Any]:
    import onnx

    from kokoro_opt.passes.qdq import calibration_feeds

    started = time.perf_counter()
    model = onnx.load(str(source.model_file))
    tensors = [c["u"] for c in match_chains(model)]
    if not tensors:
        raise UserError(
            "smooth found no AdaIN -> Snake -> Conv chain to rescale",
            "put a `simplify` stage before it (Snake's 1/alpha must be folded into a constant) and run it before quantize",
        )
    peaks = channel_peaks(model, tensors, calibration_feeds(source, cfg.calibration_sentences))
    rewritten = smooth_model(model, peaks, cfg.migration)
    onnx.checker.check_model(model)
    onnx.save(model, str(out / "model.onnx"))
    return stage_record("smooth", cfg, out, started, chains=rewritten)


PASS = Pass(
    "smooth",
    SmoothStage,
    run_smooth,
    reads=("calibration/sentences.txt",),
    libraries=("onnx", "onnxruntime", "phonemizer-fork", "espeakng-loader"),
)
