"""Measuring commands: `evaluate` and `compare` artifacts (kokoro_opt.evaluate), `tune` settings with Optuna."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kokoro_opt.cli.app import ArtifactsRoot, TrackingUri, app, console, err, say_line, user_errors
from kokoro_opt.errors import UserError
from kokoro_opt.tables import print_table

Runs = Annotated[
    int | None,
    typer.Option(help="timed runs per utterance (default: the recipe's evaluate.runs; compare: the first artifact's recipe's)"),
]
Warmup = Annotated[int | None, typer.Option(help="warm-up runs per model before timing")]
Threads = Annotated[int | None, typer.Option(help="ORT intra-op threads (and torch threads for the eager peer)")]
Sentences = Annotated[int | None, typer.Option(help="how many corpus sentences to score")]
Phrases = Annotated[int | None, typer.Option(min=0, help="how many short phrases to score apart (0: none)")]
Asr = Annotated[bool | None, typer.Option("--asr/--no-asr", help="WER with the optional offline ASR")]
Peers = Annotated[bool, typer.Option(help="add both peers: kokoro-onnx's int8 model and PyTorch eager")]
Peer = Annotated[list[str] | None, typer.Option(help="add one peer: kokoro-onnx-int8 or pytorch-eager (repeatable)")]


def _peers(all_peers: bool, chosen: list[str] | None) -> tuple[str, ...]:
    from kokoro_opt.evaluate.runners import PEERS, check_peers

    check_peers(chosen or ())  # before anything is built or measured
    return PEERS if all_peers else tuple(chosen or ())


AsJson = Annotated[bool, typer.Option("--json", help="print the results as JSON on stdout")]


@app.command()
@user_errors
def evaluate(
    targets: Annotated[list[str], typer.Argument(help="artifact folder(s), id(s), recipe YAML(s), or 'all'")],
    artifacts: ArtifactsRoot = Path("artifacts"),
    tracking_uri: TrackingUri = None,
    runs: Runs = None,
    warmup: Warmup = None,
    threads: Threads = None,
    sentences: Sentences = None,
    phrases: Phrases = None,
    asr: Asr = None,
    peers: Peers = False,
    peer: Peer = None,
    force: Annotated[bool, typer.Option(help="measure again even if these settings were already logged")] = False,
    as_json: AsJson = False,
) -> None:
    """Evaluate artifacts against their fp32 reference and log each to MLflow; already-logged evaluations are skipped."""
    from kokoro_opt.evaluate.report import results_json
    from kokoro_opt.evaluate.run import evaluate_artifacts, print_results
    from kokoro_opt.evaluate.settings import evaluate_config
    from kokoro_opt.evaluate.tracking_store import require_answers
    from kokoro_opt.runtime.availability import runtime_problem
    from kokoro_opt.targets import evaluation_targets

    overrides = {"runs": runs, "warmup": warmup, "threads": threads, "sentences": sentences, "phrases": phrases, "asr": asr}
    evaluate_config(None, **overrides)  # the settings given, checked before a recipe is built or anything measured
    _peers(peers, peer)
    require_answers(tracking_uri)  # where the results go: before minutes of measuring, not after
    found = evaluation_targets(targets, artifacts, tracking_uri, err, say_line)
    for artifact in found:  # a damaged one stops the command before anything is measured, not part-way
        artifact.check_intact()
    results: list[Any] = []
    missed = []
    for i, artifact in enumerate(found):
        config = evaluate_config(artifact.manifest, **overrides)
        measured = evaluate_artifacts(
            [artifact],
            config,
            tracking_uri=tracking_uri,
            console=err,
            peers=_peers(peers, peer) if i == 0 else (),
            force=force,
            root=artifacts,
        )
        ran = any(r.artifact_id == artifact.id for r in measured)  # its peers may have been measured without it
        if not ran and runtime_problem(artifact) is None:  # not one that cannot run here (Core ML off macOS)
            missed.append(f"{artifact.name} {artifact.id[:8]}")
        results += measured
    if as_json:
        typer.echo(results_json(results))
    else:
        print_results(results, console)
    if missed:
        raise UserError(f"not evaluated: {', '.join(missed)}", "see why above")


@app.command()
@user_errors
def compare(
    folders: Annotated[list[Path] | None, typer.Argument(help="artifact folders (default: all under --artifacts)")] = None,
    artifacts: ArtifactsRoot = Path("artifacts"),
    peers: Peers = False,
    peer: Peer = None,
    tracking_uri: TrackingUri = None,
    runs: Runs = None,
    warmup: Warmup = None,
    threads: Threads = None,
    sentences: Sentences = None,
    phrases: Phrases = None,
    asr: Asr = None,
    plot: Annotated[Path, typer.Option(help="Pareto plot (RTF vs PESQ and WER) PNG")] = Path("experiments/pareto.png"),
    log: Annotated[bool, typer.Option(help="log the comparison to MLflow")] = True,
    as_json: AsJson = False,
) -> None:
    """One table across artifacts (and peers), all measured side by side in one interleaved session."""
    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.evaluate.report import DETAIL_COLUMNS, print_machine, results_json, results_table
    from kokoro_opt.evaluate.run import compare_artifacts
    from kokoro_opt.evaluate.settings import evaluate_config
    from kokoro_opt.evaluate.tracking_store import require_answers
    from kokoro_opt.machine import fingerprint
    from kokoro_opt.paths import output_file
    from kokoro_opt.store import Store

    if not log and tracking_uri is not None:
        from kokoro_opt.errors import UserError

        raise UserError("--tracking-uri would change nothing with --no-log", "drop it, or drop --no-log")
    if log:
        require_answers(tracking_uri)  # where the comparison goes: before the measuring, not after
    output_file(plot, ".png", "experiments/pareto.png")
    chosen = [open_artifact(f) for f in folders] if folders else Store(artifacts).artifacts()
    config = evaluate_config(
        chosen[0].manifest if chosen else None,
        runs=runs, warmup=warmup, threads=threads, sentences=sentences, phrases=phrases, asr=asr,
    )  # fmt: skip
    results, png = compare_artifacts(
        chosen, config, tracking_uri, console=err, peers=_peers(peers, peer), plot=plot, log=log, root=artifacts
    )
    if as_json:
        extra = {"settings": config.model_dump(mode="json"), "plot": str(png) if png else None, "machine": fingerprint()}
        typer.echo(results_json(results, extra))
        return
    n = int(results[0].metric("utterances")) if results else 0
    title = f"compare: {n} utterances x {config.runs} runs, {config.threads} threads, interleaved"
    print_machine(console)
    print_table(console, results_table(results, title))
    print_table(console, results_table(results, "details (latency in seconds per utterance)", DETAIL_COLUMNS))
    for r in results:
        for note in r.notes:
            console.print(f"{r.label}: {note}", markup=False, highlight=False)
    console.print(f"Pareto plot: {png}" if png else "Pareto plot: nothing to plot (no PESQ measured)")
    if log and results and results[0].run_id:
        console.print(f"logged to MLflow run {results[0].run_id} (experiment kokoro-opt-compare)")


@app.command()
@user_errors
def tune(
    recipe: Annotated[Path, typer.Argument(help="a tuning recipe")] = Path("recipes/tune-cpu.yaml"),
    trials: Annotated[int | None, typer.Option(help="finished trials the study should hold (a rerun resumes)")] = None,
    workers: Annotated[int, typer.Option(help="worker processes on this machine, sharing the study")] = 1,
    storage: Annotated[str | None, typer.Option(help="Optuna RDB URL, e.g. postgresql://... (default: the recipe's)")] = None,
    study: Annotated[str | None, typer.Option(help="study name (default: the recipe's)")] = None,
    seed: Annotated[int | None, typer.Option(help="sampler seed (default: the recipe's); use another one per machine")] = None,
    show: Annotated[
        bool, typer.Option("--show", help="print the Pareto front and write its plots; without --trials, only that")
    ] = False,
    artifacts: ArtifactsRoot = Path("artifacts"),
    tracking_uri: TrackingUri = None,
) -> None:
    """Tune inference settings (ORT options, chunking, artifact) with Optuna; the winner goes to tuned.json."""
    from kokoro_opt.tune import run_tuning, show_front

    if show and trials is None:
        ignored = [name for name, value in (("--workers", workers != 1), ("--seed", seed is not None),
                                            ("--tracking-uri", tracking_uri is not None)) if value]  # fmt: skip
        if ignored:
            raise UserError(f"--show alone runs no trial: {', '.join(ignored)} would change nothing", "drop it, or add --trials")
        show_front(recipe, storage=storage, study_name=study, root=artifacts, console=console)
        return
    run_tuning(recipe, trials=trials, workers=workers, storage=storage, study_name=study, seed=seed, root=artifacts,
               tracking_uri=tracking_uri, console=err, out=console)  # fmt: skip
