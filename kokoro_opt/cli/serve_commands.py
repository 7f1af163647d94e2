"""Serving commands: `serve` an artifact over the OpenAI-compatible API, and `bench-serve` a server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kokoro_opt.cli.app import ARTIFACT_HELP, ArtifactsRoot, app, console, err, say_line, user_errors


@app.command()
@user_errors
def serve(
    artifact: Annotated[str, typer.Option(help=ARTIFACT_HELP)] = "best",
    artifacts: ArtifactsRoot = Path("artifacts"),
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI used by 'best'")] = None,
    host: Annotated[str, typer.Option(help="address to bind; loopback by default")] = "127.0.0.1",
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(help="on a loopback address, a Host name answered besides this machine's (a reverse proxy's; '*': any)"),
    ] = None,
    port: Annotated[int, typer.Option(help="TCP port (0: any free one)", min=0, max=65535)] = 8880,
    api_key: Annotated[str | None, typer.Option(envvar="KOKORO_OPT_API_KEY", help="require this bearer token")] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="admitted requests at once; more get 429 (default: bench-serve --capacity's, else 4)")
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds a whole answer may take; a stream's next audio, as it plays")] = 300.0,
    body_timeout: Annotated[
        float, typer.Option(help="seconds a request's body may take to arrive (a stalled upload gets 408)")
    ] = 30.0,
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
    chunk_tokens: Annotated[int | None, typer.Option(help="largest later chunk, at most 510 (default: tuned, else 200)")] = None,
    crossfade_ms: Annotated[float | None, typer.Option(help="crossfade at chunk seams (default: tuned, else 10)")] = None,
    context_words: Annotated[
        int | None,
        typer.Option(
            help="words fed on each side of a cut inside a sentence, so neither side is spoken as an utterance's "
            "end or start, 0 to 8 (default 2; 0: none)"
        ),
    ] = None,
    cap_edges: Annotated[
        bool, typer.Option(help="decode only part of each job's edge silence (needs an artifact with the edges stage)")
    ] = False,
    windowed: Annotated[
        bool | None,
        typer.Option(
            "--windowed/--no-windowed",
            help="stream window by window (default: on where the artifact's windows stage measured the windowed speech "
            "within its default_budget: PESQ-WB >= 4.3 on sentences and 4.2 on phrases vs whole decoding)",
        ),
    ] = None,
    first_window_steps: Annotated[
        int | None,
        typer.Option(help="a new listener's first window in 12.5 ms steps, 4 to 400 (default: tuned, else the artifact's)"),
    ] = None,
    audio_cache_mb: Annotated[float, typer.Option(help="responses kept to answer repeats at once; 0: off")] = 8.0,
    workers: Annotated[
        int,
        typer.Option(help="streams worked for at once, 1 or 2; 2 (windowed): more listeners, half the threads each, more memory"),
    ] = 1,
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (POST /v1/audio/speech), streaming."""
    from kokoro_opt.select import resolve_artifact
    from kokoro_opt.serve import ServeConfig, serve_forever
    from kokoro_opt.serve.config import mode_reason

    # flags wrong on their own: before any artifact is sought (which may read MLflow, hash files, fetch)
    ServeConfig(api_key=api_key, public_metrics=public_metrics, allowed_hosts=tuple(allowed_host or ()))
    selection = resolve_artifact(artifact, artifacts, tracking_uri)
    chosen = selection.artifact
    # the reason and the mode's quote text from MLflow tags and build.json, which others write: no markup
    say_line(f"serving {chosen.name} artifact {chosen.id} ({chosen.path}): {selection.reason}")
    config = ServeConfig.for_selection(
        selection,
        api_key=api_key,
        allowed_hosts=tuple(allowed_host or ()) or None,
        max_queue=max_queue,
        request_timeout=timeout,
        body_timeout=body_timeout,
        max_input_chars=max_input_chars,
        max_input_tokens=max_input_tokens,
        drain_timeout=drain_timeout,
        public_metrics=public_metrics,
        first_chunk_tokens=first_chunk_tokens,
        chunk_tokens=chunk_tokens,
        crossfade_ms=crossfade_ms,
        context_words=context_words,
        cap_edges=cap_edges or None,
        windowed=windowed,
        first_window_steps=first_window_steps,
        audio_cache_mb=audio_cache_mb,
        workers=workers,
    )
    say_line(f"mode: {config.mode()}" + mode_reason(chosen, windowed, config.windowed, config.cap_edges))
    err.print(config.admission(selection, asked=max_queue is not None))
    serve_forever(selection, config, host, port)


@app.command("bench-serve")
@user_errors
def bench_serve(
    url: Annotated[str | None, typer.Option(help="a running server, e.g. http://127.0.0.1:8880 (default: start one)")] = None,
    artifact: Annotated[
        str | None, typer.Option(help="the artifact a started server serves (default best): " + ARTIFACT_HELP)
    ] = None,
    artifacts: ArtifactsRoot = Path("artifacts"),
    clients: Annotated[
        str | None, typer.Option(help="streaming clients started together per scenario, comma separated (default 1,4)")
    ] = None,
    requests: Annotated[int, typer.Option(min=1, help="requests per client")] = 3,
    text: Annotated[str | None, typer.Option(help="text to speak (default: a 4-sentence paragraph)")] = None,
    voice: Annotated[str, typer.Option(help="voice")] = "alloy",
    response_format: Annotated[str, typer.Option("--format", help="pcm or wav")] = "pcm",
    full: Annotated[
        bool | None, typer.Option(help="also measure non-streaming full responses, the TTFA baseline (default: on)")
    ] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="queue limit of a started server (default: the largest --clients count)")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="KOKORO_OPT_API_KEY", help="bearer token")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write every sample as JSON")] = None,
    phrases: Annotated[
        bool | None,
        typer.Option(help="also time short phrases alone ('button', 'checkbox checked', ...): screen readers (default: on)"),
    ] = None,
    cap_edges: Annotated[bool, typer.Option(help="start the server with --cap-edges")] = False,
    windowed: Annotated[
        bool | None, typer.Option("--windowed/--no-windowed", help="start the server so (default: as serve decides)")
    ] = None,
    workers: Annotated[int, typer.Option(help="start the server with --workers")] = 1,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI a started server resolves 'best' with")] = None,
    capacity: Annotated[
        bool,
        typer.Option(
            help="find the most simultaneous real-time streams this machine sustains (0 underruns, TTFA p95 <= 0.5 s "
            "or twice one listener's alone, at most 1.5 s); recorded for serve's default --max-queue"
        ),
    ] = False,
) -> None:
    """Benchmark the server: TTFA p50/p95, full-response time, RTF, gaps and underruns, streaming vs not."""
    from kokoro_opt.artifacts import write_json_atomic
    from kokoro_opt.errors import UserError
    from kokoro_opt.paths import output_file
    from kokoro_opt.serve import bench

    if capacity and url is not None:  # a running server admits its own --max-queue, and may run on another machine
        raise UserError("--capacity measures this machine with a server it starts (admitting every count it tries)",
                        "drop --url")  # fmt: skip
    if capacity:  # the probe picks its counts and measures the default paragraph alone: serve's queue limit is for it
        bench.capacity_conflicts(clients=clients, text=text, full=full, phrases=phrases, max_queue=max_queue)
    if url is None:  # the server's own rules, checked before one is started for nothing
        from kokoro_opt.serve import ServeConfig

        ServeConfig(windowed=windowed is not False, workers=workers)  # the artifact decides the rest when it starts
    counts = bench.client_counts(clients if clients is not None else "1,4")
    bench.check_format(response_format)  # before a server is started for it
    if text is not None and not text.strip():
        raise UserError("--text is empty", "give words to speak, or omit --text for the default paragraph")
    if json_out is not None:
        output_file(json_out, ".json", "bench.json")  # before the run, not after it
    flags = bench.server_flags(cap_edges, windowed, workers, tracking_uri)
    flags += [f"--max-queue {max_queue}"] * (max_queue is not None and url is not None)
    flags += [f"--artifact {artifact}"] * (artifact is not None and url is not None)
    queue = max_queue if max_queue is not None else max(counts)
    args = bench.serve_args(url, artifact or "best", artifacts, queue, flags, capacity)
    store_root = bench.probed_store(artifact or "best", artifacts, tracking_uri) if capacity else artifacts
    scenarios, served = bench.run(
        url,
        args,
        counts,
        requests,
        text or bench.PARAGRAPH,
        voice,
        response_format,
        full is not False,
        api_key,
        console,
        phrases=bench.PHRASES if phrases is not False and not capacity else (),
        probe=capacity,
    )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(json_out, bench.to_json(scenarios))
        console.print(f"wrote {json_out}")
    if failed := bench.failures(scenarios, probe=capacity):  # not a measurement of the server's speed, nor a capacity
        raise UserError(failed, "the errors are under the table")
    if capacity:
        kept, where = bench.keep_probe_result(scenarios, served, store_root)
        admits = f"{kept.admits} request{'s' if kept.admits > 1 else ''} at once"
        console.print(f"this machine sustains {kept.describe()}; `serve` admits {admits} by default ({where})")
