"""How an ONNX artifact would split across ONNX Runtime's Core ML execution provider, measured on any OS.

ONNX Runtime's own analysis (`python -m onnxruntime.tools.check_onnx_model_mobile_usability`) walks
the graph with the provider's published op support: every unsupported node cuts a partition, and
each partition boundary is a copy between the Core ML device and the CPU. More than two partitions
and ONNX Runtime's verdict is "use the CPU EP". This is a graph property, not a speed: speed on an
FP16-native provider is reported only where one runs.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MLPROGRAM_OPS = "coreml_supported_mlprogram_ops.md"


@dataclass(frozen=True)
class Partitioning:
    partitions: int
    supported_nodes: int
    nodes: int
    fixed_shapes: bool  # as if every input shape were fixed (onnxruntime.tools.make_dynamic_shape_fixed)
    verdict: str  # ONNX Runtime's: YES, MAYBE or NO

    @property
    def node_share(self) -> float:
        return self.supported_nodes / max(self.nodes, 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "node_share": round(self.node_share, 4)}


def coreml_partitioning(model_file: Path) -> list[Partitioning]:
    """Core ML (MLProgram) partitioning of `model_file` as is and with fixed shapes, after ONNX
    Runtime's basic optimisation (what the provider sees)."""
    from onnxruntime.tools.mobile_helpers import usability_checker as checker
    from onnxruntime.tools.onnx_model_utils import ModelProtoWithShapeInfo, optimize_model

    logging.getLogger("usability_checker").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="kokoro-opt-ep-") as tmp:
        optimized = Path(tmp) / "model.onnx"
        optimize_model(model_file, optimized, use_external_initializers=True)
        model = ModelProtoWithShapeInfo(optimized).model_with_shape_info
        found = []
        for fixed in (False, True):
            info = checker.check_coreml_partitions(model, not fixed, MLPROGRAM_OPS)
            found.append(
                Partitioning(info.num_partitions, info.num_supported_nodes, info.num_nodes, fixed, info.suitability().name)
            )
    return found


def partition_metrics(model_file: Path) -> dict[str, float]:
    """The evaluation's columns: partitions and covered node share, as is and with fixed shapes."""
    dynamic, fixed = coreml_partitioning(model_file)
    return {
        "coreml_partitions": float(dynamic.partitions),
        "coreml_node_share": dynamic.node_share,
        "coreml_partitions_fixed": float(fixed.partitions),
        "coreml_node_share_fixed": fixed.node_share,
    }
