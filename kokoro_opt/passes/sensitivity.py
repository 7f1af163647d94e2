"""`mixed` quantization: INT8 where Kokoro tolerates it, higher precision where it does not.

The choice is measured, not guessed. Nodes are grouped into blocks (a resblock, a decoder stage,
conv_post, the ALBERT, ...). Each block is quantized alone and scored in the audio domain against
fp32 on held-out sentences: PESQ-WB catches distortion, the 4-12 kHz energy ratio catches the
static that a quantized conv_post/iSTFT path adds (which a log-mel distance missed elsewhere),
and durations must stay identical. Then, like Intel Neural Compressor's fallback, every block that
passed alone is quantized together and blocks fall back to higher precision until the whole model
meets the recipe's quality budget. The block that falls back first is the one that
costs the most quality per unit of compute it would speed up: on Kokoro the small decoder.encode
block hurts almost as much as the generator's last resblock while doing 1/25 of its work. A block
that still falls back is retried one resblock branch at a time, optionally with its input ranges cut
tighter (see passes.clipping).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel

from kokoro_opt.artifacts import Artifact
from kokoro_opt.errors import UserError
from kokoro_opt.passes.fp16_islands import quantize_in_fp16
from kokoro_opt.passes.qdq import (
    CalibrationFiles,
    calibration_feeds,
    calibration_for_lock,
    quantizable_nodes,
    quantize_static_qdq,
    read_corpus,
    restore_calibration,
)
from kokoro_opt.passes.scoring import AudioScorer, Quality, node_cost_shares
from kokoro_opt.recipe import QuantizeStage

SENSITIVITY_CORPUS = "calibration/sensitivity.txt"
# A locked build checks the budget less this much PESQ. The analysis stops at the first choice that
# meets the budget, so its score sits just above it, and the score of one INT8 choice moves with float
# noise in the model it quantizes: measured -0.12..+0.03 around the locked 3.857 (ranges moved by 1e-6,
# ranges rounded to float32, the export made with torch's default or AVX2 kernels). Breakage scores
# far lower (conv_post alone in INT8: 1.2, the ALBERT alone: 1.8). docs/reproducibility.md has the table.
LOCK_PESQ_TOLERANCE = 0.2


def block_of(node_name: str) -> str:
    """The unit of the analysis: a generator resblock, a decoder stage, or a whole front module.

    `/decoder/generator/resblocks.0/convs1.0/Conv` -> `decoder/generator/resblocks.0`,
    `/decoder/decode.3/conv1/Conv` -> `decoder/decode.3`, `/bert/encoder/.../MatMul` -> `bert`.
    """
    parts = [p for p in node_name.strip("/").split("/") if p]
    if not parts:
        return "other"
    depth = 3 if parts[:2] == ["decoder", "generator"] else 2 if parts[0] == "decoder" else 1
    return "/".join(parts[: min(depth, max(len(parts) - 1, 1))])


def part_of(node_name: str) -> str:
    """The finer unit inside a block: a resblock's dilation branch (convs1.j with convs2.j), else the node."""
    branch = re.search(r"/convs[12]\.(\d+)/", node_name)
    return f"{block_of(node_name)}/branch.{branch.group(1)}" if branch else node_name


def select_blocks(
    blocks: list[str],
    score: Callable[[set[str]], Quality],
    cfg: QuantizeStage,
    log: Callable[[str], None] = print,
    parts: dict[str, list[str]] | None = None,
    clip_percentiles: list[float] | tuple[float, ...] = (),
    shares: dict[str, float] | None = None,
) -> tuple[list[str], dict[str, Quality], list[dict[str, Any]]]:
    """Returns (units kept in INT8, each block's and each cut variant's quality alone, the fallback history).

    A unit is a block, a part (`parts`: a resblock's branches) or either with an input cut
    (`block@99.95`). With `clip_percentiles`, a block with parts is also scored alone with the
    ranges of its inputs cut at each percentile, and the best of those and the plain ranges (one
    that passes the gate before one that does not) is the block's unit from then on. A block left
    in higher precision is then tried part by part (most work first, with the block's cut): each
    part that keeps the whole model within the budget goes to INT8 too.

    With `shares` (each block's share of the compute), the block that falls back first is the one
    with the most sensitivity per unit of share, so the speed kept under the budget is the largest;
    without them, the most sensitive block falls back first."""
    branches = {b: p for b, p in (parts or {}).items() if len(p) > 1}  # a single part is the block itself
    alone: dict[str, Quality] = {}
    unit = {block: block for block in blocks}
    for block in blocks:
        alone[block] = score({block})
        log(f"sensitivity {block}: PESQ {alone[block].mean_pesq:.2f}, high-band moved {alone[block].max_high_band_db:.2f} dB")
        if block in branches:
            unit[block] = _best_clip(block, alone, score, clip_percentiles, cfg, log)

    def cost(block: str) -> tuple[float, str]:
        sensitivity = alone[unit[block]].sensitivity
        return (sensitivity / max(shares.get(block, 0.0), 1e-9) if shares else sensitivity), block

    chosen = [unit[b] for b in sorted(blocks, key=cost) if alone[unit[b]].passes(cfg)]
    history: list[dict[str, Any]] = []
    while chosen:
        combined = score(set(chosen))
        history.append({"int8_blocks": len(chosen), **asdict(combined), "passes": combined.passes(cfg)})
        if combined.passes(cfg):
            break
        dropped = chosen.pop()  # the costliest block still in INT8
        history[-1]["falls_back"] = dropped
        log(f"fallback: {dropped} -> {cfg.fallback_precision} (combined PESQ {combined.mean_pesq:.2f})")
    for block in sorted((b for b in blocks if unit[b] not in chosen), key=cost):
        suffix = unit[block][len(block) :]
        for part in (p + suffix for p in branches.get(block, [])):
            combined = score({*chosen, part})
            fits = combined.passes(cfg)
            history.append({"int8_blocks": len(chosen) + 1, "part": part, **asdict(combined), "passes": fits})
            chosen += [part] if fits else []
            log(f"part {part}: {'int8' if fits else cfg.fallback_precision} (combined PESQ {combined.mean_pesq:.2f})")
    return chosen, alone, history


def _best_clip(
    block: str,
    alone: dict[str, Quality],
    score: Callable[[set[str]], Quality],
    percentiles: Iterable[float],
    cfg: QuantizeStage,
    log: Callable[[str], None],
) -> str:
    """Scores `block@p` alone for each percentile into `alone`; returns the best unit, the block itself
    included. A variant that passes the gate beats one that does not, then the lower sensitivity wins."""
    variants = [block]
    for percentile in percentiles:
        variants.append(candidate := f"{block}@{percentile:g}")
        alone[candidate] = quality = score({candidate})
        log(f"clip {candidate}: PESQ {quality.mean_pesq:.2f}, high-band moved {quality.max_high_band_db:.2f} dB alone")
    return min(variants, key=lambda u: (not alone[u].passes(cfg), alone[u].sensitivity))


def _unscored(candidate: bool) -> dict[str, str]:
    """A block row without scores: too little compute to try, or scored by the analysis in the lock.
    compress protects a candidate left in higher precision either way (passes.compress.sensitive_nodes)."""
    return (
        {"locked": "scored by the analysis recorded in the recipe's lock"}
        if candidate
        else {"skipped": "below min_block_time_share"}
    )


class _OrtRanges(BaseModel):
    """onnxruntime's calibration ranges as it writes them (TensorsData), each tensor's entry its own."""

    data: dict[str, dict[str, Any]]


def _float64s(text: str) -> str:
    """Per-channel ranges as qdq.calibration_for_lock keeps them: base64 of whole float64s."""
    import base64
    import binascii

    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None
    if not raw or len(raw) % 8:
        raise ValueError(f"{len(raw)} bytes, not whole float64s")
    return text


class LockedCalibration(BaseModel):
    """What a lock keeps of the calibration (qdq.calibration_for_lock writes all three)."""

    ranges: _OrtRanges
    input_ranges: dict[str, dict[str, tuple[float, float]]]
    output_ranges: dict[str, tuple[Annotated[str, AfterValidator(_float64s)], Annotated[str, AfterValidator(_float64s)]]]


class MixedDecisions(BaseModel):
    """The mixed mode's measured choice as a lock keeps it: the INT8 units and what their quantization read."""

    int8_units: list[str]
    calibration: LockedCalibration | None = None


def _locked_units(decisions: dict[str, Any], members: dict[str, list[str]]) -> list[str]:
    units = MixedDecisions.model_validate(decisions).int8_units
    unknown = [u for u in units if split_clip(u)[0] not in members]
    if unknown:
        raise UserError(
            f"the lock names INT8 units this graph does not have: {', '.join(unknown[:3])}",
            "rebuild with --reanalyze to measure the choice for this graph",
        )
    return list(units)


def split_clip(unit: str) -> tuple[str, float | None]:
    """`decoder/generator/resblocks.5/branch.1@99.95` -> (the unit, 99.95); no suffix -> (unit, None)."""
    name, _, percentile = unit.partition("@")
    return name, float(percentile) if percentile else None


@dataclass
class Units:
    """The quantizable nodes grouped as the analysis chooses among them: blocks, a block's branches (parts), and
    each block's share of the Conv/MatMul work."""

    nodes: list[str]
    by_block: dict[str, list[str]]
    members: dict[str, list[str]]  # a block's or a part's nodes
    block_share: dict[str, float]
    candidates: list[str]  # blocks doing enough of the work to be worth INT8
    parts: dict[str, list[str]]  # a candidate block's branches, largest first (resblocks only)


def group_units(source: Artifact, cfg: QuantizeStage) -> Units:
    nodes = [n for n in quantizable_nodes(source.model_file, cfg.op_types) if n not in cfg.exclude_nodes]
    by_block: dict[str, list[str]] = {}
    for node in nodes:
        by_block.setdefault(block_of(node), []).append(node)
    shares = node_cost_shares(source.model_file, calibration_feeds(source, 1))
    block_share = {b: sum(shares.get(n, 0.0) for n in members) for b, members in by_block.items()}
    # A block with almost no compute buys no speed in INT8, only risk: it stays in higher precision.
    candidates = sorted(b for b in by_block if block_share[b] >= cfg.min_block_time_share)
    by_part: dict[str, list[str]] = {}
    for node in nodes:
        by_part.setdefault(part_of(node), []).append(node)
    # Only resblock branches are parts: splitting e.g. the ALBERT into its 97 MatMuls would cost 97 scorings.
    parts = {
        b: sorted({part_of(n) for n in by_block[b]}, key=lambda p: (-sum(shares.get(n, 0.0) for n in by_part[p]), p))
        for b in candidates
        if any(part_of(n) != n for n in by_block[b])
    }
    return Units(nodes, by_block, {**by_part, **by_block}, block_share, candidates, parts)


def run_mixed(
    source: Artifact,
    cfg: QuantizeStage,
    out: Path,
    calibrate: Callable[[], CalibrationFiles],
    decisions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write out/model.onnx with the chosen INT8 blocks and out/precision_map.json; return the summary.

    With `decisions` (a lock's `int8_units` and `calibration`) the analysis is skipped: those units
    are quantized with the locked ranges (`calibrate` runs only when the lock lacks some) and the
    result must still pass the quality gate on this machine, or the build stops. The summary's
    `calibration` is what a lock keeps of the calibration (qdq.calibration_for_lock)."""
    import onnx
    from rich.console import Console

    from kokoro_opt.passes.clipping import activation_inputs

    console = Console(stderr=True)
    started = time.perf_counter()
    units = group_units(source, cfg)
    console.print(
        f"sensitivity: {len(units.candidates)} of {len(units.by_block)} blocks do >= "
        f"{cfg.min_block_time_share:.2%} of the Conv/MatMul work each",
        highlight=False,
    )
    scorer = AudioScorer(source, read_corpus(SENSITIVITY_CORPUS)[: cfg.sensitivity_sentences])
    scratch = out / ".variant.onnx"
    inputs_of = activation_inputs(onnx.load(str(source.model_file), load_external_data=False), set(units.nodes))

    def nodes_and_clips(chosen_units: Iterable[str]) -> tuple[list[str], dict[str, float]]:
        chosen_nodes, clips = [], {}
        for unit in sorted(chosen_units):
            name, percentile = split_clip(unit)
            chosen_nodes += units.members[name]
            clips.update({t: percentile for n in units.members[name] for t in inputs_of[n]} if percentile else {})
        return chosen_nodes, clips

    calibration = calibrate() if decisions is None else None

    exceptions: dict[str, str] = {}

    def quantize(target: Path, chosen_nodes: list[str], clips: dict[str, float]) -> None:
        """The variant as it ships: the nodes not in INT8 stay FP32, or turn FP16 but for the FP32 exceptions."""
        assert calibration is not None
        if cfg.fallback_precision == "fp16":
            exceptions.update(quantize_in_fp16(source.model_file, target, cfg, calibration, chosen_nodes, clips))
        elif chosen_nodes:
            quantize_static_qdq(source.model_file, target, cfg, calibration, None, nodes_to_quantize=chosen_nodes, clips=clips)
        else:
            shutil.copy2(source.model_file, target)

    def score(chosen_units: set[str]) -> Quality:
        quantize(scratch, *nodes_and_clips(chosen_units))
        return scorer(scratch)

    if decisions is None:
        chosen, alone, history = select_blocks(
            units.candidates,
            score,
            cfg,
            log=lambda m: console.print(m, highlight=False),
            parts=units.parts,
            clip_percentiles=cfg.input_clip_percentiles,
            shares=units.block_share,
        )
    else:
        chosen, alone, history = _locked_units(decisions, units.members), {}, []
    int8_nodes, clips = nodes_and_clips(chosen)
    if calibration is None:
        locked = (decisions or {}).get("calibration")
        calibration = restore_calibration(out, locked, source.model_file, int8_nodes, clips, cfg) or calibrate()
    quantize(out / "model.onnx", int8_nodes, clips)
    scratch.unlink(missing_ok=True)
    calibration.clipped.unlink(missing_ok=True)
    final_quality = next((h for h in reversed(history) if h["passes"]), None)
    if decisions is not None:
        final_quality = _locked_choice_holds(scorer(out / "model.onnx"), cfg, len(chosen))
    whole = _write_precision_map(out, units, chosen, alone, history, int8_nodes, clips, exceptions, cfg)
    return {
        "int8_blocks": sorted(chosen),
        "fallback_blocks": sorted(set(units.by_block) - whole),
        "int8_nodes": len(int8_nodes),
        "fallback_nodes": len(units.nodes) - len(int8_nodes),
        "clipped_inputs": len(clips),
        "final_quality": final_quality,
        "decisions_from": "analysis" if decisions is None else "lock",
        "alone_scores": {
            u: {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(q).items()} for u, q in sorted(alone.items())
        },
        "sensitivity_seconds": round(time.perf_counter() - started, 1),
        "calibration": calibration_for_lock(calibration, source.model_file, int8_nodes, clips),
    }


def _locked_choice_holds(gate: Quality, cfg: QuantizeStage, int8_blocks: int) -> dict[str, Any]:
    """The locked choice's score on this machine as the build records it; UserError when it misses the budget less
    the lock's noise tolerance."""
    holds = gate.passes(cfg, LOCK_PESQ_TOLERANCE)
    if not holds:
        raise UserError(
            f"the locked INT8 choice no longer meets the quality budget on this machine: PESQ {gate.mean_pesq:.2f} "
            f"(min {gate.min_pesq:.2f}), 4-12 kHz moved {gate.max_high_band_db:.2f} dB, durations equal "
            f"{gate.durations_equal:.0%} (budget less the lock's noise tolerance: PESQ >= "
            f"{cfg.quality_budget_pesq - LOCK_PESQ_TOLERANCE:.2f}, min >= {cfg.min_sentence_pesq - LOCK_PESQ_TOLERANCE:.2f}, "
            f"<= {cfg.max_high_band_db} dB, durations >= {cfg.min_durations_equal:.0%})",
            "rebuild with --reanalyze to measure the choice on this machine (and commit the new lock)",
        )
    return {"int8_blocks": int8_blocks, **asdict(gate), "passes": holds, "pesq_tolerance": LOCK_PESQ_TOLERANCE}


def _write_precision_map(
    out: Path,
    units: Units,
    chosen: list[str],
    alone: dict[str, Quality],
    history: list[dict[str, Any]],
    int8_nodes: list[str],
    clips: dict[str, float],
    exceptions: dict[str, str],
    cfg: QuantizeStage,
) -> set[str]:
    """out/precision_map.json: every node's precision, each block's share, score and choice, the analysis' history;
    returns the blocks in INT8 as a whole."""
    in_int8 = set(int8_nodes)
    precision_map = {n: "int8" if n in in_int8 else "fp32" if n in exceptions else cfg.fallback_precision for n in units.nodes}
    whole = {split_clip(u)[0] for u in chosen}  # blocks in INT8 as a whole, cut or not
    blocks_table = {
        b: {
            "nodes": len(units.by_block[b]),
            "compute_share": round(units.block_share[b], 4),
            "int8": b in whole,
            **(
                {"int8_parts": [p for p in chosen if split_clip(p)[0] in units.parts[b]]}
                if b not in whole and len(units.parts.get(b, [])) > 1
                else {}
            ),
            **(asdict(alone[b]) if b in alone else _unscored(b in units.candidates)),
            **({"cut": cuts} if (cuts := {u: asdict(q) for u, q in alone.items() if u.startswith(f"{b}@")}) else {}),
        }
        for b in sorted(units.by_block)
    }
    (out / "precision_map.json").write_text(
        json.dumps(
            {
                "nodes": precision_map,
                "blocks": blocks_table,
                "fallback_history": history,
                "input_clips": clips,
                **({"fp32_exceptions": exceptions} if cfg.fallback_precision == "fp16" else {}),
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    return whole
