"""kokoro-opt tune: recipe, space and sampling, quality gate, and real studies on the tiny artifact
(resume, MLflow records without duplicates, tuned.json read by serve, two worker processes)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from rich.console import Console

from kokoro_opt.artifacts import link_or_copy
from kokoro_opt.chunking import CONTEXT_WORDS
from kokoro_opt.errors import UserError
from kokoro_opt.machine import fingerprint
from kokoro_opt.manifest import MANIFEST, ChainStep
from kokoro_opt.tune import SessionCache, load_tune_recipe, parse_tune_recipe, run_tuning
from kokoro_opt.tuning.config import SamplerConfig, SpaceConfig
from kokoro_opt.tuning.records import StudyRecords
from kokoro_opt.tuning.report import pick_best
from kokoro_opt.tuning.space import Candidate, ResolvedSpace, gather_candidates, suggest
from kokoro_opt.tuning.storage import make_storage
from kokoro_opt.tuning.study import Objective, finished, make_sampler, sampler_seed

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast

REPO = Path(__file__).parent.parent


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


# ---- recipe -------------------------------------------------------------------------------------------


def test_shipped_recipe_parses_and_errors_name_the_field() -> None:
    recipe = load_tune_recipe(REPO / "recipes" / "tune-cpu.yaml")
    assert recipe.study_name == "tune-cpu" and recipe.storage.startswith("sqlite:///experiments/")
    assert "CPUExecutionProvider" in recipe.space.providers and recipe.quality.min_pesq == 3.8
    cases = {
        "unknown field 'sapce'": {"sapce": {}},
        "field 'measure.ttfa_runs'": {"measure": {"ttfa_runs": 0}},
        "field 'space'": {"space": {"chunk_tokens": [600]}},
        "field 'sampler.kind'": {"sampler": {"kind": "grid"}},
        "CPUExecutionProvider takes no options": {"space": {"providers": {"CPUExecutionProvider": {"x": ["a", "b"]}}}},
        "field 'best.weights'.*one of them > 0": {"best": {"weights": {"ttfa_p50": -1.0}}},
        "field 'best.weights'.*>= 0": {"best": {"weights": {}}},
        "crossfade_ms must be within 0..200 ms": {"space": {"crossfade_ms": [5000]}},  # else every trial fails
    }
    for expected, data in cases.items():
        with pytest.raises(UserError, match=expected):
            parse_tune_recipe({"name": "x", **data})


def test_the_shipped_tuning_recipe_names_every_field_of_the_schema() -> None:
    """docs/tuning.md sends readers to recipes/tune-cpu.yaml for the fields: a new field is named there too."""
    import re

    from pydantic import BaseModel

    from kokoro_opt.tuning.config import TuneRecipe

    text = (REPO / "recipes" / "tune-cpu.yaml").read_text(encoding="utf-8")

    def fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
        found = []
        for name, info in model.model_fields.items():
            found.append((prefix + name, name))
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                found += fields(info.annotation, f"{prefix}{name}.")
        return found

    assert [path for path, name in fields(TuneRecipe) if not re.search(rf"\b{name}\b", text)] == []


# ---- space and sampling (no model) --------------------------------------------------------------------


def _space() -> ResolvedSpace:
    candidates = [Candidate("a@1", "a", {"onnx": "1", "ort": "2"}, 4.64, "ref"), Candidate("b@3", "b", {"onnx": "3"}, 4.0, "rec")]
    space = SpaceConfig(intra_op_num_threads=[1, 2], first_chunk_tokens=[24, 40], chunk_tokens=[100, 200])
    return ResolvedSpace(candidates, space, "pesq", True)


def _sample(url: str, seed: int, n: int = 10) -> list[dict[str, Any]]:
    resolved = _space()

    def objective(trial: Any) -> list[float]:  # deterministic "measurements": the sampler alone decides
        s = suggest(trial, resolved)
        assert (s.session.inter_op_num_threads == 1) or s.session.execution_mode == "parallel"
        return [
            s.first_chunk_tokens / 100 + s.session.intra_op_num_threads,
            s.chunk_tokens / 1000,
            resolved.candidates[0].quality,
        ]

    sampler = make_sampler(SamplerConfig(seed=seed, startup_trials=4), sampler_seed(seed, 0, 0))
    study = optuna.create_study(storage=make_storage(url), directions=["minimize", "minimize", "maximize"], sampler=sampler)
    study.optimize(objective, n_trials=n)
    return [t.params for t in study.trials]


def test_same_seed_and_fresh_storage_reproduce_the_parameters(tmp_path: Path) -> None:
    first = _sample(f"sqlite:///{tmp_path}/a.db", seed=5)
    assert first == _sample(f"sqlite:///{tmp_path}/b.db", seed=5)  # past the 4 random trials too (TPE)
    assert first != _sample(f"sqlite:///{tmp_path}/c.db", seed=6)
    assert {p["artifact"] for p in first} <= {"a@1", "b@3"}
    assert all(("model_format" in p) == (p["artifact"] == "a@1") for p in first)  # only a has an .ort sibling
    assert sampler_seed(5, 0, 0) == 5 and sampler_seed(5, 1, 0) != sampler_seed(5, 0, 3) != 5


def _study(points: list[tuple[float, float, float, str]]) -> Any:
    study = optuna.create_study(directions=["minimize", "minimize", "maximize"])
    for ttfa, rtf, pesq, artifact in points:
        study.add_trial(optuna.trial.create_trial(values=[ttfa, rtf, pesq], user_attrs={"settings": {"artifact": artifact}}))
    return study


def test_early_stop_compares_with_the_same_artifacts_median(tmp_path: Path) -> None:
    study = _study([(1.0, 0.5, 4.6, "a@1"), (2.0, 0.5, 4.6, "a@1"), (3.0, 0.5, 4.6, "a@1"), (0.1, 0.1, 4.0, "b@3")])
    trial = study.ask()
    median = Objective(parse_tune_recipe({"name": "p"}), _space(), SessionCache(tmp_path), "w")
    median._stop_if_hopeless(trial, "a@1", 0, 3.9, "TTFA")  # 2 x median 2.0: kept
    with pytest.raises(optuna.TrialPruned, match=r"median 2\.000 of a@1"):
        median._stop_if_hopeless(trial, "a@1", 0, 4.1, "TTFA")
    median._stop_if_hopeless(trial, "b@3", 0, 4.1, "TTFA")  # one complete trial of b: too few to judge
    best = Objective(parse_tune_recipe({"name": "p", "prune": {"reference": "best"}}), _space(), SessionCache(tmp_path), "w")
    with pytest.raises(optuna.TrialPruned):
        best._stop_if_hopeless(trial, "a@1", 0, 2.1, "TTFA")


def test_best_rule_scores_the_front() -> None:
    study = _study([(1.0, 0.5, 4.64, "a"), (0.5, 0.6, 3.9, "b"), (0.6, 1.2, 3.9, "b")])  # the third is dominated
    rule = parse_tune_recipe({"name": "r", "best": {"weights": {"ttfa_p50": 1, "rtf_p50": 0.5, "quality": 0.25}}}).best
    names = ["ttfa_p50", "rtf_p50", "quality"]
    winner, scores, _ = pick_best(study, names, rule)
    assert scores == {0: 1.0, 1: 0.75} and winner.number == 1
    slow = rule.model_copy(update={"max_rtf_p50": 0.55})
    assert pick_best(study, names, slow)[0].number == 0  # only trial 0 keeps up with playback


# ---- the quality budget --------------------------------------------------------------------------------


def _fake(root: Path, tiny: Any, name: str, stages: list[dict[str, str]], model: str = "model.onnx") -> str:
    folder = root / name / stages[-1]["key"]
    folder.mkdir(parents=True)
    for f in ("kokoro.json", "voices.npz"):
        link_or_copy(tiny.path / f, folder / f)
    link_or_copy(tiny.model_file, folder / model)
    chain = [*tiny.manifest.model_dump(mode="json")["chain"], *stages]
    manifest = tiny.manifest.model_copy(update={"id": stages[-1]["key"], "recipe": {"name": name}})
    (folder / MANIFEST).write_text(manifest.model_copy(update={"chain": [ChainStep(**step) for step in chain]}).to_json())
    return stages[-1]["key"]


def test_quality_gate_pairs_ort_and_never_invents_a_number(tiny_artifact: Any, tmp_path: Path) -> None:
    from tests.serve_helpers import record_evaluations

    root = tmp_path / "artifacts"
    link_or_copy(tiny_artifact.path, root / "tiny" / tiny_artifact.id)
    q = _fake(root, tiny_artifact, "int8-q", [{"kind": "quantize", "key": "q000000000000001"}])
    ort = _fake(
        root,
        tiny_artifact,
        "int8-q-ort",
        [{"kind": "quantize", "key": q}, {"kind": "ort", "key": "o000000000000001"}],
        "model.ort",
    )
    _fake(root, tiny_artifact, "int8-bad", [{"kind": "quantize", "key": "b000000000000001"}])
    _fake(root, tiny_artifact, "int8-unmeasured", [{"kind": "quantize", "key": "u000000000000001"}])
    _fake(root, tiny_artifact, "int8-phrases", [{"kind": "quantize", "key": "p000000000000001"}])
    _fake(root, tiny_artifact, "int8-windowed", [{"kind": "windows", "key": "w000000000000001"}])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record_evaluations(uri, [(q, {"pesq_mean": 4.1}), (ort, {"pesq_mean": 4.0}), ("b000000000000001", {"pesq_mean": 3.1}),
                             ("p000000000000001", {"pesq_mean": 4.2, "phrase_pesq_mean": 3.4}),
                             # served windowed: heard as its stream, whatever its whole decoding scores
                             ("w000000000000001", {"pesq_mean": 4.3, "served_windowed": 1.0, "windowed_pesq_mean": 3.5}),
                             # a larger evaluation without a reference does not hide the one that scored it
                             (q, {"pesq_mean": None, "utterances": 99.0})])  # fmt: skip
    recipe = parse_tune_recipe({"name": "gate", "quality": {"evaluate_missing": False}})
    said: list[str] = []
    found = {c.name: c for c in gather_candidates(recipe, root, uri, said.append)}
    assert set(found) == {"tiny", "int8-q"}
    assert found["tiny"].quality == 4.64 and "reference" in found["tiny"].reason  # fp32 passes by definition
    assert found["int8-q"].formats == {"onnx": q, "ort": ort} and found["int8-q"].quality == 4.1
    assert any("int8-bad" in m and "3.10 < budget 3.8" in m for m in said)
    assert any("int8-phrases" in m and "short-phrase PESQ 3.40 < budget 3.6" in m for m in said)
    assert any("int8-windowed" in m and "windowed PESQ 3.50 < budget 3.8" in m for m in said)
    assert any("int8-unmeasured" in m and "no evaluation record" in m for m in said)

    # a voice the artifacts lack would fail every trial: it is found before the study starts
    voiceless = parse_tune_recipe({"name": "gate", "measure": {"voice": "zz_nobody"}, "quality": {"evaluate_missing": False}})
    said.clear()
    assert gather_candidates(voiceless, root, uri, said.append) == []
    assert any("tiny" in m and "no voice 'zz_nobody' (measure.voice)" in m for m in said)
    # what `say --voice` takes: an OpenAI name, a blend
    for voice in ("alloy", "tiny_0(2)+tiny_1(1)"):
        spoken = parse_tune_recipe({"name": "gate", "measure": {"voice": voice}, "quality": {"evaluate_missing": False}})
        assert {c.name for c in gather_candidates(spoken, root, uri, said.append)} == {"tiny", "int8-q"}


# ---- real studies on the tiny artifact ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tune_env(tiny_artifact: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Its own artifacts root (tuned.json must not reach the serve tests' root) and MLflow store."""
    base = tmp_path_factory.mktemp("tune")
    root = base / "artifacts"
    link_or_copy(tiny_artifact.path, root / "tiny" / tiny_artifact.id)
    return {"base": base, "root": root, "uri": f"sqlite:///{base}/mlflow.db", "tiny": tiny_artifact}


def _recipe(env: dict[str, Any], name: str, **extra: Any) -> Path:
    data = {
        "name": name, "storage": f"sqlite:///{env['base']}/optuna.db", "trials": 2,
        "sampler": {"seed": 3, "startup_trials": 2},
        "space": {"artifacts": ["tiny"], "intra_op_num_threads": [1, 2], "execution_mode": ["sequential"],
                  "graph_optimization_level": ["basic", "all"], "first_chunk_tokens": [6, 10], "chunk_tokens": [16]},
        "measure": {"paragraph": "Hi there, friend. Bye.", "rtf_text": "Hi.", "warmup": 0, "ttfa_runs": 1, "rtf_runs": 1},
        "prune": {"enabled": False}, "quality": {"evaluate_missing": False}, "best": {"max_rtf_p50": None},
        "compare_rounds": 1, "workers": {"heartbeat_seconds": 1, "stale_after_seconds": 10}, **extra,
    }  # fmt: skip
    path = env["base"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _run(env: dict[str, Any], recipe: Path, **kwargs: Any) -> Any:
    return run_tuning(recipe, root=env["root"], tracking_uri=env["uri"], plots=env["base"] / "plots", console=_quiet(), **kwargs)


def _trial_runs(env: dict[str, Any], study: str) -> list[int]:
    url = f"sqlite:///{env['base']}/optuna.db"
    return StudyRecords(env["uri"], url, optuna.load_study(study_name=study, storage=url)).logged_trials()


def test_tune_writes_tuned_json_resumes_without_duplicates_and_serve_uses_it(tune_env: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from kokoro_opt.cli import app
    from kokoro_opt.select import tuned_selection
    from kokoro_opt.serve.config import ServeConfig

    env, recipe = tune_env, _recipe(tune_env, "e2e")
    first = _run(env, recipe)
    assert first.ran == 2 and first.best is not None and first.tuned_path == env["root"] / "tuned.json"
    tuned = json.loads(first.tuned_path.read_text())
    assert tuned["artifact_id"] == env["tiny"].id and tuned["study"] == "e2e" and tuned["trial"] == first.best.number
    assert tuned["ttfa_ratio"] == pytest.approx(
        tuned["vs_defaults"]["tuned_ttfa_p50"] / tuned["vs_defaults"]["defaults_ttfa_p50"]
    )
    assert tuned["applied"] == (tuned["ttfa_ratio"] < 1.0)
    assert {p.name for p in first.plots} == {"pareto.png", "history.png", "importances.png"}
    assert _trial_runs(env, "e2e") == [0, 1]
    here = fingerprint()  # the machine is part of every record: each trial and tuned.json
    assert tuned["machine"] == here
    assert [(t.user_attrs["machine_id"], t.user_attrs["machine"]) for t in first.study.trials] == [(here["id"], here)] * 2

    # a worker killed mid-trial leaves a RUNNING trial with a heartbeat that stops: it holds its place
    # in the budget until the heartbeat is stale, then fails, and the budget continues
    storage = make_storage(f"sqlite:///{env['base']}/optuna.db")
    killed = optuna.load_study(study_name="e2e", storage=storage).ask()
    killed.set_user_attr("worker", "elsewhere:1:w0")
    storage.record_heartbeat(killed._trial_id)
    second = _run(env, recipe, trials=3)
    assert second.ran == 1 and finished(second.study) == 3
    assert _trial_runs(env, "e2e") == [0, 1, 3]  # one MLflow run per finished trial, none for the killed one
    third = _run(env, recipe, trials=3)
    assert third.ran == 0 and _trial_runs(env, "e2e") == [0, 1, 3]
    assert third.comparison is None  # tuned.json holds this study's winner, measured already
    elsewhere = json.loads((env["root"] / "tuned.json").read_text()) | {"study_key": "another-storage"}
    (env["root"] / "tuned.json").write_text(json.dumps(elsewhere))  # a same-named study of another storage
    assert _run(env, recipe, trials=3).comparison is not None
    records = StudyRecords(env["uri"], f"sqlite:///{env['base']}/optuna.db", third.study)
    assert {r.data.tags["machine.id"] for r in records._find("tags.kokoro_opt_kind = 'tuning-trial'")} == {here["id"]}
    parent = records.client.get_run(records.parent())
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_finished"] == 3
    logged = {a.path for a in records.client.list_artifacts(parent.info.run_id, "plots")}
    assert {"plots/pareto.png", "plots/history.png"} <= logged

    notes: list[str] = []
    selection = tuned_selection(env["root"], notes)
    best = json.loads((env["root"] / "tuned.json").read_text())
    if best["applied"]:  # the winner beat the defaults side by side (on a busy machine it may not)
        assert selection is not None and selection.artifact.id == env["tiny"].id and "e2e" in selection.reason
        assert selection.settings.intra_op_num_threads == best["session"]["intra_op_num_threads"]
        served = ServeConfig.for_selection(selection)
        assert served.first_chunk_tokens == best["chunking"]["first_chunk_tokens"]
        assert served.context_words == best["chunking"]["context_words"] == CONTEXT_WORDS  # what the budget measured
    else:
        assert selection is None and "measured side by side" in notes[0]

    shown = CliRunner().invoke(app, ["tune", str(recipe), "--show", "--artifacts", str(env["root"])])
    assert shown.exit_code == 0, shown.output
    assert "Pareto front" in shown.output and "tiny" in shown.output and "ratio" in shown.output
    assert "plots: " in shown.output and "pareto.png" in shown.output

    changed = _recipe(env, "e2e", space={**yaml.safe_load(recipe.read_text())["space"], "chunk_tokens": [24]})
    with pytest.raises(UserError, match="different space"):
        _run(env, changed)
    shown = CliRunner().invoke(app, ["tune", str(changed), "--show", "--artifacts", str(env["root"])])
    assert shown.exit_code == 2 and "different space" in shown.output  # judged by one recipe's rules, not another's
    with pytest.raises(UserError, match="in-memory database"):
        _run(env, recipe, storage="sqlite:///:memory:")


def test_trials_that_all_fail_stop_the_run_with_an_error(tune_env: dict[str, Any]) -> None:
    env = tune_env
    recipe = _recipe(env, "mute", trials=8)
    data = yaml.safe_load(recipe.read_text()) | {"measure": {"paragraph": "...", "rtf_text": "..."}}
    recipe.write_text(yaml.safe_dump(data), encoding="utf-8")  # nothing to say: every trial fails the same way
    with pytest.raises(UserError, match=r"5 trials in a row failed, the last with: .*measure.paragraph has nothing to say"):
        _run(env, recipe)
    assert not (env["root"] / "tuned.json").exists() or json.loads((env["root"] / "tuned.json").read_text())["study"] != "mute"


def test_two_worker_processes_share_one_study(tune_env: dict[str, Any]) -> None:
    env = tune_env
    result = _run(env, _recipe(env, "pair", trials=6), workers=2)
    done = [t for t in result.study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == 6  # exactly the budget, though both workers ask for trials at once
    # every trial is one of this run's two workers' (w0, w1): how many each took is the OS scheduler's business, and
    # on a loaded machine one process can start after the other has finished the budget
    workers = {t.user_attrs["worker"].rsplit(":", 1)[-1] for t in done}
    assert workers <= {"w0", "w1"} and workers, workers
    assert len({t.number for t in done}) == len(done)
    # one MLflow run per finished trial; a race surplus (closed unmeasured) has none
    measured = [t.number for t in result.study.trials if t.state.is_finished() and not t.user_attrs.get("surplus")]
    assert _trial_runs(env, "pair") == sorted(measured)


def test_thread_choices_all_above_the_cores_are_refused(tune_env: dict[str, Any]) -> None:
    """Dropping them all would leave nothing but an oversubscribed count measured (64 threads on 2 cores ran)."""
    space = {"artifacts": ["tiny"], "intra_op_num_threads": [4096], "first_chunk_tokens": [6], "chunk_tokens": [16]}
    with pytest.raises(UserError, match=r"every space\.intra_op_num_threads choice is above this machine's"):
        _run(tune_env, _recipe(tune_env, "oversubscribed", space=space))


@pytest.mark.parametrize("workers_killed_first", [False, True])
def test_a_terminated_run_stops_its_workers_and_their_trials(tune_env: dict[str, Any], workers_killed_first: bool) -> None:
    """`kill` (SIGTERM) on `tune --workers 2` ended the parent and left its two workers measuring on their own;
    terminated, a worker also left its trial RUNNING until its heartbeat went stale. Now the run ends as Ctrl-C
    ends it: each worker is interrupted, marks its running trial failed and exits; and the trials of workers that
    could not (killed outright, or still writing after the grace) are failed by the run itself."""
    import signal
    import subprocess
    import sys

    import psutil

    env = tune_env
    # far more trials than the workers run while the test waits, each long (seconds): the signal lands inside one
    measure = {"paragraph": "Hi there, friend. Bye.", "rtf_text": "Hi.", "warmup": 0, "ttfa_runs": 40, "rtf_runs": 40}
    name = "terminated-killed" if workers_killed_first else "terminated"
    recipe = _recipe(env, name, trials=100_000, measure=measure)
    command = [sys.executable, "-m", "kokoro_opt.cli", "tune", str(recipe), "--workers", "2", "--artifacts", str(env["root"]),
               "--tracking-uri", env["uri"]]  # fmt: skip
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"sqlite:///{env['base']}/optuna.db"
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while True:  # both workers measuring: a trial of each RUNNING
            assert parent.poll() is None and time.monotonic() < deadline, "the workers never ran trials"
            with contextlib.suppress(Exception):  # the study is not created yet
                trials = optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
                running = {t.user_attrs.get("worker") for t in trials if t.state.name == "RUNNING"} - {None}
                if len(running) == 2:  # a trial just asked for has no worker yet: its heartbeat alone fails it
                    break
            time.sleep(0.2)
        workers = psutil.Process(parent.pid).children()
        if workers_killed_first:
            for worker in workers:
                worker.kill()
            psutil.wait_procs(workers, timeout=30)
        parent.send_signal(signal.SIGTERM)
        parent.wait(60)
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, alive
    finally:
        for process in [psutil.Process(parent.pid), *workers] if parent.poll() is None else workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    trials = optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state.name == "RUNNING"]  # each marked as it was interrupted


def test_tuned_settings_from_another_machine_are_not_applied_silently(tmp_path: Path) -> None:
    from kokoro_opt.select import tuned_selection

    other = {**fingerprint(), "id": "0123456789ab", "cpu": "Other CPU"}
    (tmp_path / "tuned.json").write_text(json.dumps({"artifact_id": "abc", "study": "s", "machine": other}))
    notes: list[str] = []
    assert tuned_selection(tmp_path, notes) is None
    assert len(notes) == 1 and "tuned on another machine (Other CPU, id 0123456789ab)" in notes[0]
    assert "kokoro-opt tune" in notes[0]


def test_showing_a_study_that_was_never_run_makes_no_storage(tmp_path: Path) -> None:
    from kokoro_opt.tune import show_front

    storage = f"sqlite:///{tmp_path / 'new' / 'optuna.db'}"
    for url in (storage, storage + "?timeout=60"):  # SQLAlchemy's options are no part of the file's name
        with pytest.raises(UserError, match="no study 'tune-cpu': nothing was tuned into"):
            show_front(REPO / "recipes" / "tune-cpu.yaml", storage=url, root=tmp_path, console=_quiet())
    assert not (tmp_path / "new").exists()
    make_storage(storage + "?timeout=60")
    assert (tmp_path / "new" / "optuna.db").is_file()


def test_a_refused_run_leaves_no_study_file_and_the_tracking_store_is_no_storage(tmp_path: Path) -> None:
    """Nothing to tune is said before a new study file is made; MLflow's store (beside the study's file in
    experiments/) given as --storage is named as such, and Optuna's tables are not added to it."""
    from kokoro_opt.evaluate.tracking_store import open_client

    storage = tmp_path / "experiments" / "optuna.db"
    uri = f"sqlite:///{tmp_path / 'experiments' / 'mlflow.db'}"
    with pytest.raises(UserError, match="can be tuned"):
        run_tuning(REPO / "recipes" / "tune-cpu.yaml", storage=f"sqlite:///{storage}", root=tmp_path / "none",
                   tracking_uri=uri, console=_quiet())  # fmt: skip
    assert not storage.exists()
    open_client(uri)  # a tracking store, as the first logged command makes it
    with pytest.raises(UserError, match=r"^--storage .* is an MLflow tracking store, not an Optuna storage") as refused:
        make_storage(uri)
    assert "sqlite:///experiments/optuna.db" in str(refused.value.hint)
    import sqlite3

    with sqlite3.connect(tmp_path / "experiments" / "mlflow.db") as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "runs" in tables and "studies" not in tables


@pytest.mark.parametrize(
    ("content", "match"),
    [("{", "is not readable JSON"), ("[]", "holds a JSON list"), ("[" * 100_000, "RecursionError"),
     ('{"machine": {}}', "field 'artifact_id'"), ('{"artifact_id": "a", "machine": "x"}', "field 'machine'"),
     ('{"artifact_id": "a", "chunking": {"api_key": "x"}}', "field 'chunking.api_key'"),
     ('{"artifact_id": "a", "chunking": {"max_queue": 1e9}}', "field 'chunking.max_queue'"),
     ('{"artifact_id": "a", "chunking": {"first_chunk_tokens": "40"}}', "field 'chunking.first_chunk_tokens'"),
     ('{"artifact_id": "a", "chunking": {"context_words": 2.5}}', "field 'chunking.context_words'"),
     ('{"artifact_id": "a", "session": {"intra_op_num_threads": "many"}}', "field 'session.intra_op_num_threads'"),
     ('{"artifact_id": "a", "session": {"graph_optimization_level": "bogus"}}', "field 'session.graph_optimization_level'"),
     ('{"artifact_id": "a", "session": {"intra_op_num_threads": -3}}', "field 'session.intra_op_num_threads'"),
     ('{"artifact_id": "a", "session": {"providers": ["../lib.so"]}}', "field 'session.providers.0'")],
)  # fmt: skip
def test_a_tuned_file_that_is_not_one_is_a_clear_error(tmp_path: Path, content: str, match: str) -> None:
    """tuned.json is a file anyone can edit: it sets the serving settings tune writes, of their types, and nothing
    else (not the api key, not a limit), or serve stops with one line naming the field."""
    from kokoro_opt.select import tuned_selection

    (tmp_path / "tuned.json").write_text(content)
    with pytest.raises(UserError, match=re.escape(match)):
        tuned_selection(tmp_path, [])


def test_tuned_settings_that_lost_to_the_defaults_side_by_side_are_not_applied(tmp_path: Path) -> None:
    """A study's winner among noisy trials can be slower than the defaults when both are measured interleaved:
    tuned.json records it, and serve keeps the defaults (measured once: 809 ms tuned against 704 ms)."""
    from kokoro_opt.select import tuned_selection
    from kokoro_opt.tuning.report import ratio_line

    lost = {"artifact_id": "abc", "study": "s", "machine": fingerprint(), "applied": False,
            "not_applied": "trial 2 gave first audio in 809 ms against the defaults' 704 ms, measured side by side"}  # fmt: skip
    (tmp_path / "tuned.json").write_text(json.dumps(lost))
    notes: list[str] = []
    assert tuned_selection(tmp_path, notes) is None
    assert "809 ms against the defaults' 704 ms" in notes[0] and "the defaults serve" in notes[0]
    vs = {"artifact_id": "abc12345", "defaults_ttfa_p50": 0.704, "tuned_ttfa_p50": 0.809, "ttfa_ratio": 0.809 / 0.704}
    assert "not sooner than the defaults, so not applied" in ratio_line(vs) and "x sooner" not in ratio_line(vs)
