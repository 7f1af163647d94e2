"""Commands over artifact folders: build a recipe, push and fetch artifacts, speak with one, list its voices."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kokoro_opt.cli.app import ARTIFACT_HELP, ArtifactsRoot, TrackingUri, app, console, err, say_line, user_errors
from kokoro_opt.errors import UserError
from kokoro_opt.tables import print_table


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

    Measured decisions come from the lock beside the recipe (recipes/<name>.lock.json) where it fits, else are written there."""
    from kokoro_opt.build import build as run_build
    from kokoro_opt.build import chain_of
    from kokoro_opt.locks import lock_path
    from kokoro_opt.recipe import load_recipe

    parsed = load_recipe(recipe)
    evaluates = evaluate and parsed.evaluate.enabled
    if tracking_uri is not None and not (push or evaluates):
        raise UserError("--tracking-uri would change nothing: this build neither evaluates nor pushes", "drop it, or add --push")
    if reanalyze and not any(p.decides for p in chain_of(parsed)):
        raise UserError(f"--reanalyze would change nothing: recipe {parsed.name} measures no decisions", "drop it")
    if push or evaluates:  # a store that does not answer: before the build, not after
        from kokoro_opt.evaluate.tracking_store import require_answers

        require_answers(tracking_uri)
    result = run_build(parsed, artifacts, console=err, lock=lock_path(recipe), reanalyze=reanalyze)
    table = Table(title=f"{parsed.name} -> {result.artifact.path}")
    for column in ("stage", "key", "cached", "seconds"):
        table.add_column(column)
    for entry in result.stages:
        table.add_row(entry["kind"], entry["key"], "yes" if entry["cached"] else "no", f"{entry['seconds']:.1f}")
    print_table(console, table)
    if result.weights.note:
        console.print(f"note: {result.weights.note}")
    if evaluates:
        from kokoro_opt.evaluate.run import evaluate_artifacts, print_results

        print_results(evaluate_artifacts([result.artifact], parsed.evaluate, tracking_uri=tracking_uri, console=err), console)
    if push:
        _push(result.artifact, tracking_uri, result.locks)


def _push(artifact: Any, tracking_uri: str | None, locks: tuple[Path, ...] = ()) -> None:
    from kokoro_opt.evaluate.tracking_store import tracking_location
    from kokoro_opt.remote import push_artifact

    run_id = push_artifact(artifact, tracking_uri, say=say_line, locks=locks)
    console.print(f"pushed {artifact.name} {artifact.id} to {tracking_location(tracking_uri)} (MLflow run {run_id}); "
                  f"elsewhere: kokoro-opt serve --artifact {artifact.id} --tracking-uri URI", highlight=False)  # fmt: skip


@app.command()
@user_errors
def push(
    artifact: Annotated[Path, typer.Argument(help="artifact folder, or a recipe's folder (its newest build)")],
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI, e.g. http://mlflow.internal:5000")] = None,
) -> None:
    """Log an artifact folder (and the fp32 export it was built from) to MLflow's artifact store.

    Other machines then fetch, serve or evaluate it by id without building it."""
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
    from kokoro_opt.artifacts import remove_stale_temporaries
    from kokoro_opt.remote import fetch_artifact
    from kokoro_opt.select import artifact_by_id, export_missing

    remove_stale_temporaries(artifacts)  # what a killed fetch left, unless a fetch of it runs now
    found = artifact_by_id(artifact_id, artifacts, tracking_uri, say=say_line)  # verified, fetched again if damaged
    if export_missing(artifacts, found):  # a fetch killed before its fp32 export arrived: completed now, if pushed
        fetch_artifact(found.id, artifacts, tracking_uri, say_line)
    console.print(f"{found.name} {found.id}: {found.path} (every file matches its manifest)", highlight=False)


STDIO = "-"  # say's text and output: standard input, standard output


def not_utf8(argument: str) -> int | None:
    """Where a command-line argument was not UTF-8: Python keeps such bytes as lone surrogates (surrogateescape)."""
    from kokoro_opt.characters import lone_surrogate

    if (position := lone_surrogate(argument)) is None:
        return None
    return len(argument[:position].encode("utf-8", "surrogateescape"))  # the byte offset, as given


def piped_text() -> str:
    """What is piped to `say -`: UTF-8 text (a terminal would wait for typing that says when it ends)."""
    if sys.stdin is None or sys.stdin.isatty():
        raise UserError("say - reads the text from standard input, and nothing is piped in", "kokoro-opt say - < chapter.txt")
    try:
        text = sys.stdin.buffer.read().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"the text piped in is not UTF-8 (byte {exc.start})", "convert it first, e.g. with iconv -t UTF-8"
        ) from None
    if not text.strip():
        raise UserError("nothing was piped in to say", "kokoro-opt say - < chapter.txt")
    return text


@app.command()
@user_errors
def say(
    text: Annotated[
        str,
        typer.Argument(help="English text to speak, or - to read it from standard input (text starting with '-': after --)"),
    ],
    artifact: Annotated[str, typer.Option(help=ARTIFACT_HELP)] = "best",
    artifacts: ArtifactsRoot = Path("artifacts"),
    output: Annotated[
        Path, typer.Option("-o", "--output", help="WAV file to write; - writes it to standard output (pipe it to a player)")
    ] = Path("out.wav"),
    voice: Annotated[
        str,
        typer.Option(
            help="voice name, an OpenAI name (alloy, ...: every artifact has them), or a blend like jf_alpha(2)+jm_kumo(1)"
        ),
    ] = "alloy",
    speed: Annotated[float, typer.Option(min=0.25, max=4.0, help="0.25 to 4.0")] = 1.0,
    tracking_uri: TrackingUri = None,
) -> None:
    """Speak text with an artifact and write a 24 kHz WAV."""
    from kokoro_opt.audio import wav_bytes, wav_target, write_wav
    from kokoro_opt.characters import latin_share
    from kokoro_opt.runtime import open_synthesizer
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.tables import make_progress
    from kokoro_opt.voices import check_voice

    to_stdout = output == Path(STDIO)
    if to_stdout and sys.stdout.isatty():  # 50 KB of binary a second of audio, read out, and escapes the terminal obeys
        raise UserError("-o - writes the WAV to standard output, and that is a terminal", "pipe it: -o - | aplay")
    if not to_stdout:
        wav_target(output)  # before the model loads and speaks
    if text == STDIO:
        text = piped_text()
    elif (byte := not_utf8(text)) is not None:
        raise UserError(f"the text given is not UTF-8 (byte {byte})", "give it in UTF-8, or convert it: iconv -t UTF-8 | say -")
    if latin_share(text) < 0.5:
        err.print("note: most of this text is not in the Latin script; the model speaks English, and reads other "
                  "scripts by their letters' names", highlight=False)  # fmt: skip
    selection = resolve_artifact(artifact, artifacts, tracking_uri)  # with the session settings tuned for it here
    chosen = selection.artifact
    check_voice(voice, chosen.voice_names)  # before the model loads
    err.print(f"speaking with {chosen.name} {chosen.id} ({chosen.path})", highlight=False)
    speaker = open_synthesizer(chosen, selection.settings)
    with make_progress(console=err, transient=True) as progress:
        task = progress.add_task("speaking", total=None)
        result = speaker.synthesize(
            text,
            voice=voice,
            speed=speed,
            on_chunk=lambda done, total: progress.update(task, completed=done, total=total),
        )
    if to_stdout:
        try:
            sys.stdout.buffer.write(wav_bytes(result.audio, result.sample_rate))
            sys.stdout.buffer.flush()
        except BrokenPipeError:  # the reader stopped early (`| head`): its choice, not an error; nothing more to flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
        err.print(f"wrote {result.seconds:.2f} s of audio at {result.sample_rate} Hz to standard output")
    else:
        write_wav(output, result.audio, result.sample_rate)
        console.print(f"wrote {output}: {result.seconds:.2f} s of audio at {result.sample_rate} Hz")


@app.command()
@user_errors
def voices(
    artifact: Annotated[str, typer.Option(help=ARTIFACT_HELP)] = "best",
    artifacts: ArtifactsRoot = Path("artifacts"),
    tracking_uri: TrackingUri = None,
) -> None:
    """List the voices an artifact carries, then the OpenAI names and the voice each stands for."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.voices import openai_voice_map

    packs = resolve_artifact(artifact, artifacts, tracking_uri, runs_here=False).artifact.voice_packs()
    for name in sorted(packs):
        console.print(name)
    for name, target in openai_voice_map(list(packs)).items():
        console.print(f"{name} -> {target}", highlight=False)
