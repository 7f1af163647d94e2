"""Beyond one machine, with real servers: Optuna on PostgreSQL, an MLflow tracking server with a
PostgreSQL backend and a proxied artifact store, and artifacts that travel between artifact roots.

Two artifact roots stand for two machines. Every server runs on loopback and stops with the module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from kokoro_opt.artifacts import Artifact, link_or_copy, open_artifact
from kokoro_opt.machine import fingerprint
from tests.servers import create_database, free_port, mlflow_server, postgres_server, wait_healthy

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

KOKORO_OPT = [sys.executable, "-m", "kokoro_opt.cli"]


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("team")
    with postgres_server() as pg, mlflow_server(create_database(pg, "mlflow"), base / "mlflow-artifacts") as tracking:
        yield {"base": base, "pg": pg, "tracking": tracking, "store": base / "mlflow-artifacts"}


def _cli(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*KOKORO_OPT, *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def _machine_root(base: Path, name: str, tiny: Artifact) -> Path:
    """An artifact root holding the tiny artifact, as if built on that machine."""
    root = base / name / "artifacts"
    link_or_copy(tiny.path, root / "tiny" / tiny.id)
    return root


# ---- Optuna: two workers, one PostgreSQL study, kill -9 and resume ---------------------------------


def _tune_recipe(base: Path, storage: str) -> Path:
    data = {
        "name": "team", "storage": storage, "trials": 6,
        "sampler": {"seed": 5, "startup_trials": 3},
        "space": {"artifacts": ["tiny"], "intra_op_num_threads": [1, 2], "execution_mode": ["sequential"],
                  "graph_optimization_level": ["basic", "all"], "first_chunk_tokens": [6, 10, 14], "chunk_tokens": [16, 32]},
        "measure": {"paragraph": "Hi there, my friend. " * 6, "rtf_text": "Hello there, friend.", "warmup": 1,
                    "ttfa_runs": 5, "rtf_runs": 5},
        "prune": {"enabled": False}, "quality": {"evaluate_missing": False}, "best": {"max_rtf_p50": None},
        "compare_rounds": 1, "workers": {"heartbeat_seconds": 1, "stale_after_seconds": 5},
    }  # fmt: skip
    path = base / "team-tune.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _worker(recipe: Path, root: Path, tracking: str, cwd: Path) -> subprocess.Popen[str]:
    command = [*KOKORO_OPT, "tune", str(recipe), "--artifacts", str(root), "--tracking-uri", tracking]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _study_when_created(url: str, name: str, creator: subprocess.Popen[str], timeout: float = 180) -> Any:
    from kokoro_opt.tuning.storage import make_storage

    storage = make_storage(url)  # as the workers open it: this reader may be the one creating the tables
    deadline = time.monotonic() + timeout
    while name not in optuna.study.get_all_study_names(storage):
        assert creator.poll() is None, creator.communicate()[0]
        assert time.monotonic() < deadline, "the first worker never created the study"
        time.sleep(0.2)
    return optuna.load_study(study_name=name, storage=storage)


def _running_trial_of(study: Any, pid: int, timeout: float = 120) -> int:
    """Wait until worker `pid` is inside a trial; its number."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if f":{pid}:" in str(t.user_attrs.get("worker", "")) and "settings" in t.user_attrs:
                return int(t.number)
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} never ran a trial")


def test_two_tune_workers_share_a_postgres_study_and_survive_kill_9(team: dict[str, Any], tiny_artifact: Artifact) -> None:
    from kokoro_opt.tuning.records import StudyRecords

    base, storage = team["base"], create_database(team["pg"], "optuna")
    roots = [_machine_root(base, name, tiny_artifact) for name in ("machine-a", "machine-b")]
    recipe = _tune_recipe(base, storage)
    first = _worker(recipe, roots[0], team["tracking"], base)
    study = _study_when_created(storage, "team", first)  # the first one creates the study; the second joins it
    second = _worker(recipe, roots[1], team["tracking"], base)
    killed = _running_trial_of(study, first.pid)
    first.send_signal(signal.SIGKILL)  # mid-trial: its trial stays RUNNING until its heartbeat goes stale
    first.wait(timeout=30)
    resumed = _worker(recipe, roots[0], team["tracking"], base)  # the same command again resumes
    for proc in (second, resumed):
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output

    trials = optuna.load_study(study_name="team", storage=storage).get_trials(deepcopy=False)
    done = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == 6  # exactly the budget: no worker ran past it
    dead = trials[killed]
    assert dead.state.name == "FAIL" and not dead.user_attrs.get("surplus")  # the stale trial gave its place back
    others = [t for t in trials if t.state.name == "FAIL" and t.number != killed]
    assert all(t.user_attrs.get("surplus") for t in others)  # only race surplus, never measured
    here = fingerprint()
    assert {t.user_attrs["machine_id"] for t in done} == {here["id"]} and all(t.user_attrs["machine"] == here for t in done)
    pids = {t.user_attrs["worker"].split(":")[1] for t in done}
    # the second machine ran trials of the study the first created; the resumed worker may find the budget spent by
    # then (one process can start after the other has finished it), so it is only held to never running a surplus
    assert str(second.pid) in pids and pids <= {str(first.pid), str(second.pid), str(resumed.pid)}
    # one MLflow run per trial, none twice, on the tracking server
    records = StudyRecords(team["tracking"], storage, optuna.load_study(study_name="team", storage=storage))
    logged = records.logged_trials()
    assert len(logged) == len(set(logged)) and {t.number for t in done} <= set(logged)
    for root in roots:  # each machine wrote its own tuned.json, naming the machine
        tuned = json.loads((root / "tuned.json").read_text())
        assert tuned["machine"]["id"] == here["id"] and tuned["study"] == "team"


# ---- MLflow tracking server: build, evaluate, compare, push, fetch, serve --------------------------


@pytest.fixture(scope="module")
def pushed(team: dict[str, Any], tiny_artifact: Artifact) -> dict[str, Any]:
    """Machine A builds the tiny recipe (stage cache hit), evaluates it and pushes it to the server."""
    base = team["base"]
    root_a = base / "builder" / "artifacts"
    link_or_copy(tiny_artifact.path.parent.parent / "_cache", root_a / "_cache")  # its export is cached here
    recipe = Path(__file__).parent.parent / "recipes" / "tiny.yaml"
    done = _cli("build", str(recipe), "--artifacts", str(root_a), "--tracking-uri", team["tracking"], "--push", cwd=base)
    assert "pushed tiny" in done.stdout, done.stdout + done.stderr
    return {"root_a": root_a, "artifact": open_artifact(root_a / "tiny")}


def test_build_evaluate_and_compare_arrive_at_the_tracking_server(team: dict[str, Any], pushed: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    tracking, artifact = team["tracking"], pushed["artifact"]
    _cli("compare", str(artifact.path), "--tracking-uri", tracking, "--plot", str(team["base"] / "pareto.png"), cwd=team["base"])
    client = MlflowClient(tracking)
    experiments = {e.name: e.experiment_id for e in client.search_experiments()}
    assert {"kokoro-opt-tiny", "kokoro-opt-compare", "kokoro-opt-artifacts"} <= set(experiments)
    [evaluation] = client.search_runs([experiments["kokoro-opt-tiny"]], f"tags.artifact_id = '{artifact.id}'")
    assert evaluation.data.metrics["rtf_p50"] > 0 and evaluation.data.tags["machine.id"] == fingerprint()["id"]
    files = {f.path for f in client.list_artifacts(evaluation.info.run_id, "profile")}
    assert files == {"profile/ops.json"}  # files went through the server's proxied artifact store
    [comparison] = client.search_runs([experiments["kokoro-opt-compare"]], "tags.kokoro_opt_kind = 'comparison'")
    assert {"compare.json", "compare.csv", "machine.json"} <= {f.path for f in client.list_artifacts(comparison.info.run_id)}
    [child] = client.search_runs([experiments["kokoro-opt-compare"]], f"tags.`mlflow.parentRunId` = '{comparison.info.run_id}'")
    assert child.data.metrics["rtf_p50"] > 0 and child.data.tags["artifact_id"] == artifact.id
    logged = list(team["store"].rglob("ops.json"))  # on the server's disk, not the client's
    assert logged
    [push] = client.search_runs([experiments["kokoro-opt-artifacts"]], f"tags.artifact_id = '{artifact.id}'")
    assert push.data.tags["store_place"] == f"tiny/{artifact.id}" and push.data.tags["machine.id"] == fingerprint()["id"]
    folder = {f.path for f in client.list_artifacts(push.info.run_id, "artifact")}
    assert {f"artifact/{name}" for name in ("model.onnx", "manifest.json", "voices.npz", "kokoro.json")} <= folder


def test_an_empty_root_serves_the_pushed_artifact_by_id(team: dict[str, Any], pushed: dict[str, Any]) -> None:
    from openai import OpenAI

    artifact, root_b = pushed["artifact"], team["base"] / "server-machine" / "artifacts"
    port = free_port()
    command = [*KOKORO_OPT, "serve", "--artifact", artifact.id[:10], "--artifacts", str(root_b),
               "--tracking-uri", team["tracking"], "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(command, cwd=team["base"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # /ready, not /health: the server answers /health while it still loads and warms up (503 to speech)
        assert wait_healthy(f"http://127.0.0.1:{port}", server, 180, path="/ready"), "the server did not become ready"
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        audio = client.audio.speech.create(model="kokoro", voice="tiny_0", input="Hello there.", response_format="wav")
        assert audio.content[:4] == b"RIFF" and len(audio.content) > 10_000
    finally:
        server.terminate()
        output = server.communicate(timeout=30)[0]
    assert "fetching tiny" in output and f"serving tiny artifact {artifact.id}" in output
    fetched = open_artifact(root_b / "tiny" / artifact.id)
    assert fetched.manifest.files == artifact.manifest.files  # the same bytes, verified
    again = _cli("fetch", artifact.id, "--artifacts", str(root_b), "--tracking-uri", team["tracking"], cwd=team["base"])
    assert "every file matches its manifest" in again.stdout and "fetching" not in again.stderr  # already here


def test_say_and_voices_fetch_a_pushed_artifact_by_id(team: dict[str, Any], pushed: dict[str, Any], tmp_path: Path) -> None:
    """Every command that runs one artifact takes --tracking-uri, as docs/team.md says: a new machine speaks
    with an artifact it has only the id of."""
    artifact, root = pushed["artifact"], tmp_path / "laptop" / "artifacts"
    out = tmp_path / "hello.wav"
    common = ("--artifact", artifact.id, "--artifacts", str(root), "--tracking-uri", team["tracking"])
    spoken = _cli("say", "Hello there.", *common, "--voice", "tiny_0", "-o", str(out), cwd=team["base"])
    assert spoken.returncode == 0 and "fetching tiny" in spoken.stderr, spoken.stderr
    assert out.read_bytes()[:4] == b"RIFF" and (root / "tiny" / artifact.id).is_dir()
    listed = _cli("voices", *common, cwd=team["base"])
    assert "tiny_0" in listed.stdout.split()


def test_a_tampered_artifact_is_refused_and_leaves_nothing(team: dict[str, Any], pushed: dict[str, Any]) -> None:
    artifact = pushed["artifact"]
    [stored] = [p for p in team["store"].rglob("voices.npz") if (p.parent / "manifest.json").is_file()]
    original = stored.read_bytes()
    try:
        stored.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        root_c = team["base"] / "third-machine" / "artifacts"
        args = ("fetch", artifact.id, "--artifacts", str(root_c), "--tracking-uri", team["tracking"])
        done = _cli(*args, cwd=team["base"], check=False)
        assert done.returncode == 2 and "voices.npz does not match its manifest" in done.stderr, done.stderr
        left = [p.relative_to(root_c) for p in root_c.rglob("*") if p.is_file()]
        assert all(p.parts[0] == ".locks" for p in left), left  # the store's lock files only: no artifact, no half-download
        assert not (root_c / "tiny").exists()  # nor an empty recipe folder, which would look like a broken artifact
    finally:
        stored.write_bytes(original)


def test_machine_ids_name_no_host() -> None:
    from kokoro_opt.tuning.study import worker_id

    assert worker_id(0).startswith(f"{fingerprint()['id']}:{os.getpid()}:") and os.uname().nodename not in worker_id(0)
