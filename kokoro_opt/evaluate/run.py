"""Measure models side by side: speed, memory, quality vs the fp32 export of the same weights, WER.

A model under test is a `Runner`: an artifact's ONNX session, the kokoro-onnx int8 peer (imported
as an external artifact) or PyTorch eager on the reference's weights. Runners measured together are
interleaved per utterance (A B C, B C A, ...) so noise from other processes on a shared machine hits
all of them alike and the speedup ratios stay meaningful.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.audio import is_speechlike
from kokoro_opt.errors import UserError
from kokoro_opt.evaluate import metrics as M
from kokoro_opt.evaluate.corpus import PHRASE, Corpus, load_corpus
from kokoro_opt.evaluate.edge import check_edge_inputs, edge_token_inputs
from kokoro_opt.evaluate.ep_support import partition_metrics
from kokoro_opt.evaluate.probe import probe_runner
from kokoro_opt.evaluate.report import EvalResult, print_results
from kokoro_opt.evaluate.runners import Plan, Runner
from kokoro_opt.machine import fingerprint
from kokoro_opt.recipe import EvaluateConfig

__all__ = ["Runner", "compare_artifacts", "evaluate_artifacts", "measure", "print_results"]

METRICS_VERSION = "2"  # bump when a metric's definition changes: old evaluations stop matching
SAMPLE_CLIPS = 2  # utterances whose WAVs and mel plots are logged


# ---- one measurement session --------------------------------------------------------------------


@contextmanager
def _progress(console: Console | None, total: int) -> Iterator[Callable[[str], None]]:
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("evaluating", total=total)
        yield lambda desc: progress.update(task, advance=1, description=desc)


def measure(
    runners: list[Runner], config: EvaluateConfig, corpus: Corpus, console: Console | None = None, probe: int | None = None
) -> list[EvalResult]:
    """Time, probe and score loaded runners in one interleaved session: one EvalResult each.
    `probe`: memory/profile-probe and edge-check only the first N runners (the others are there as
    references: their timing and audio are what the first N are compared with)."""
    began = _epoch_ms()
    plans = {r.artifact_id: r.plan(corpus, config) for r in runners}
    n = min(len(p.utterances) for p in plans.values())
    asr, asr_note = None, ""
    if config.asr:
        from kokoro_opt.evaluate.asr import load_asr

        asr, asr_note = load_asr(config.threads)
    probed = runners[: len(runners) if probe is None else probe]
    steps = len(runners) * (config.warmup + (n + 1) * config.runs + (n if asr else 0)) + 2 * len(probed)
    times: dict[str, list[list[float]]] = {r.artifact_id: [[] for _ in range(n)] for r in runners}
    outputs: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = {r.artifact_id: [] for r in runners}
    ttfa: dict[str, list[float]] = {r.artifact_id: [] for r in runners}
    windowed = [r for r in runners if r.windows is not None]
    steps += len(windowed) * (n + config.runs)
    streamed: dict[str, Streamed] = {r.artifact_id: Streamed() for r in windowed}
    probes, heard, edges = {}, {}, {}

    def rotated(shift: int) -> list[Runner]:
        return runners[shift % len(runners) :] + runners[: shift % len(runners)]

    with _progress(console, steps) as tick:
        for r in runners:  # warm up on the longest utterance: arenas are sized before any timing
            plan = plans[r.artifact_id]
            for _ in range(config.warmup):
                r.synth(plan, max(range(n), key=lambda i, p=plan: len(p.tokens[i])))
                tick(f"warm-up {r.label}")
        for i in range(n):
            for k in range(config.runs):
                for r in rotated(i * config.runs + k):
                    started = time.perf_counter()
                    out = r.synth(plans[r.artifact_id], i)
                    times[r.artifact_id][i].append(time.perf_counter() - started)
                    if k == 0:
                        outputs[r.artifact_id].append(out)  # deterministic models: every run is identical
                    tick(f"utterance {i + 1}/{n} {r.label}")
        for k in range(config.runs):
            for r in rotated(k):
                plan = plans[r.artifact_id]
                started = time.perf_counter()
                r.synth_tokens(plan.first_chunk, plan.utterances[0].voice)
                ttfa[r.artifact_id].append(time.perf_counter() - started)
                tick(f"first chunk {r.label}")
                if r.windows is not None:
                    started = time.perf_counter()
                    r.windowed_first_audio(plan.first_chunk, plan.utterances[0].voice)
                    streamed[r.artifact_id].first_audio.append(time.perf_counter() - started)
                    tick(f"first window {r.label}")
        for r in windowed:  # what a stream hears, scored like the whole decoding
            for i in range(n):
                streamed[r.artifact_id].speech.append(r.windowed(plans[r.artifact_id], i))
                tick(f"windowed speech {i + 1}/{n} {r.label}")
        for r in probed:  # after timing and one at a time: a probe must not steal the timed cores
            probes[r.artifact_id] = probe_runner(r, plans[r.artifact_id], config)
            tick(f"memory/profile probe {r.label}")
        for r in probed:
            voice = plans[r.artifact_id].utterances[0].voice
            edge_inputs = edge_token_inputs(r.vocab, corpus.paragraph)
            edges[r.artifact_id] = check_edge_inputs(lambda t, r=r, v=voice: r.synth_tokens(t, v)[0], edge_inputs)
            tick(f"edge inputs {r.label}")
        for r in runners if asr else []:
            heard[r.artifact_id] = []
            for audio, _ in outputs[r.artifact_id]:
                heard[r.artifact_id].append(asr.transcribe(audio, r.sample_rate))
                tick(f"ASR {r.label}")
    by_id = {r.artifact_id: r for r in runners}
    span = (began, _epoch_ms())
    results = []
    for r in runners:
        ref = by_id.get(r.reference_id or "")
        result = _score(r, ref, plans[r.artifact_id], times, outputs, ttfa[r.artifact_id], probes.get(r.artifact_id, {}), n)
        if r.artifact_id in streamed:
            result.metrics.update(_score_streamed(streamed[r.artifact_id], ref, plans[r.artifact_id], outputs, r.sample_rate))
            result.metrics["served_windowed"] = 1.0
        result.machine, result.span_ms = fingerprint(), span
        if r.artifact_id in edges:
            result.metrics["edge_inputs_ok"] = float(not any(edges[r.artifact_id].values()))
            result.notes += [f"edge input '{name}': {wrong}" for name, wrong in edges[r.artifact_id].items() if wrong]
        if asr is not None:
            _score_wer(result, r, ref, plans[r.artifact_id], heard, n)
        elif config.asr:
            result.notes.append(asr_note)
        results.append(result)
    return results


def _epoch_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Streamed:
    """What a windowed artifact's stream gives: first-audio times, and each utterance's speech and span."""

    first_audio: list[float] = field(default_factory=list)
    speech: list[tuple[np.ndarray, tuple[int, int]]] = field(default_factory=list)


def _score_streamed(
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


def _slices(plan: Plan, n: int) -> tuple[list[int], list[int]]:
    """Indices of the sentences, which set the headline numbers, and of the short-phrase slice, which is
    summarised apart (phrase_*)."""
    phrases = [i for i in range(n) if plan.utterances[i].sentence.kind == PHRASE]
    return [i for i in range(n) if i not in phrases], phrases


def _score(
    r: Runner,
    ref: Runner | None,
    plan: Plan,
    times: dict[str, list[list[float]]],
    outputs: dict[str, list[tuple[np.ndarray, np.ndarray | None]]],
    ttfa: list[float],
    probe: dict[str, Any],
    n: int,
) -> EvalResult:
    own, lat = outputs[r.artifact_id], times[r.artifact_id]
    seconds = [len(a) / r.sample_rate for a, _ in own]
    sentences, phrases = _slices(plan, n)
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
    if r.kind == "onnx":  # a graph property: how ONNX Runtime's Core ML provider would split it
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
        result.samples = _samples(r, rows, own, None)
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
    result.samples = _samples(r, rows, own, clean)
    return result


def _samples(r: Runner, rows: list[dict[str, Any]], own: list[Any], clean: list[Any] | None) -> dict[str, Any]:
    picked = range(min(SAMPLE_CLIPS, len(rows)))
    return {"rate": r.sample_rate, "clips": [(rows[i]["utterance"], own[i][0], clean[i][0] if clean else None) for i in picked]}


def _score_wer(result: EvalResult, r: Runner, ref: Runner | None, plan: Plan, heard: dict[str, list[str]], n: int) -> None:
    from kokoro_opt.evaluate.asr import wer_metrics, word_error_rate

    texts = [u.sentence.text for u in plan.utterances[:n]]
    for row, text, said in zip(result.utterances, texts, heard[r.artifact_id], strict=True):
        row.update(transcript=said, wer=word_error_rate([text], [said]))
    sentences, _ = _slices(plan, n)  # corpus WER: sentences, as PESQ

    def pick(values: list[str]) -> list[str]:
        return [values[i] for i in sentences]

    reference = pick(heard[ref.artifact_id]) if ref else None
    result.metrics.update(wer_metrics(pick(texts), pick(heard[r.artifact_id]), reference))


def evaluate_artifacts(
    artifacts: list[Artifact],
    config: EvaluateConfig,
    tracking_uri: str | None = None,
    console: Console | None = None,
    *,
    peers: Collection[str] = (),
    force: bool = False,
    log: bool = True,
    root: Path | None = None,
) -> list[EvalResult]:
    """Each artifact against its fp32 reference (measured alongside); one MLflow run per (artifact,
    settings). An evaluation already logged is found and not repeated (resumable) unless `force`."""
    from kokoro_opt.evaluate import tracking
    from kokoro_opt.evaluate.report import pareto_png
    from kokoro_opt.evaluate.runners import runner_groups

    corpus = load_corpus()
    results = []
    for group in runner_groups(artifacts, root, peers=peers, console=console):
        subject = group[0]
        settings = evaluation_settings(config, corpus, subject.reference_id)
        key = tracking.evaluation_key(subject.artifact_id, settings)
        found = tracking.find_evaluation(tracking_uri, key) if log and not force else None
        if found is not None:
            results.append(found)
            continue
        loaded = _load_all(group, config.threads, console)
        if len(loaded) < len(group):
            continue
        measured = measure(loaded, config, corpus, console, probe=1)
        result = measured[0]
        if log:
            with tempfile.TemporaryDirectory(prefix="kokoro-opt-pareto-") as tmp:
                pareto = pareto_png(measured, Path(tmp) / "pareto.png")  # the artifact beside its reference
                result.run_id = tracking.log_evaluation(tracking_uri, result, subject, settings, key, pareto)
        results.append(result)
    return results


def compare_artifacts(
    artifacts: list[Artifact],
    config: EvaluateConfig,
    tracking_uri: str | None = None,
    console: Console | None = None,
    *,
    peers: Collection[str] = (),
    plot: Path | None = None,
    log: bool = True,
    root: Path | None = None,
    probe: int | None = None,
) -> tuple[list[EvalResult], Path | None]:
    """Every artifact, its reference and (optionally) the peers, all in ONE interleaved session.
    `probe`: memory-probe and edge-check only the first N models (the artifacts come first); all by default."""
    from kokoro_opt.evaluate import tracking
    from kokoro_opt.evaluate.report import pareto_png
    from kokoro_opt.evaluate.runners import runner_groups

    corpus = load_corpus()
    groups = runner_groups(artifacts, root, peers=peers, console=console)
    unique: dict[str, Runner] = {}
    for runner in [g[0] for g in groups] + [r for g in groups for r in g[1:]]:  # an artifact's own name beats "fp32 export"
        unique.setdefault(runner.artifact_id, runner)
    if not unique:
        raise UserError("nothing to compare", "build an artifact first (kokoro-opt build recipes/fp32.yaml) or pass --peers")
    loaded = _load_all(list(unique.values()), config.threads, console)
    if not loaded:
        raise UserError("no model could be loaded", "see the messages above")
    results = measure(loaded, config, corpus, console, probe=probe)
    png = pareto_png(results, plot) if plot else None
    if log:
        settings = evaluation_settings(config, corpus, None)
        for r in results:
            r.run_id = None
        tracking.log_comparison(tracking_uri, results, settings, png)
    return results, png


def _load_all(runners: list[Runner], threads: int, console: Console | None) -> list[Runner]:
    """Load what loads; a broken artifact is reported and skipped, not allowed to stop `evaluate all`."""
    loaded = []
    for r in runners:
        try:
            loaded.append(r.load(threads))
        except Exception as exc:  # ORT, torch and file errors all land here: report, go on
            message = f"{r.label} {r.artifact_id[:8]}: cannot be loaded, skipped ({exc})"
            (console or Console(stderr=True)).print(message, markup=False, highlight=False)
    return loaded


def evaluation_settings(config: EvaluateConfig, corpus: Corpus, reference_id: str | None) -> dict[str, Any]:
    """Everything that shapes the numbers: equal settings on the same artifact = the same evaluation.
    The machine counts by its id (CPU, ISA flags, OS, onnxruntime and torch versions) and core count."""
    machine = fingerprint()
    return {
        **config.model_dump(mode="json", exclude={"enabled"}),
        "corpus_sha256": corpus.sha256,
        "metrics_version": METRICS_VERSION,
        "reference_id": reference_id,
        "machine": f"{machine['cpu']} x{machine['cores']}",
        "machine_id": machine["id"],
    }
