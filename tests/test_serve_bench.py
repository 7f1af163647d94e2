"""`kokoro-opt bench-serve` end to end: it starts `kokoro-opt serve` itself and measures it."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kokoro_opt.cli import app
from kokoro_opt.errors import UserError
from kokoro_opt.serve import bench, spawn

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast


def test_bench_starts_a_server_and_reports(tiny_artifact) -> None:
    out = io.StringIO()
    console = Console(file=out, width=200)
    args = ["--artifact", str(tiny_artifact.path)]
    phrases = ("button", "checkbox checked")
    scenarios, served = bench.run(
        None, args, [1, 2], 1, "Hello there. How are you today?", "alloy", "wav", True, None, console, phrases=phrases
    )
    assert served["id"] == tiny_artifact.id and served["mode"] == "whole" and served["workers"] == 1
    summary = {(s.mode, s.clients): s.summary() for s in scenarios if not s.text}
    full, single, crowd = summary["full", 1], summary["stream", 1], summary["stream", 2]
    assert full["ok"] == single["ok"] == 1 and full["errors"] == single["errors"] == 0
    assert single["ttfa_p50"] <= single["total_p50"] and single["audio_s"] > 0.5
    assert crowd["ok"] == 2 and crowd["rejected_429"] == crowd["errors"] == 0
    text = out.getvalue()
    assert tiny_artifact.id in text and "TTFA p50" in text and "ratio" in text
    assert json.dumps(bench.to_json(scenarios))  # serializable for --json
    # the server's memory, read from its /metrics after each scenario
    assert 50 < single["rss_mb"] <= single["peak_rss_mb"] < 4000 and "RSS MB" in text
    # each short phrase alone: streaming first bytes, the complete wav (both synthesized), then a repeat
    alone = {(s.text, s.mode): s.summary() for s in scenarios if s.text}
    assert set(alone) == {(p, m) for p in phrases for m in ("stream", "full", "repeat")}
    assert all(v["ok"] == 1 and v["ttfa_p50"] <= v["total_p50"] for v in alone.values())
    assert "short phrases" in text and "checkbox checked" in text and "first bytes p50" in text
    assert "repeat p50" in text and "not from the audio cache" in text


def test_bench_against_nothing_is_a_clean_error() -> None:
    result = CliRunner().invoke(app, ["bench-serve", "--url", "http://127.0.0.1:9", "--clients", "1"])
    assert result.exit_code == 2 and "cannot reach" in result.output


def test_a_server_that_fails_to_start_reports_its_whole_error(tiny_artifact) -> None:
    # the message and its hint are longer than the 80 columns the CLI's console wraps a file at
    with pytest.raises(UserError) as failed, spawn.spawned_server(["--artifact", str(tiny_artifact.path), "--windowed"]):
        pass
    message = str(failed.value)
    assert message.startswith("the server exited with code 2: windowed needs an ONNX artifact built with the windows stage")
    assert message.endswith("serve an artifact built with it, or drop --windowed")
    # without an `error:` block (a crash), the traceback's last line names the exception
    assert spawn.startup_error("Traceback (most recent call last):\n  ...\nMemoryError: out\n") == "MemoryError: out"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--json", "samples.txt"], "samples.txt is not a .json file name"),
        (["--text", "  "], "--text is empty"),
        (["--requests", "0"], "Invalid value for '--requests'"),
        (["--max-queue", "2", "--artifact", "artifacts/fp32"], "--max-queue 2 --artifact artifacts/fp32 set up a server"),
        (["--capacity"], "--capacity measures this machine with a server it starts"),  # not one capped by its queue
    ],
)  # fmt: skip
def test_bench_refuses_what_it_would_not_use_before_it_measures(args: list[str], says: str) -> None:
    result = CliRunner().invoke(app, ["bench-serve", "--url", "http://127.0.0.1:9", "--clients", "1", *args])
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("args", [["--clients", "1,8"], ["--text", "Hi."], ["--no-phrases"], ["--max-queue", "8"]])
def test_a_capacity_probe_refuses_what_it_would_pass_over(args: list[str]) -> None:
    """The probe picks its counts and measures the paragraph serve's default queue limit is for: before a server starts."""
    result = CliRunner().invoke(app, ["bench-serve", "--capacity", *args])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "--capacity picks its own client counts and text" in said and f"drop {args[0]}" in said


def test_a_bench_whose_requests_failed_exits_with_an_error(url: str, tmp_path) -> None:
    samples = tmp_path / "runs" / "bench.json"
    args = ["--url", url, "--clients", "1", "--requests", "1", "--no-full", "--no-phrases", "--json", str(samples)]
    result = CliRunner().invoke(app, ["bench-serve", *args, "--voice", "nobody"])
    assert result.exit_code == 2 and "1 of 1 requests failed (first: HTTP 400: unknown voice 'nobody'" in result.output
    assert json.loads(samples.read_text())[0]["samples"][0]["status"] == 400  # kept: what failed is worth reading
    wrong_base = CliRunner().invoke(app, ["bench-serve", "--url", f"{url}/v1", "--clients", "1"])
    assert wrong_base.exit_code == 2 and "not a kokoro-opt server's address" in wrong_base.output


def test_a_capacity_probe_fails_only_on_what_a_lone_listener_cannot_get() -> None:
    """Past the count a machine carries, requests may time out: that is what a probe looks for, not a failure."""
    from kokoro_opt.serve.bench import failures
    from kokoro_opt.serve.scenario import Sample, Scenario

    fed = Scenario("stream", 1, [Sample(200, 0.1, 1.0, 2.0)])
    overloaded = Scenario("stream", 8, [Sample(200, 0.1, 1.0, 2.0), Sample(504, error="the request took too long")])
    assert failures([fed, overloaded], probe=True) is None
    assert failures([fed, overloaded]) == "1 of 3 requests failed (first: HTTP 504: the request took too long)"
    refused = Scenario("stream", 1, [Sample(400, error="unknown voice 'nobody'")])
    assert failures([refused], probe=True) == "1 of 1 requests failed (first: HTTP 400: unknown voice 'nobody')"


def test_serve_on_a_port_in_use_is_one_error_before_the_artifact_loads(tiny_artifact) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "kokoro_opt.cli", "serve", "--artifact", str(tiny_artifact.path), "--port", str(port)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "warmed up" not in done.stderr and "Traceback" not in done.stderr
