"""The OpenAPI document is the server's contract, and the server keeps it under generated input.

schemathesis (its CLI, every check, every phase) runs against real servers: whole without a key, and
windowed with one. hypothesis sends any Unicode text down the text path (normalization, phonemization,
the token limit, synthesis) of a third. Each prints how many cases it tried."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kokoro_opt.select import resolve_artifact
from kokoro_opt.serve import ServeConfig, ServerThread, create_app, wait_ready
from tests.serve_helpers import metric
from tests.test_serve_load import wait_for

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

KEY = "contract-key"
EXAMPLES = 25  # per operation and phase: the whole run stays near a minute per server on two busy cores


def say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal whatever pytest captures: how many cases were tried."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


@pytest.fixture(scope="module")
def windowed_artifact(tiny_recipe, artifacts_root):
    from tests.test_passes import build_with
    from tests.test_windows import WINDOWS

    return build_with(tiny_recipe, artifacts_root, "t-windows", [{"kind": "simplify"}, WINDOWS]).artifact


@pytest.fixture(scope="module", params=["whole", "windowed, with a key"])
def served(request: pytest.FixtureRequest, tiny_artifact) -> Iterator[tuple[str, str | None, str]]:
    windowed = request.param != "whole"
    artifact = request.getfixturevalue("windowed_artifact") if windowed else tiny_artifact
    key = KEY if windowed else None
    config = ServeConfig(first_chunk_tokens=20, chunk_tokens=120, windowed=windowed, api_key=key, audio_cache_mb=0)
    with ServerThread(create_app(resolve_artifact(str(artifact.path)), config)) as server:
        wait_ready(server.url)
        yield server.url, key, request.param


def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    served: tuple[str, str | None, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, key, label = served
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
               "--max-examples", str(EXAMPLES), "--seed", "38", "--request-timeout", "120",
               "--report", "json", "--report-dir", str(tmp_path)]  # fmt: skip
    if key:
        command += ["--header", f"Authorization: Bearer {key}"]
    # in tmp_path: schemathesis keeps a cache folder in its working directory
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False, cwd=tmp_path)
    [report_file] = tmp_path.glob("json-*.json")
    report = json.loads(report_file.read_text())
    cases = report["test_cases"]
    say(request, f"schemathesis ({label} server): {cases['generated']} cases generated, {cases['unique_failures']} "
                 f"unique failures, {len(report['errors'])} errors, operations {report['operations']['tested']}")  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:]
    assert cases["generated"] > 100 and cases["unique_failures"] == 0 and not report["errors"]
    assert report["operations"]["tested"] == report["operations"]["total"] == 7
    # alive after it: ready, idle, and speaking
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    assert httpx.get(f"{url}/ready").status_code == 200
    body = {"input": "Still here.", "voice": "tiny_0", "response_format": "pcm", "stream": False}
    assert httpx.post(f"{url}/v1/audio/speech", json=body, headers=headers, timeout=120).status_code == 200
    assert metric_with(url, "kokoro_active_requests", headers) == 0


def metric_with(url: str, name: str, headers: dict[str, str]) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_the_document_describes_the_api(served: tuple[str, str | None, str]) -> None:
    url, key, _ = served
    doc = httpx.get(f"{url}/openapi.json").json()
    speech = doc["paths"]["/v1/audio/speech"]["post"]
    body = speech["requestBody"]["content"]["application/json"]["schema"]
    assert speech["requestBody"]["required"] and body["required"] == ["input"]
    assert {"model", "input", "voice", "response_format", "speed", "stream_format", "instructions", "stream"} <= set(
        body["properties"]
    )
    assert re.fullmatch(body["properties"]["voice"]["anyOf"][0]["pattern"], "tiny_0(2)+alloy(0.5)")
    assert not re.fullmatch(body["properties"]["voice"]["anyOf"][0]["pattern"], "nobody")
    assert {"200", "400", "413", "429", "503", "504"} <= set(speech["responses"]) and "422" not in json.dumps(doc["paths"])
    assert "Retry-After" in speech["responses"]["429"]["headers"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]
    assert list(metrics["200"]["content"]) == ["text/plain"]
    assert ("401" in metrics) == bool(key) and ("security" in speech) == bool(key)
    allowed = httpx.request("PATCH", f"{url}/v1/audio/speech")
    assert allowed.status_code == 405 and allowed.headers["allow"] == "POST"
    assert allowed.json()["error"]["message"] == "PATCH is not allowed on /v1/audio/speech: use POST"


# ---- the text path, property-tested --------------------------------------------------------------------

LIMIT = 100  # a small token limit: long and expanding inputs reach it, accepted ones synthesize quickly
UNITS = ["1234567890", "$1,234.56 ", "5 km/h ", "3:30 pm ", "😀", "ℌ", "...", "Dr. ", "\u200b", "#", "ﷺ", "2024-03-05 "]
TEXTS = st.one_of(
    st.text(max_size=300),  # any Unicode: every category, controls, emoji, combining marks (no lone surrogates)
    st.text(alphabet=st.characters(categories=["Nd", "P", "S", "Zs", "Cc", "Cf"]), max_size=4200),  # what normalization expands
    st.builds(lambda unit, n: unit * n, st.sampled_from(UNITS), st.integers(1, 500)),  # normalization bombs
)
_tried: list[int] = []


@pytest.fixture(scope="module")
def text_server(tiny_artifact, request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    config = ServeConfig(first_chunk_tokens=20, chunk_tokens=120, max_input_tokens=LIMIT, audio_cache_mb=0, request_timeout=120)
    app = create_app(resolve_artifact(str(tiny_artifact.path)), config)
    with ServerThread(app) as server:
        wait_ready(server.url)
        yield server.url, app.state.serve.engine
    say(request, f"hypothesis (text path): {len(_tried)} inputs, longest {max(_tried, default=0)} characters")


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(text=TEXTS, speed=st.sampled_from([0.25, 1.0, 4.0]), stream=st.booleans())
def test_any_text_gives_audio_or_a_400_naming_the_problem(
    text_server: tuple[str, Any], text: str, speed: float, stream: bool
) -> None:
    """Never a 5xx, a hang (the request's own timeout, 120 s, would be a 504) or a dead worker."""
    url, engine = text_server
    _tried.append(len(text))
    body = {"input": text, "voice": "tiny_0", "response_format": "pcm", "speed": speed, "stream": stream}
    response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=180)  # a cut stream raises here
    if response.status_code == 200:
        assert response.content and len(response.content) % 2 == 0
    else:
        error = response.json()["error"]
        assert response.status_code in (400, 413), (response.status_code, error)
        assert error["param"] == "input" and error["message"]
        if response.status_code == 413:
            assert f"the limit is {LIMIT:,}" in error["message"] and re.search(
                r"input is [\d,]+ phoneme tokens", error["message"]
            )
        elif text.strip():
            assert f"{len(text)} characters" in error["message"]  # the only other refusal: over 4096 characters
    assert all(t.is_alive() for t in engine._threads) and engine.error is None
    wait_for(lambda: metric(url, "kokoro_active_requests") == 0, 60)  # its slot is given back
