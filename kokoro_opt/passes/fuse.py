"""fuse stage: the whole generator with its chains between INT8 convolutions run as native kernels, gated.

ONNX Runtime spends about as long on the float passes between the INT8 convolutions (InstanceNormalization,
Snake's polynomial, DequantizeLinear, QuantizeLinear, residual adds: ~12 passes per chain) as on the
convolutions themselves. The stage cuts `windows/whole_generator.onnx` at those chains (passes/fuse_plan.py)
and writes the segments, the plan and the chains' constants into `fused/`. Where the artifact runs whole
decoding (synthesis, evaluation, a windowed job's finish), the runtime then runs the segments in ONNX Runtime
and each chain in one or two native passes (runtime/glue, runtime/fused.py).

The model is unchanged. Each chain computes its statistics exactly (integer sums of the convolution's levels)
where ONNX Runtime sums floats, so now and then a level rounds the other way, and the generator carries that
as it carries any float noise: the gate holds the fused audio to the whole generator's on corpus sentences
and the short-phrase slice, by the same budget as float noise (recipe.WHOLE_QUALITY).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.passes.common import stage_record
from kokoro_opt.passes.compress import CARRIED
from kokoro_opt.passes.speech_gate import gate_utterances, require_within_budget, score, summarise
from kokoro_opt.passes.windows import WholeReference
from kokoro_opt.recipe import FuseStage, SpeechGate
from kokoro_opt.runtime.fused import CONSTANTS_FILE, FUSED_DIR, PLAN_FILE, FusedGenerator
from kokoro_opt.runtime.fused_plan import FusedPlan
from kokoro_opt.runtime.glue import build_library
from kokoro_opt.runtime.windowed import WINDOWS_DIR, WindowedDecoder, WindowGraphs


def write_fused(whole_generator: Path, folder: Path) -> FusedPlan:
    """Cut the whole generator into `folder` (fused/); its plan."""
    import onnx

    from kokoro_opt.passes.fuse_plan import cut_at_chains

    try:
        segments, plan, constants = cut_at_chains(onnx.load(str(whole_generator)))
    except ValueError as exc:
        raise UserError(
            f"the fuse stage cannot cut {whole_generator.name}: {exc}", "put fuse after the snake, quantize and windows stages"
        ) from exc
    typed = FusedPlan.model_validate(plan)  # what the runtime will accept: a cut it would refuse fails the build here
    typed.check_flow(constants)
    folder.mkdir(parents=True, exist_ok=True)
    for name in typed.segments():
        onnx.save(segments[int(name.removeprefix("segment_").removesuffix(".onnx"))], str(folder / name))
    (folder / PLAN_FILE).write_text(json.dumps(plan, indent=1), encoding="utf-8")
    np.savez(folder / CONSTANTS_FILE, **constants)
    return typed


def measure(source: Artifact, fused: FusedGenerator, cfg: FuseStage) -> dict[str, Any]:
    """Fused vs whole generator on the gate's utterances, over the same front."""
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.voices import style_for

    synth = Synthesizer(source, load=False)
    decoder = WindowedDecoder(synth, WindowGraphs.of_folder(source.path / WINDOWS_DIR))  # the source is not fused
    whole_reference = WholeReference(decoder)
    rows = []
    for utterance, tokens in gate_utterances(cfg, synth.voices, synth.vocab):
        front = decoder.front(tokens, style_for(synth.packs[utterance.voice], len(tokens)))
        reference = whole_reference(front)  # the windows stage's gate made it, in a build
        speech = np.asarray(fused.run(front.generator_feeds())).reshape(-1) / synth.audio_gain
        rows.append(score(utterance, reference, speech, synth.sample_rate, tokens=len(tokens)))
    return summarise(rows)


def run_fuse(source: Artifact, cfg: FuseStage, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    whole_generator = source.path / WINDOWS_DIR / "whole_generator.onnx"
    if not source.capabilities.windowed or not whole_generator.is_file():
        raise UserError(f"{source.name} has no windows/whole_generator.onnx", "put the fuse stage after the windows stage")
    shutil.copy2(source.model_file, out / "model.onnx")
    plan = write_fused(whole_generator, out / FUSED_DIR)
    fused = FusedGenerator(out / FUSED_DIR)  # builds the kernels here first (UserError without a C compiler)
    scores = measure(source, fused, cfg)
    require_within_budget(
        scores,
        cfg,
        source,
        "the fused generator",
        "report this with the build record: the chains should match the whole generator within float noise",
    )
    chains = plan.chains()
    return stage_record(
        "fuse",
        cfg,
        out,
        started,
        segments=len(plan.segments()),
        chains={kind: sum(1 for c in chains if c.kind == kind) for kind in ("level", "float", "residual", "sum")},
        gate=scores,
    )


PASS = Pass(
    "fuse",
    FuseStage,
    run_fuse,
    libraries=("onnx", "onnxruntime"),
    produces=(FUSED_DIR,),
    consumes=(WINDOWS_DIR,),
    carries=(*CARRIED, WINDOWS_DIR),  # the model and its windowed graphs are the input's, unchanged
    grants=("fused",),
    keeps=("edges", "windowed"),
    needs=("windowed",),
    after=("snake", "quantize"),  # it cuts the generator at the INT8 norm-Snake-quantize chains they make
    judged_by=tuple(SpeechGate.model_fields),
    reads=("kokoro_opt/data/eval_corpus.yaml", "kokoro_opt/runtime/glue/chains.c"),
    machine_check=build_library,
)
