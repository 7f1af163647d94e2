"""From one interleaved measurement session's records to each runner's EvalResult: speed, first audio and memory,
quality against the fp32 reference measured in the same session (sentences and short phrases apart), the windowed
stream's quality, edge inputs and WER."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kokoro_opt.artifacts import open_artifact
from kokoro_opt.audio import is_speechlike
from kokoro_opt.evaluate import metrics as M
from kokoro_opt.evaluate.corpus import PHRASE
from kokoro_opt.evaluate.ep_support import partition_metrics
from kokoro_opt.evaluate.report import EvalResult
from kokoro_opt.evaluate.runners import Plan, Runner
from kokoro_opt.machine import fingerprint

SAMPLE_CLIPS = 2  # utterances whose WAVs and mel plots are logged


@dataclass
class Streamed:
    """What a windowed artifact's stream gives: first-audio times, and each utterance's speech and span."""

    first_audio: list[float] = field(default_factory=list)
    speech: list[tuple[np.ndarray, tuple[int, int]]] = field(default_factory=list)


@dataclass
class Session:
    """What one interleaved measurement records, keyed by artifact id: each runner's plan, its timed runs and audio
    (the first run's: deterministic models give the same every run), first-audio times, probes, edge checks and
    transcripts."""

    runners: list[Runner]
    plans: dict[str, Plan]
    n: int  # utterances measured: the fewest any runner's plan has
    times: dict[str, list[list[float]]] = field(default_factory=dict)
    outputs: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = field(default_factory=dict)
    ttfa: dict[str, list[float]] = field(default_factory=dict)
    streamed: dict[str, Streamed] = field(default_factory=dict)
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    edges: dict[str, dict[str, str | None]] = field(default_factory=dict)
    heard: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for r in self.runners:
            self.times[r.artifact_id] = [[] for _ in range(self.n)]
            self.outputs[r.artifact_id], self.ttfa[r.artifact_id] = [], []
            if r.windows is not None:
                self.streamed[r.artifact_id] = Streamed()

    def rotated(self, shift: int) -> list[Runner]:
        """The runners in turn, starting at the `shift`-th: each takes every place in the order alike."""
        k = shift % len(self.runners)
        return self.runners[k:] + self.runners[:k]


def result_of(session: Session, r: Runner, span: tuple[int, int], asr_asked: bool, asr_note: str) -> EvalResult:
    """One runner's EvalResult: scored against its reference, when that was measured in the same session."""
    ref = next((x for x in session.runners if x.artifact_id == (r.reference_id or "")), None)
    plan, key = session.plans[r.artifact_id], r.artifact_id
    probe = session.probes.get(key)
    result = score(
        r, ref, plan, session.times, session.outputs, session.ttfa[key], probe or {}, session.n, probed=probe is not None
    )
    if key in session.streamed:
        result.metrics.update(score_streamed(session.streamed[key], ref, plan, session.outputs, r.sample_rate))
        result.metrics["served_windowed"] = 1.0
    result.machine, result.span_ms = fingerprint(), span
    if key in session.edges:
        result.metrics["edge_inputs_ok"] = float(not any(session.edges[key].values()))
        result.notes += [f"edge input '{name}': {wrong}" for name, wrong in session.edges[key].items() if wrong]
    if key in session.heard:
        score_wer(result, r, ref, plan, session.heard, session.n)
    elif asr_asked:
        result.notes.append(asr_note)
    return result


def score_streamed(
    streamed: Streamed, ref: Runner | None, plan: Plan, outputs: dict[str, list[Any]], rate: int
) -> dict[str, float]:
    """`windowed_*`: the stream's first audio (as `ttfa_p50`: the paragraph's first chunk, text to audio) and, against
    the fp32 reference's same samples, its quality (as the whole decoding's, sentences and phrases apart)."""
    m = {
        "windowed_ttfa_model_p50": M.percentile(streamed.first_audio, 50),
        "windowed_ttfa_p50": plan.frontend_seconds + M.percentile(streamed.first_audio, 50),
    }
    if ref is None:
        return m
    rows = []
    for i, (audio, (start, end)) in enumerate(streamed.speech):
        clean = outputs[ref.artifact_id][i][0][start:end]
        rows.append({"kind": plan.utterances[i].sentence.kind, **M.quality_row(clean, audio, rate)})
    return m | {f"windowed_{k}": v for k, v in M.summarise_quality(rows).items()}


def slices(plan: Plan, n: int) -> tuple[list[int], list[int]]:
    """Indices of the sentences, which set the headline numbers, and of the short-phrase slice, which is
    summarised apart (phrase_*)."""
    phrases = [i for i in range(n) if plan.utterances[i].sentence.kind == PHRASE]
    return [i for i in range(n) if i not in phrases], phrases


def score(
    r: Runner,
    ref: Runner | None,
    plan: Plan,
    times: dict[str, list[list[float]]],
    outputs: dict[str, list[tuple[np.ndarray, np.ndarray | None]]],
    ttfa: list[float],
    probe: dict[str, Any],
    n: int,
    probed: bool = False,
) -> EvalResult:
    """`probed`: the runner was probed (memory, profile, its graph for Core ML), not only measured as a reference."""
    own, lat = outputs[r.artifact_id], times[r.artifact_id]
    seconds = [len(a) / r.sample_rate for a, _ in own]
    sentences, phrases = slices(plan, n)
    rtf = [t / max(seconds[i], 1e-9) for i in sentences for t in lat[i]]
    flat = [t for i in sentences for t in lat[i]]
    m: dict[str, float] = {
        "utterances": len(sentences),
        "phrases": len(phrases),
        "runs": len(lat[0]),
        "size_mb": r.size_bytes / 1e6,
        "load_seconds": r.load_seconds,
        "latency_p50": M.percentile(flat, 50),
        "latency_p90": M.percentile(flat, 90),
        "rtf_p50": M.percentile(rtf, 50),
        "rtf_p90": M.percentile(rtf, 90),
        "audio_seconds": float(sum(seconds[i] for i in sentences)),
        "phrase_latency_p50": M.percentile([t for i in phrases for t in lat[i]], 50) if phrases else float("nan"),
        "frontend_seconds": plan.frontend_seconds,
        "first_chunk_tokens": len(plan.first_chunk),
        "ttfa_model_p50": M.percentile(ttfa, 50),
        "ttfa_p50": plan.frontend_seconds + M.percentile(ttfa, 50),
        "ttfa_p90": plan.frontend_seconds + M.percentile(ttfa, 90),
        "bad_outputs": float(sum(not is_speechlike(a) for a, _ in own)),
        "peak_rss_mb": probe.get("peak_rss_mb", float("nan")),
        "rss_baseline_mb": probe.get("baseline_rss_mb", float("nan")),
    }
    if r.kind == "onnx" and probed:  # a graph property, probed like memory: how ONNX Runtime's Core ML provider would split it
        m.update(partition_metrics(open_artifact(r.folder).model_file))
    rows: list[dict[str, Any]] = [
        {
            "utterance": u.key,
            "kind": u.sentence.kind,
            "tokens": len(plan.tokens[i]),
            "audio_seconds": seconds[i],
            "latency_p50": M.percentile(lat[i], 50),
        }
        for i, u in enumerate(plan.utterances[:n])
    ]
    result = EvalResult(
        r.label,
        r.artifact_id,
        r.kind,
        r.external,
        ref.artifact_id if ref else None,
        ref is r,
        metrics=m,
        utterances=rows,
        op_times=probe.get("op_times", {}),
    )
    if "error" in probe:
        result.notes.append(f"memory/profile probe failed: {probe['error']}")
    if ref is None:
        result.notes.append("no fp32 export of the same weights measured alongside: no quality or speedup numbers")
        result.samples = samples_of(r, rows, own, None)
        return result
    clean, ref_lat = outputs[ref.artifact_id], times[ref.artifact_id]
    for i, row in enumerate(rows):
        row.update(M.quality_row(clean[i][0], own[i][0], r.sample_rate, clean[i][1], own[i][1]))
    m.update(M.summarise_quality(rows))

    # per-utterance ratio of medians, then the geometric mean: long and short sentences weigh alike
    def speedup(picked: list[int]) -> float:
        return M.geometric_mean(M.percentile(ref_lat[i], 50) / M.percentile(lat[i], 50) for i in picked)

    m["speedup_vs_reference"] = speedup(sentences)
    if phrases:
        m["phrase_speedup_vs_reference"] = speedup(phrases)
    result.samples = samples_of(r, rows, own, clean)
    return result


def samples_of(r: Runner, rows: list[dict[str, Any]], own: list[Any], clean: list[Any] | None) -> dict[str, Any]:
    picked = range(min(SAMPLE_CLIPS, len(rows)))
    return {"rate": r.sample_rate, "clips": [(rows[i]["utterance"], own[i][0], clean[i][0] if clean else None) for i in picked]}


def score_wer(result: EvalResult, r: Runner, ref: Runner | None, plan: Plan, heard: dict[str, list[str]], n: int) -> None:
    from kokoro_opt.evaluate.asr import wer_metrics, word_error_rate

    texts = [u.sentence.text for u in plan.utterances[:n]]
    for row, text, said in zip(result.utterances, texts, heard[r.artifact_id], strict=True):
        row.update(transcript=said, wer=word_error_rate([text], [said]))
    sentences, _ = slices(plan, n)  # corpus WER: sentences, as PESQ

    def pick(values: list[str]) -> list[str]:
        return [values[i] for i in sentences]

    reference = pick(heard[ref.artifact_id]) if ref else None
    result.metrics.update(wer_metrics(pick(texts), pick(heard[r.artifact_id]), reference))
