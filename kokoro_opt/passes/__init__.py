"""Optimisation stages after export: each declares one `Pass` (contract.py) next to its code.

Every runner has the signature `run(input_artifact, stage_config, output_folder) -> stage record`
and writes a self-contained artifact folder (model + voices.npz + kokoro.json).
"""

from __future__ import annotations

from kokoro_opt.contract import Pass
from kokoro_opt.passes import compress, coreml, edges, fp16, fuse, ort_format, quantize, simplify, smooth, snake, windows

PASSES: dict[str, Pass] = {
    module.PASS.kind: module.PASS
    for module in (simplify, smooth, snake, quantize, compress, fp16, edges, windows, fuse, ort_format, coreml)
}
