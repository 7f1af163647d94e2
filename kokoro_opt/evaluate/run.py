"""Measure models side by side: the timed phases (load, warm-up, interleaved runs, first audio, memory probe), then
the scores (evaluate/scoring.py: quality vs the fp32 export of the same weights, WER) and the MLflow records.

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
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

from kokoro_opt.artifacts import Artifact
from kokoro_opt.contract import code_key
from kokoro_opt.errors import UserError
from kokoro_opt.evaluate.asr import asr_installed
from kokoro_opt.evaluate.corpus import Corpus, load_corpus
from kokoro_opt.evaluate.edge import check_edge_inputs, edge_token_inputs
from kokoro_opt.evaluate.probe import probe_runner
from kokoro_opt.evaluate.report import EvalResult, print_results
from kokoro_opt.evaluate.runners import Runner
from kokoro_opt.evaluate.scoring import Session, result_of
from kokoro_opt.machine import fingerprint
from kokoro_opt.recipe import EvaluateConfig
from kokoro_opt.tables import make_progress

__all__ = ["Runner", "compare_artifacts", "evaluate_artifacts", "measure", "print_results"]

METRICS_VERSION = "2"  # bump when a metric's definition changes: old evaluations stop matching


# ---- one measurement session --------------------------------------------------------------------


@contextmanager
def _progress(console: Console | None, total: int) -> Iterator[Callable[[str], None]]:
    with make_progress(
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
    `probe`: memory/profile-probe, Core ML partition analysis and edge-check only the first N runners (the others are there as
    references: their timing and audio are what the first N are compared with)."""
    began = _epoch_ms()
    plans = {r.artifact_id: r.plan(corpus, config) for r in runners}
    session = Session(runners, plans, min(len(p.utterances) for p in plans.values()))
    asr, asr_note = None, ""
    if config.asr:
        from kokoro_opt.evaluate.asr import load_asr

        asr, asr_note = load_asr(config.threads)
    probed = runners[: len(runners) if probe is None else probe]
    n, windowed = session.n, len(session.streamed)
    steps = len(runners) * (config.warmup + (n + 1) * config.runs + (n if asr else 0)) + 2 * len(probed)
    with _progress(console, steps + windowed * (n + config.runs)) as tick:
        _time_utterances(session, config, tick)
        _time_first_audio(session, config.runs, tick)
        for r in runners:  # what a stream hears, scored like the whole decoding
            for i in range(n if r.windows is not None else 0):
                session.streamed[r.artifact_id].speech.append(r.windowed(plans[r.artifact_id], i))
                tick(f"windowed speech {i + 1}/{n} {r.label}")
        for r in probed:  # after timing and one at a time: a probe must not steal the timed cores
            session.probes[r.artifact_id] = probe_runner(r, plans[r.artifact_id], config)
            tick(f"memory/profile probe {r.label}")
        for r in probed:
            voice = plans[r.artifact_id].utterances[0].voice
            edge_inputs = edge_token_inputs(r.vocab, corpus.paragraph)
            session.edges[r.artifact_id] = check_edge_inputs(lambda t, r=r, v=voice: r.synth_tokens(t, v)[0], edge_inputs)
            tick(f"edge inputs {r.label}")
        for r in runners if asr else []:
            session.heard[r.artifact_id] = []
            for audio, _ in session.outputs[r.artifact_id]:
                session.heard[r.artifact_id].append(asr.transcribe(audio, r.sample_rate))
                tick(f"ASR {r.label}")
    span = (began, _epoch_ms())
    return [result_of(session, r, span, config.asr, asr_note) for r in runners]


def _time_utterances(session: Session, config: EvaluateConfig, tick: Callable[[str], None]) -> None:
    """Warm-up on the longest utterance (arenas are sized before any timing), then every utterance `runs` times,
    the runners' order rotated from one run to the next."""
    for r in session.runners:
        plan = session.plans[r.artifact_id]
        for _ in range(config.warmup):
            r.synth(plan, max(range(session.n), key=lambda i, p=plan: len(p.tokens[i])))
            tick(f"warm-up {r.label}")
    for i in range(session.n):
        for k in range(config.runs):
            for r in session.rotated(i * config.runs + k):
                started = time.perf_counter()
                out = r.synth(session.plans[r.artifact_id], i)
                session.times[r.artifact_id][i].append(time.perf_counter() - started)
                if k == 0:
                    session.outputs[r.artifact_id].append(out)
                tick(f"utterance {i + 1}/{session.n} {r.label}")


def _time_first_audio(session: Session, runs: int, tick: Callable[[str], None]) -> None:
    """The paragraph's first chunk decoded whole, and a windowed artifact's first window after its front."""
    for k in range(runs):
        for r in session.rotated(k):
            plan = session.plans[r.artifact_id]
            started = time.perf_counter()
            r.synth_tokens(plan.first_chunk, plan.utterances[0].voice)
            session.ttfa[r.artifact_id].append(time.perf_counter() - started)
            tick(f"first chunk {r.label}")
            if r.windows is not None:
                started = time.perf_counter()
                r.windowed_first_audio(plan.first_chunk, plan.utterances[0].voice)
                session.streamed[r.artifact_id].first_audio.append(time.perf_counter() - started)
                tick(f"first window {r.label}")


def _epoch_ms() -> int:
    return int(time.time() * 1000)


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
        needs = "wer" if config.asr and asr_installed() else None  # a run without it, if ASR can hear now: again
        found = tracking.find_evaluation(tracking_uri, key, needs) if log and not force else None
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
        # the text front-end's code: a rule that reads the corpus otherwise makes other utterances of the same texts
        "text_frontend": code_key("kokoro_opt.text"),
        "reference_id": reference_id,
        "machine": f"{machine['cpu']} x{machine['cores']}",
        "machine_id": machine["id"],
    }
