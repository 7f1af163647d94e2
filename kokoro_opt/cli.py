"""The `kokoro-opt` command line: a thin shell over the library (kokoro_opt.build, .synth, ...)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kokoro_opt.errors import UserError
from kokoro_opt.tables import print_table

app = typer.Typer(
    help="Turn Kokoro-82M into the fastest artifact that still sounds like the original, measure it, serve it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
err = Console(stderr=True)

ArtifactsRoot = Annotated[Path, typer.Option("--artifacts", help="where artifacts are stored")]


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Print UserError as one line and exit 2: no traceback for mistakes in input."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            # escaped: messages carry paths and pip extras like kokoro-opt[coreml], which are not markup
            text = escape(exc.message + (f" — {exc.hint}" if exc.hint else ""))
            err.print(f"[bold red]error:[/] {text}", highlight=False)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted: completed stages stay cached; rerun the same command to resume")
            raise typer.Exit(130) from None

    return wrapper


@app.command()
@user_errors
def build(
    recipe: Annotated[Path, typer.Argument(help="a recipe YAML, e.g. recipes/int8-mixed.yaml")],
    artifacts: ArtifactsRoot = Path("artifacts"),
    evaluate: Annotated[bool, typer.Option(help="evaluate the artifact and log it to MLflow")] = True,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI (default: SQLite in experiments/)")] = None,
    reanalyze: Annotated[
        bool, typer.Option(help="measure the sensitivity decisions again instead of applying the recipe's lock, and rewrite it")
    ] = False,
    push: Annotated[bool, typer.Option(help="also log the artifact folder to MLflow's artifact store (kokoro-opt push)")] = False,
) -> None:
    """Build a recipe: weights, export, optimisation stages; every stage cached by content hash.

    Measured decisions are applied from the lock beside the recipe (recipes/<name>.lock.json) when
    its inputs match, and written there when they were measured."""
    from kokoro_opt.build import build as run_build
    from kokoro_opt.locks import lock_path
    from kokoro_opt.recipe import load_recipe

    parsed = load_recipe(recipe)
    result = run_build(parsed, artifacts, console=err, lock=lock_path(recipe), reanalyze=reanalyze)
    table = Table(title=f"{parsed.name} -> {result.artifact.path}")
    for column in ("stage", "key", "cached", "seconds"):
        table.add_column(column)
    for entry in result.stages:
        table.add_row(entry["kind"], entry["key"], "yes" if entry["cached"] else "no", f"{entry['seconds']:.1f}")
    print_table(console, table)
    if result.weights.note:
        console.print(f"note: {result.weights.note}")
    if evaluate and parsed.evaluate.enabled:
        from kokoro_opt.evaluate.run import evaluate_artifacts, print_results

        print_results(evaluate_artifacts([result.artifact], parsed.evaluate, tracking_uri=tracking_uri, console=err), console)
    if push:
        _push(result.artifact, tracking_uri, lock_path(recipe))


def _say(message: str) -> None:
    err.print(message, markup=False, highlight=False)


def _push(artifact: Any, tracking_uri: str | None, lock: Path | None = None) -> None:
    from kokoro_opt.evaluate.tracking import tracking_location
    from kokoro_opt.remote import push_artifact

    run_id = push_artifact(artifact, tracking_uri, say=_say, lock=lock)
    console.print(f"pushed {artifact.name} {artifact.id} to {tracking_location(tracking_uri)} (MLflow run {run_id}); "
                  f"elsewhere: kokoro-opt serve --artifact {artifact.id} --tracking-uri URI", highlight=False)  # fmt: skip


@app.command()
@user_errors
def push(
    artifact: Annotated[Path, typer.Argument(help="artifact folder, or a recipe's folder (its newest build)")],
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI, e.g. http://mlflow.internal:5000")] = None,
) -> None:
    """Log an artifact folder (and the fp32 export it was built from) to MLflow's artifact store, so
    other machines serve or evaluate it by id without building it."""
    from kokoro_opt.artifacts import open_artifact

    _push(open_artifact(artifact), tracking_uri)


@app.command()
@user_errors
def fetch(
    artifact_id: Annotated[str, typer.Argument(help="the artifact id (or its first characters)")],
    artifacts: ArtifactsRoot = Path("artifacts"),
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI it was pushed to")] = None,
) -> None:
    """Fetch a pushed artifact into the store, verifying every file against its manifest."""
    from kokoro_opt.remote import verify_folder
    from kokoro_opt.select import artifact_by_id

    found = artifact_by_id(artifact_id, artifacts, tracking_uri, say=_say)
    verify_folder(found.path, found.manifest, f"artifact {found.id} at {found.path}")  # also one that was already here
    console.print(f"{found.name} {found.id}: {found.path} (every file matches its manifest)", highlight=False)


@app.command()
@user_errors
def say(
    text: Annotated[str, typer.Argument(help="English text to speak")],
    artifact: Annotated[Path, typer.Option(help="artifact folder, or a recipe's folder (its newest build)")] = Path(
        "artifacts/fp32"
    ),
    output: Annotated[Path, typer.Option("-o", "--output", help="WAV file to write")] = Path("out.wav"),
    voice: Annotated[str, typer.Option(help="voice name or blend like jf_alpha(2)+jm_kumo(1)")] = "jf_alpha",
    speed: Annotated[float, typer.Option(help="0.25 to 4.0")] = 1.0,
) -> None:
    """Speak text with an artifact and write a 24 kHz WAV."""
    from rich.progress import Progress

    from kokoro_opt.audio import write_wav
    from kokoro_opt.runtime import synthesize

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("speaking", total=None)
        result = synthesize(
            artifact,
            text,
            voice=voice,
            speed=speed,
            on_chunk=lambda done, total: progress.update(task, completed=done, total=total),
        )
    write_wav(output, result.audio, result.sample_rate)
    console.print(f"wrote {output}: {result.seconds:.2f} s of audio at {result.sample_rate} Hz")


@app.command()
@user_errors
def voices(artifact: Annotated[Path, typer.Option(help="artifact folder")] = Path("artifacts/fp32")) -> None:
    """List the voices an artifact carries."""
    from kokoro_opt.artifacts import open_artifact

    for name in sorted(open_artifact(artifact).voice_packs()):
        console.print(name)


@app.command()
@user_errors
def serve(
    artifact: Annotated[str, typer.Option(help="'best', an artifact folder, or an artifact id")] = "best",
    artifacts: ArtifactsRoot = Path("artifacts"),
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI used by 'best'")] = None,
    host: Annotated[str, typer.Option(help="address to bind; loopback by default")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8880,
    api_key: Annotated[str | None, typer.Option(envvar="KOKORO_OPT_API_KEY", help="require this bearer token")] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="admitted requests at once; more get 429 (default: bench-serve --capacity's, else 4)")
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds a request may take in total")] = 300.0,
    max_input_chars: Annotated[int, typer.Option(help="longest input text")] = 4096,
    max_input_tokens: Annotated[
        int,
        typer.Option(help="most phoneme tokens an input may make after normalization (weighted by 1/speed below 1); more: 413"),
    ] = 6000,
    drain_timeout: Annotated[
        float, typer.Option(help="on SIGTERM, seconds the requests in flight get to finish (new ones get 503) before the exit")
    ] = 30.0,
    public_metrics: Annotated[bool, typer.Option(help="with --api-key, serve /metrics without the key")] = False,
    first_chunk_tokens: Annotated[int | None, typer.Option(help="first chunk size (default: tuned, else 40)")] = None,
    chunk_tokens: Annotated[int | None, typer.Option(help="largest later chunk (default: tuned, else 200)")] = None,
    crossfade_ms: Annotated[float | None, typer.Option(help="crossfade at chunk seams (default: tuned, else 10)")] = None,
    cap_edges: Annotated[
        bool, typer.Option(help="decode only part of each job's edge silence (needs an artifact with the edges stage)")
    ] = False,
    windowed: Annotated[
        bool | None,
        typer.Option(
            "--windowed/--no-windowed",
            help="stream window by window (default: on where the artifact's windows stage passed its gate)",
        ),
    ] = None,
    first_window_steps: Annotated[
        int | None, typer.Option(help="a new listener's first window in 12.5 ms steps (default: tuned, else the artifact's)")
    ] = None,
    audio_cache_mb: Annotated[float, typer.Option(help="responses kept to answer repeats at once; 0: off")] = 8.0,
    workers: Annotated[
        int, typer.Option(help="streams worked for at once, with --windowed: 2 gives fewer underruns, more memory")
    ] = 1,
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (POST /v1/audio/speech), streaming."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig, serve_forever
    from kokoro_opt.serve.config import mode_reason

    selection = resolve_artifact(artifact, artifacts, tracking_uri)
    chosen = selection.artifact
    err.print(f"serving {chosen.name} artifact {chosen.id} ({chosen.path}): {selection.reason}")
    config = ServeConfig.for_selection(
        selection,
        api_key=api_key,
        max_queue=max_queue,
        request_timeout=timeout,
        max_input_chars=max_input_chars,
        max_input_tokens=max_input_tokens,
        drain_timeout=drain_timeout,
        public_metrics=public_metrics,
        first_chunk_tokens=first_chunk_tokens,
        chunk_tokens=chunk_tokens,
        crossfade_ms=crossfade_ms,
        cap_edges=cap_edges or None,
        windowed=windowed,
        first_window_steps=first_window_steps,
        audio_cache_mb=audio_cache_mb,
        workers=workers,
    )
    err.print(f"mode: {config.mode()}" + mode_reason(chosen, windowed, config.windowed))
    err.print(
        f"admits {config.max_queue} requests at once" + ("" if max_queue is not None else " (bench-serve --capacity sets it)")
    )
    serve_forever(selection, config, host, port)


@app.command("bench-serve")
@user_errors
def bench_serve(
    url: Annotated[str | None, typer.Option(help="a running server, e.g. http://127.0.0.1:8880 (default: start one)")] = None,
    artifact: Annotated[str, typer.Option(help="artifact to serve when starting a server")] = "best",
    artifacts: ArtifactsRoot = Path("artifacts"),
    clients: Annotated[str, typer.Option(help="concurrent streaming clients per scenario, comma separated")] = "1,4",
    requests: Annotated[int, typer.Option(help="requests per client")] = 3,
    text: Annotated[str | None, typer.Option(help="text to speak (default: a 4-sentence paragraph)")] = None,
    voice: Annotated[str, typer.Option(help="voice")] = "alloy",
    response_format: Annotated[str, typer.Option("--format", help="pcm or wav")] = "pcm",
    full: Annotated[bool, typer.Option(help="also measure non-streaming full responses (the TTFA baseline)")] = True,
    max_queue: Annotated[int, typer.Option(help="queue limit of a started server")] = 4,
    api_key: Annotated[str | None, typer.Option(envvar="KOKORO_OPT_API_KEY", help="bearer token")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write every sample as JSON")] = None,
    phrases: Annotated[
        bool, typer.Option(help="also time short phrases alone ('button', 'checkbox checked', ...): the screen-reader case")
    ] = True,
    cap_edges: Annotated[bool, typer.Option(help="start the server with --cap-edges")] = False,
    windowed: Annotated[
        bool | None, typer.Option("--windowed/--no-windowed", help="start the server so (default: as serve decides)")
    ] = None,
    workers: Annotated[int, typer.Option(help="start the server with --workers")] = 1,
    capacity: Annotated[
        bool,
        typer.Option(
            help="find the most simultaneous real-time streams this machine sustains (0 underruns, TTFA p95 <= 0.5 s "
            "or twice one listener's alone, at most 1.5 s); recorded for serve's default --max-queue"
        ),
    ] = False,
) -> None:
    """Benchmark the server: TTFA p50/p95, full-response time, RTF, gaps and underruns, streaming vs not."""
    import json

    from kokoro_opt.serve import bench

    if url is None:  # the server's own rules, checked before one is started for nothing
        from kokoro_opt.serve import ServeConfig

        ServeConfig(windowed=windowed is not False, workers=workers)  # the artifact decides the rest when it starts
    args = bench.serve_args(url, artifact, artifacts, max_queue, bench.server_flags(cap_edges, windowed, workers), capacity)
    scenarios, served = bench.run(
        url,
        args,
        [int(c) for c in clients.split(",") if c.strip()],
        requests,
        text or bench.PARAGRAPH,
        voice,
        response_format,
        full,
        api_key,
        console,
        phrases=bench.PHRASES if phrases and not capacity else (),
        capacity=capacity,
    )
    if capacity:
        kept, where = bench.record_capacity(scenarios, served, artifacts)
        console.print(f"this machine sustains {kept.describe()}; `serve` admits that many by default ({where})")
    if json_out:
        json_out.write_text(json.dumps(bench.to_json(scenarios), indent=2), encoding="utf-8")
        console.print(f"wrote {json_out}")


# ---- evaluation (kokoro_opt.evaluate) ---------------------------------------------------------------

TrackingUri = Annotated[str | None, typer.Option(help="MLflow tracking URI (default: SQLite in experiments/)")]
Runs = Annotated[int | None, typer.Option(help="timed runs per utterance (default: the recipe's evaluate.runs)")]
Warmup = Annotated[int | None, typer.Option(help="warm-up runs per model before timing")]
Threads = Annotated[int | None, typer.Option(help="ORT intra-op threads (and torch threads for the eager peer)")]
Sentences = Annotated[int | None, typer.Option(help="how many corpus sentences to score")]
Phrases = Annotated[int | None, typer.Option(min=0, help="how many short phrases to score apart (0: none)")]
Asr = Annotated[bool | None, typer.Option("--asr/--no-asr", help="WER with the optional offline ASR")]
Peers = Annotated[bool, typer.Option(help="add both peers: kokoro-onnx's int8 model and PyTorch eager")]
Peer = Annotated[list[str] | None, typer.Option(help="add one peer: kokoro-onnx-int8 or pytorch-eager (repeatable)")]


def _peers(all_peers: bool, chosen: list[str] | None) -> tuple[str, ...]:
    from kokoro_opt.evaluate.runners import PEERS

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
    from kokoro_opt.targets import evaluation_targets

    overrides = {"runs": runs, "warmup": warmup, "threads": threads, "sentences": sentences, "phrases": phrases, "asr": asr}
    results: list[Any] = []
    for i, artifact in enumerate(evaluation_targets(targets, artifacts, tracking_uri, err, _say)):
        config = evaluate_config(artifact.manifest, **overrides)
        results += evaluate_artifacts(
            [artifact],
            config,
            tracking_uri=tracking_uri,
            console=err,
            peers=_peers(peers, peer) if i == 0 else (),
            force=force,
            root=artifacts,
        )
    if as_json:
        typer.echo(results_json(results))
    else:
        print_results(results, console)


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
    from kokoro_opt.machine import fingerprint
    from kokoro_opt.store import Store

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
            console.print(f"{r.label}: {note}", highlight=False)
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
    show: Annotated[bool, typer.Option("--show", help="print the Pareto front; without --trials, only that")] = False,
    artifacts: ArtifactsRoot = Path("artifacts"),
    tracking_uri: TrackingUri = None,
) -> None:
    """Tune inference settings (ORT options, chunking, artifact) with Optuna; the winner goes to tuned.json."""
    from kokoro_opt.tune import run_tuning, show_front

    if show and trials is None:
        show_front(recipe, storage=storage, study_name=study, root=artifacts, console=console)
        return
    run_tuning(recipe, trials=trials, workers=workers, storage=storage, study_name=study, seed=seed, root=artifacts,
               tracking_uri=tracking_uri, console=err, out=console)  # fmt: skip


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
