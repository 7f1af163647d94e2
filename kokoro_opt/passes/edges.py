"""edges stage: the model learns to skip decoding most of the silence at an utterance's edges, and is gated.

The graph gets an `edge_keep` input (kokoro_opt/passes/edge_input.py) whose default changes nothing: evaluations and
`compare` see the artifact's own audio. The server feeds the stage's frame counts, so a job decodes
`lead_frames` of the leading pad instead of 12-18 and `trail_frames` of the final punctuation and pad.
The joiner trims that silence anyway (runtime/join.py) and pads a seam's pause with zeros.

Cutting is not free: the decoder's convolutions see zeros where they saw silence, which reaches ~14
frames into the speech. The gate compares the capped speech with the uncapped speech of the same model
on corpus sentences (PESQ-WB, worst sentence, 4-12 kHz energy) and refuses the artifact below the
budget. Measured on the real weights (docs/stages.md): keeping 3 leading frames cost 0.4 PESQ on the
shortest utterances, 6 frames about half of that.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.passes.common import set_runtime_meta, stage_record
from kokoro_opt.passes.compress import CARRIED
from kokoro_opt.passes.edge_input import add_edge_input, has_edge_input
from kokoro_opt.passes.speech_gate import gate_utterances, require_within_budget, score, summarise
from kokoro_opt.recipe import EdgesStage
from kokoro_opt.runtime.edges import EDGE_INPUT, FRAME_SAMPLES, edge_keep, removed_frames


def uncapped_span(audio: np.ndarray, durations: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The part of an uncapped output that the capped run reproduces."""
    lead, trail = removed_frames(durations, keep)
    return audio[lead * FRAME_SAMPLES : len(audio) - trail * FRAME_SAMPLES]


def measure(model_file: Path, artifact: Artifact, cfg: EdgesStage) -> dict[str, Any]:
    """Capped vs uncapped speech of `model_file` on the gate's utterances: per-utterance scores and the summary."""
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.voices import style_for

    synth = Synthesizer(artifact, model_file=model_file)  # the new graph with the source's voices and vocab
    rows = []
    for utterance, tokens in gate_utterances(cfg, synth.voices, synth.vocab):
        feeds = synth.feeds(tokens, style_for(synth.packs[utterance.voice], len(tokens)), 1.0)
        keep = edge_keep(cfg.lead_frames, cfg.trail_frames, tokens, synth.symbols)
        full, durations = (np.asarray(x) for x in synth.session.run(None, feeds))
        capped = np.asarray(synth.session.run(None, {**feeds, EDGE_INPUT: keep})[0]).reshape(-1)
        reference = uncapped_span(full.reshape(-1), durations.reshape(-1), keep)
        if len(reference) != len(capped):
            raise UserError(
                f"edge capping cut {len(full) - len(capped)} samples where the durations say {len(full) - len(reference)}",
                "report this: the graph's slicing is wrong",
            )
        cut = round(1 - len(capped) / max(len(full.reshape(-1)), 1), 4)
        rows.append(score(utterance, reference, capped, synth.sample_rate, tokens=len(tokens), frames_cut=cut))
    summary = summarise(rows)
    return {**summary, "frames_cut_mean": round(float(np.mean([r["frames_cut"] for r in rows])), 4)}


def run_edges(source: Artifact, cfg: EdgesStage, out: Path) -> dict[str, Any]:
    import onnx

    started = time.perf_counter()
    model = onnx.load(str(source.model_file))
    if has_edge_input(model):
        raise UserError(f"{source.name} already has the edges stage's input", "keep one edges stage in the recipe")
    try:
        sliced = add_edge_input(model)
    except KeyError as exc:
        raise UserError(
            f"the edges stage cannot find the decoder node {exc} in {source.model_file.name}",
            "put edges after export-derived ONNX stages (not after coreml or ort)",
        ) from exc
    onnx.save(model, str(out / "model.onnx"))
    scores = measure(out / "model.onnx", source, cfg)
    require_within_budget(
        scores, cfg, source, "edge capping", "keep more frames (edges.lead_frames / trail_frames) or drop the edges stage"
    )
    set_runtime_meta(out, "edges", {"lead_frames": cfg.lead_frames, "trail_frames": cfg.trail_frames})
    return stage_record("edges", cfg, out, started, sliced=sorted(sliced), gate=scores)


PASS = Pass(
    "edges",
    EdgesStage,
    run_edges,
    libraries=("onnx", "onnxruntime"),
    carries=CARRIED,  # it adds slices; every node it had keeps its name and precision
    grants=("edges",),
    reads=("kokoro_opt/data/eval_corpus.yaml",),
)
