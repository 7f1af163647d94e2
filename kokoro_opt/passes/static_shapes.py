"""Reshape targets as constants: the simplify stage's `static_reshapes`.

The exporter writes `x.view(x.size(0), x.size(1), heads, -1)` as Shape -> Gather -> Unsqueeze ->
Concat -> Reshape: shape arithmetic at run time, 167 such Reshapes in Kokoro. ONNX Runtime's
symbolic shape inference knows every Reshape's output in terms of the input's axes, so most targets
can be written as constants with ONNX's own placeholders: 0 keeps the input's axis, -1 takes what is
left. The shape arithmetic then has no readers and goes. Exact on FP32 (bit-identical audio), and it
matters elsewhere:

- ONNX Runtime's Core ML provider cannot take those shape nodes: on the INT8/FP16 artifact they cut
  the ALBERT into two dozen partitions (64 -> 44 partitions, docs/stages.md).
- The float16 converter turns float shape arithmetic into FP16 arithmetic; with the targets constant
  the FP16 model is closer to FP32 (measured PESQ-WB 4.36 -> 4.50 on a short sentence).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.errors import UserError
from kokoro_opt.onnx_graph import read_names


def _dims(value: Any) -> list[int | str | None]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in value.type.tensor_type.shape.dim]


def constant_target(before: list[int | str | None], after: list[int | str | None]) -> list[int] | None:
    """The Reshape target that turns a tensor of shape `before` into `after`, with 0 for an axis kept
    from `before` and at most one -1; None when the shapes leave it undetermined."""
    if any(d is None for d in after):
        return None
    target: list[int] = []
    for axis, dim in enumerate(after):
        if isinstance(dim, int) and dim > 0:
            target.append(dim)
        elif axis < len(before) and before[axis] == dim and isinstance(dim, str):
            target.append(0)
        else:
            target.append(-1)
    return target if target.count(-1) <= 1 else None


def drop_dead_nodes(model: Any) -> int:
    """Remove nodes none of whose outputs is read (by a node, a subgraph or the graph's outputs), then
    the initializers nothing reads any more."""
    removed = 0
    while True:
        read = read_names(model.graph.node, model.graph.output)
        alive = [n for n in model.graph.node if any(o in read for o in n.output)]
        if len(alive) == len(model.graph.node):
            kept = [i for i in model.graph.initializer if i.name in read]
            del model.graph.initializer[:]
            model.graph.initializer.extend(kept)
            return removed
        removed += len(model.graph.node) - len(alive)
        del model.graph.node[:]
        model.graph.node.extend(alive)


def static_reshapes(model: Any) -> dict[str, int]:
    """Rewrite `model` in place; returns how many Reshapes got constant targets and how many nodes went."""
    from onnx import numpy_helper
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # auto_merge: e.g. Min(512, tokens) = tokens. A failed inference leaves a dump in the working folder.
    with tempfile.TemporaryDirectory(prefix="kokoro-opt-shapes-") as scratch, contextlib.chdir(scratch):
        try:
            inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
        except Exception as error:  # the tool raises a bare Exception
            raise UserError(
                f"ONNX Runtime's symbolic shape inference failed on this graph ({error})",
                "set static_reshapes: false in the simplify stage",
            ) from error
    shapes = {v.name: _dims(v) for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    constants = {i.name for i in model.graph.initializer}
    rewritten = 0
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.input[1] in constants:
            continue
        if node.input[0] not in shapes or node.output[0] not in shapes:
            continue
        target = constant_target(shapes[node.input[0]], shapes[node.output[0]])
        if target is None or any(a.name == "allowzero" and a.i for a in node.attribute):
            continue
        name = f"{node.output[0]}_target"
        model.graph.initializer.append(numpy_helper.from_array(np.array(target, np.int64), name))
        node.input[1] = name
        rewritten += 1
    return {"reshapes": rewritten, "nodes_removed": drop_dead_nodes(model)}


def output_drift(before: Path, after: Path, feeds: list[dict[str, np.ndarray]]) -> float:
    """Largest audio difference between two models over `feeds`, relative to the audio's peak; inf when
    the durations differ or a model does not load or run. A wrong target breaks the audio or the run,
    far above float noise (~1e-6)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        sessions = [ort.InferenceSession(str(f), options, providers=["CPUExecutionProvider"]) for f in (before, after)]
        runs = [[s.run(None, feed) for s in sessions] for feed in feeds]
    except Exception:  # a target ONNX Runtime rejects (shape inference, run time) is as wrong as any
        return float("inf")
    drift = 0.0
    for (audio_a, durations_a), (audio_b, durations_b) in runs:
        if not np.array_equal(durations_a, durations_b) or audio_a.shape != audio_b.shape:
            return float("inf")
        drift = max(drift, float(np.abs(audio_a - audio_b).max() / max(float(np.abs(audio_a).max()), 1e-9)))
    return drift
