"""coreml stage: Core ML MLProgram for Apple Silicon, converted from PyTorch with coremltools.

Kokoro does not convert whole: the duration expansion is data-dependent and the ALBERT/LSTM front
gains nothing on the Neural Engine (LSTMs do not run there). So the artifact is split:
- `front.onnx` (ONNX Runtime on the host): tokens + style + speed -> aligned features
  (asr, F0, N) and durations;
- `model.mlpackage` (Core ML): the iSTFTNet decoder, features -> audio, with a flexible frame axis
  (RangeDim). That is where ~90% of the compute is.
Known traps handled: SineGen's `% 1` is replaced by `x - floor(x)` (Core ML's mod corrupted it in
another port), and the iSTFT is the conv-based CustomSTFT. Precision is FP16 with phase-sensitive
ops kept FP32. On Linux the stage converts, validates the spec and records op counts and precision;
prediction needs macOS (see `kokoro_opt.runtime.coreml`).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.model import deterministic_noise, style_for
from kokoro_opt.recipe import CoreMLStage
from kokoro_opt.runtime.feeds import feed_arrays, model_feeds
from kokoro_opt.weights.sources import exported_kmodel

# Ops whose FP16 rounding wrecks phase or level: kept in FP32.
FP32_OPS = {"sin", "cos", "cumsum", "exp", "floor", "sub", "mul", "real_div", "upsample_linear", "resize"}


class KokoroFront(torch.nn.Module):
    """KModel up to the decoder: what runs on the host beside Core ML."""

    def __init__(self, kmodel: torch.nn.Module) -> None:
        super().__init__()
        self.kmodel = kmodel

    def forward(self, input_ids: torch.Tensor, ref_s: torch.Tensor, speed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.kmodel
        n = input_ids.shape[-1]
        lengths = torch.full((1,), n, dtype=torch.long)
        text_mask = torch.zeros((1, n), dtype=torch.bool)
        bert_dur = m.bert(input_ids, attention_mask=(~text_mask).int())
        d_en = m.bert_encoder(bert_dur).transpose(-1, -2)
        s = ref_s[:, 128:]
        d = m.predictor.text_encoder(d_en, s, lengths, text_mask)
        x, _ = m.predictor.lstm(d)
        duration = torch.sigmoid(m.predictor.duration_proj(x)).sum(axis=-1) / speed
        pred_dur = torch.round(duration).clamp(min=1).long().squeeze()
        indices = torch.repeat_interleave(torch.arange(n), pred_dur)
        aln = torch.zeros((n, indices.shape[0]))
        aln[indices, torch.arange(indices.shape[0])] = 1
        aln = aln.unsqueeze(0)
        f0, noise = m.predictor.F0Ntrain(d.transpose(-1, -2) @ aln, s)
        asr = m.text_encoder(input_ids, lengths, text_mask) @ aln
        return asr, f0, noise, pred_dur


class KokoroDecoder(torch.nn.Module):
    def __init__(self, kmodel: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = kmodel.decoder

    def forward(self, asr: torch.Tensor, f0: torch.Tensor, noise: torch.Tensor, ref_s: torch.Tensor) -> torch.Tensor:
        return self.decoder(asr, f0, noise, ref_s[:, :128]).squeeze(1)


@contextlib.contextmanager
def coreml_safe_sinegen() -> Iterator[None]:
    """SineGen with `x - floor(x)` instead of `% 1` (same values; Core ML's mod mishandles it)."""
    import torch.nn.functional as F
    from kokoro.istftnet import SineGen

    original = SineGen._f02sine

    def f02sine(self: Any, f0_values: torch.Tensor) -> torch.Tensor:
        cycles = f0_values / self.sampling_rate
        rad_values = (cycles - torch.floor(cycles)).transpose(1, 2)
        # Linear downsampling by 1/k (align_corners=False) samples position k*i + (k-1)/2: the mean of
        # two neighbours. Written out because Core ML rejects a fractional scale factor.
        k = int(self.upsample_scale)
        rad_values = ((rad_values[..., k // 2 - 1 :: k] + rad_values[..., k // 2 :: k]) / 2).transpose(1, 2)
        phase = torch.cumsum(rad_values, dim=1) * 2 * torch.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear")
        return torch.sin(phase.transpose(1, 2))

    SineGen._f02sine = f02sine
    try:
        yield
    finally:
        SineGen._f02sine = original


_REGISTERED = False


def register_kokoro_ops() -> None:
    """AdainResBlk1d computes `torch.rsqrt(torch.tensor(2))`: an int tensor, which MIL's rsqrt rejects."""
    global _REGISTERED
    if _REGISTERED:
        return
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op
    from coremltools.converters.mil.mil import types

    @register_torch_op(override=True)
    def rsqrt(context: Any, node: Any) -> None:
        x = _get_inputs(context, node, expected=1)[0]
        if not types.is_float(x.dtype):
            x = mb.cast(x=x, dtype="fp32")
        context.add(mb.rsqrt(x=x, name=node.name))

    from coremltools.converters.mil.frontend.torch import ops

    # Newer torch traces spell some arithmetic by its long name.
    for long_name, short in (("multiply", ops.mul), ("divide", ops.div), ("subtract", ops.sub)):
        if long_name not in _registry():
            register_torch_op(_func=_renamed(short, long_name))
    _REGISTERED = True


def _registry() -> dict[str, Any]:
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    return _TORCH_OPS_REGISTRY.name_to_func_mapping


def _renamed(func: Any, name: str) -> Any:
    def alias(context: Any, node: Any) -> None:
        func(context, node)

    alias.__name__ = name
    return alias


def mil_op_counts(mlmodel: Any) -> tuple[dict[str, int], dict[str, int]]:
    """(op type -> count, dtype of op outputs -> count) from the MLProgram spec."""
    from coremltools.proto import MIL_pb2

    spec = mlmodel.get_spec()
    ops: Counter[str] = Counter()
    dtypes: Counter[str] = Counter()
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                ops[op.type] += 1
                for output in op.outputs:
                    dtypes[MIL_pb2.DataType.Name(output.type.tensorType.dataType)] += 1
    return dict(ops.most_common()), dict(dtypes)


def run_coreml(source: Artifact, cfg: CoreMLStage, out: Path) -> dict[str, Any]:
    try:
        import coremltools as ct
    except ImportError as exc:
        raise UserError("the coreml stage needs coremltools", "pip install 'kokoro-opt[coreml]'") from exc
    from kokoro_opt.export import quiet_native_stderr

    started = time.perf_counter()
    kmodel = exported_kmodel(source.kokoro["weights"])  # Core ML converts from torch, not ONNX

    packs = source.voice_packs()
    pack = packs[sorted(packs)[0]]
    tokens, style, speed = (torch.from_numpy(a) for a in feed_arrays(list(range(16, 16 + 48)), style_for(pack, 48), 1.0))
    with deterministic_noise(), torch.no_grad(), quiet_native_stderr():
        torch.onnx.export(
            KokoroFront(kmodel).eval(),
            (tokens, style, speed),
            str(out / "front.onnx"),
            input_names=["input_ids", "style", "speed"],
            output_names=["asr", "f0", "noise", "durations"],
            dynamic_axes={
                "input_ids": {1: "tokens"},
                "asr": {2: "frames"},
                "f0": {1: "frames2"},
                "noise": {1: "frames2"},
                "durations": {0: "tokens"},
            },
            opset_version=17,
            dynamo=False,
        )
        asr, f0, noise, _ = KokoroFront(kmodel).eval()(tokens, style, speed)
        frames = asr.shape[-1]
        with coreml_safe_sinegen():
            traced = torch.jit.trace(KokoroDecoder(kmodel).eval(), (asr, f0, noise, style))
    converted = time.perf_counter()

    register_kokoro_ops()
    max_frames = cfg.max_tokens * 8
    # the traced sentence's length is the default shape; a small max_tokens may not reach it
    frame_dim = ct.RangeDim(lower_bound=8, upper_bound=max_frames, default=min(frames, max_frames))
    frame2_dim = ct.RangeDim(lower_bound=16, upper_bound=2 * max_frames, default=2 * min(frames, max_frames))
    precision = (
        ct.transform.FP16ComputePrecision(op_selector=lambda op: op.op_type not in FP32_OPS)
        if cfg.precision == "fp16"
        else ct.precision.FLOAT32
    )
    mlmodel = ct.convert(
        traced,
        inputs=[
            ct.TensorType("asr", shape=(1, asr.shape[1], frame_dim)),
            ct.TensorType("f0", shape=(1, frame2_dim)),
            ct.TensorType("noise", shape=(1, frame2_dim)),
            ct.TensorType("style", shape=(1, 256)),
        ],
        outputs=[ct.TensorType("audio")],
        convert_to="mlprogram",
        compute_precision=precision,
        minimum_deployment_target=ct.target.macOS13,
    )
    zero_channels = 0
    if cfg.int8_weights:
        from coremltools.optimize.coreml import OpLinearQuantizerConfig, OptimizationConfig, linear_quantize_weights

        # The offline weights hold output channels that are all zero (per-tensor int8 rounded them away). Their
        # per-channel scale is 0 and coremltools divides by it (0/0, then a cast of NaN): numpy warns, and the
        # channel dequantizes to 0 * code = 0 exactly, as it was. Counted and recorded instead of warned.
        zero_channels = all_zero_channels(KokoroDecoder(kmodel))
        op_config = OpLinearQuantizerConfig(mode="linear_symmetric", granularity="per_channel")
        with np.errstate(divide="ignore", invalid="ignore"):
            mlmodel = linear_quantize_weights(mlmodel, config=OptimizationConfig(global_config=op_config))
    mlmodel.save(str(out / "model.mlpackage"))
    ops, dtypes = mil_op_counts(mlmodel)
    return {
        "stage": "coreml",
        "config": cfg.model_dump(mode="json"),
        "split": "front.onnx (ONNX Runtime, host) -> model.mlpackage (Core ML decoder)",
        "zero_weight_channels": zero_channels,
        "op_counts": ops,
        "output_dtypes": dtypes,
        "fp32_ops": sorted(FP32_OPS) if cfg.precision == "fp16" else "all",
        "flexible_frames": [8, max_frames],
        "seconds": {"trace": round(converted - started, 2), "convert": round(time.perf_counter() - converted, 2)},
        "prediction": "needs macOS: run kokoro-opt evaluate on a Mac to score this artifact",
    }


def all_zero_channels(module: torch.nn.Module) -> int:
    """Output channels whose weights are all zero, over every weight of two or more dimensions."""
    with torch.no_grad():
        return sum(int((p.reshape(p.shape[0], -1).abs().amax(dim=1) == 0).sum()) for p in module.parameters() if p.dim() >= 2)


def example_feeds(front_path: Path, tokens: list[int], style: np.ndarray, speed: float = 1.0) -> dict[str, np.ndarray]:
    """Decoder inputs for a sentence, computed by the host-side front model."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(front_path), providers=["CPUExecutionProvider"])
    feeds = model_feeds(tokens, style, speed)
    asr, f0, noise, durations = session.run(None, feeds)
    return {"asr": asr, "f0": f0, "noise": noise, "style": style, "durations": durations}


PASS = Pass("coreml", CoreMLStage, run_coreml, libraries=("coremltools", "torch", "kokoro"), produces=("front.onnx",))
