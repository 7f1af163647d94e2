"""What every stage shares: recording runtime settings and describing a graph."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def set_runtime_meta(out: Path, key: str, value: Any) -> None:
    """Record what the runtime needs from a stage (its settings) in the output's kokoro.json under `key`."""
    path = out / "kokoro.json"
    meta = json.loads(path.read_text(encoding="utf-8"))
    meta[key] = value
    path.write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")


def graph_summary(model_path: Path) -> dict[str, Any]:
    """Op counts (including Loop/If bodies) and file size: recorded in every stage's record."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    counts: Counter[str] = Counter()

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            counts[node.op_type] += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g)

    visit(model.graph)
    return {
        "nodes": sum(counts.values()),
        "op_counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
        "size_mb": round(model_path.stat().st_size / 1e6, 2),
    }


def stage_record(kind: str, cfg: Any, out: Path, started: float, **facts: Any) -> dict[str, Any]:
    """The manifest record of a stage that wrote out/model.onnx: config, what it did, graph, time."""
    return {
        "stage": kind,
        "config": cfg.model_dump(mode="json"),
        **facts,
        "graph": graph_summary(out / "model.onnx"),
        "seconds": {kind: round(time.perf_counter() - started, 2)},
    }


def intermediate_values(model: Any, tensors: list[str], feeds: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """For each feed, the values of the named intermediate tensors of `model` (an onnx.ModelProto,
    left unchanged): a copy runs with them exposed as outputs; ORT's basic optimisation keeps names."""
    if not tensors:
        return
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in tensors)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for feed in feeds:
        yield dict(zip(tensors, session.run(tensors, feed), strict=True))
