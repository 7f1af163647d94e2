"""Evaluation end to end on the tiny model: real ORT sessions, a real MLflow SQLite store, real peers."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kokoro_opt.artifacts import Artifact
from kokoro_opt.evaluate import ranking, tracking, tracking_store
from kokoro_opt.evaluate.asr import asr_installed
from kokoro_opt.evaluate.corpus import load_corpus
from kokoro_opt.evaluate.report import EvalResult, pareto_front, pareto_png
from kokoro_opt.evaluate.run import evaluate_artifacts, evaluation_settings
from kokoro_opt.machine import describe, fingerprint
from kokoro_opt.recipe import EvaluateConfig
from tests.servers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
HAS_ASR = asr_installed()
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*noload.*")]  # MLflow's own SQLAlchemy usage, not ours


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def fast() -> EvaluateConfig:
    """One short sentence, one timed run: a tiny-model evaluation in seconds (ASR when installed)."""
    return EvaluateConfig(runs=1, warmup=1, sentences=1, phrases=1, threads=2, asr=HAS_ASR)


@pytest.fixture(scope="module")
def evaluated(tiny_artifact: Artifact, fast: EvaluateConfig, store: str) -> EvalResult:
    [result] = evaluate_artifacts([tiny_artifact], fast, tracking_uri=store)
    return result


# ---- evaluate + MLflow --------------------------------------------------------------------------


def test_evaluate_measures_the_reference_against_itself(evaluated: EvalResult, tiny_artifact: Artifact) -> None:
    m = evaluated.metrics
    assert evaluated.is_reference and evaluated.reference_id == tiny_artifact.id
    assert m["rtf_p50"] > 0 and m["latency_p50"] > 0 and m["load_seconds"] > 0
    assert m["ttfa_p50"] >= m["ttfa_model_p50"] > 0 and m["first_chunk_tokens"] <= 40
    assert m["peak_rss_mb"] > m["rss_baseline_mb"] > 0
    assert m["size_mb"] == pytest.approx(tiny_artifact.model_file.stat().st_size / 1e6)
    assert m["speedup_vs_reference"] == 1.0 and m["mcd_mean"] == 0.0 and m["durations_equal_pct"] == 100.0
    # the short-phrase slice: scored, but apart from the sentence numbers
    assert m["utterances"] == 1 and m["phrases"] == 1 and [u["kind"] for u in evaluated.utterances][-1] == "phrase"
    assert m["phrase_mcd_mean"] == 0.0 and m["phrase_latency_p50"] > 0 and m["phrase_speedup_vs_reference"] == 1.0
    assert m["bad_outputs"] == 0 and m["edge_inputs_ok"] == 1.0
    # the profile's structure, not its order: which op leads moves with the machine and its load
    seconds = list(evaluated.op_times.values())
    assert {"Conv", "ConvTranspose", "InstanceNormalization"} <= set(evaluated.op_times) and min(seconds) >= 0
    assert seconds == sorted(seconds, reverse=True) and sum(seconds) > 0
    if HAS_ASR:  # the ASR path ran: tiny speaks noise, so only the plumbing is checked here
        assert m["wer_delta"] == 0.0 and math.isfinite(m["wer"])
        assert "transcript" in evaluated.utterances[0]


def test_the_run_is_found_with_metrics_params_tags_and_files(evaluated: EvalResult, store: str, tiny_artifact: Artifact) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("kokoro-opt-tiny")
    [run] = client.search_runs([experiment.experiment_id], f"tags.artifact_id = '{tiny_artifact.id}'")
    assert run.info.run_id == evaluated.run_id and run.info.status == "FINISHED"
    assert run.data.metrics["rtf_p50"] == pytest.approx(evaluated.metrics["rtf_p50"], rel=1e-5)  # logged to 6 digits
    # headline metrics are the columns; the per-op profile is a file, not 200+ columns
    assert set(tracking.HEADLINE_METRICS) - {"pesq_mean", "pesq_min", "phrase_pesq_mean", "wer_delta"} <= set(run.data.metrics)
    assert not [k for k in run.data.metrics if k.startswith("op_")] and len(run.data.metrics) < 60
    assert run.data.params["recipe.stages"] == "export"
    assert run.data.params["recipe.name"] == "tiny" and run.data.params["eval.runs"] == "1"
    experiment = MlflowClient(store).get_experiment(run.info.experiment_id)  # opens on the runs table
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.params["machine.cores"] and "machine.avx512_vnni" in run.data.params
    assert run.data.params["ort.intra_op_num_threads"] == "2" and "version.onnxruntime" in run.data.params
    assert run.data.tags["weights_source"] == "tiny" and run.data.tags["corpus_sha256"] == load_corpus().sha256
    here = fingerprint()  # the machine is part of the record: tags, params, the result's JSON and machine.json
    assert evaluated.machine == here and evaluated.to_json()["machine"]["id"] == here["id"]
    assert run.data.tags["machine.id"] == here["id"] and run.data.tags["machine.cores"] == str(here["cores"])
    assert run.data.tags["machine.cpu"] == here["cpu"] and run.data.tags["machine.arch"] == here["arch"]
    assert run.data.params["machine.id"] == here["id"] and run.data.params["eval.machine_id"] == here["id"]
    files = tracking.artifact_files(store, run.info.run_id)
    assert {"manifest.json", "metrics.json", "machine.json", "plots/ops.png", "profile/ops.json"} <= set(files)
    ops = json.loads(Path(MlflowClient(store).download_artifacts(run.info.run_id, "profile/ops.json")).read_text())
    shares = [row["share"] for row in ops["ops"]]  # each op type's share of the kernel time, largest first
    assert shares == sorted(shares, reverse=True) and sum(shares) == pytest.approx(1.0, abs=0.01)
    assert {"Conv", "LSTM", "ConvTranspose"} <= {row["op"] for row in ops["ops"]}
    logged = json.loads(Path(MlflowClient(store).download_artifacts(run.info.run_id, "machine.json")).read_text())
    assert logged == here
    assert any(f.startswith("samples/") and f.endswith(".wav") for f in files)


def test_a_second_evaluation_reuses_the_run(
    evaluated: EvalResult, tiny_artifact: Artifact, fast: EvaluateConfig, store: str
) -> None:
    from mlflow.tracking import MlflowClient

    [again] = evaluate_artifacts([tiny_artifact], fast, tracking_uri=store)
    assert again.skipped and again.run_id == evaluated.run_id and again.machine["id"] == fingerprint()["id"]
    assert again.metrics["rtf_p50"] == pytest.approx(evaluated.metrics["rtf_p50"], rel=1e-5)  # read back: 6 digits
    client = MlflowClient(store)
    ids = [e.experiment_id for e in client.search_experiments()]
    assert len(client.search_runs(ids, f"tags.artifact_id = '{tiny_artifact.id}'")) == 1
    # other settings are another evaluation, under another key
    corpus = load_corpus()
    other = evaluation_settings(fast.model_copy(update={"runs": 2}), corpus, tiny_artifact.id)
    assert tracking.find_evaluation(store, tracking.evaluation_key(tiny_artifact.id, other)) is None
    # a result without a metric its settings asked for (`wer`, when ASR was not installed then) is measured again
    same = tracking.evaluation_key(tiny_artifact.id, evaluation_settings(fast, corpus, tiny_artifact.id))
    assert not HAS_ASR or tracking.find_evaluation(store, same, needs="wer") is not None  # this one heard its audio
    assert tracking.find_evaluation(store, same, needs="a_metric_it_lacks") is None


def test_best_evaluated_picks_a_passing_artifact(evaluated: EvalResult, store: str, tmp_path: Path) -> None:
    best = ranking.best_evaluated(store, min_pesq=3.8)
    assert best is not None and best["artifact_id"] == evaluated.artifact_id  # fp32 passes by definition
    assert "fp32 reference" in best["reason"]
    # an artifact deleted since its evaluation is never picked
    assert ranking.best_evaluated(store, min_pesq=3.8, available=lambda found: found != evaluated.artifact_id) is None
    empty = tmp_path / "none" / "mlflow.db"
    assert ranking.best_evaluated(f"sqlite:///{empty}", 3.8) is None and not empty.exists()


def test_best_holds_short_phrases_to_their_own_budget(evaluated: EvalResult, store: str, tmp_path: Path) -> None:
    """An artifact within the sentence budget but below the phrase budget is not served as best."""
    import shutil

    from mlflow.tracking import MlflowClient

    shared = tmp_path / "phrases.db"
    shutil.copy(store.removeprefix("sqlite:///"), shared)
    client, uri = MlflowClient(f"sqlite:///{shared}"), f"sqlite:///{shared}"
    client.set_tag(evaluated.run_id, "is_reference", "false")  # as if it were an optimised artifact
    client.log_metric(evaluated.run_id, "pesq_mean", 4.1)
    client.log_metric(evaluated.run_id, "phrase_pesq_mean", 3.5)
    assert ranking.best_evaluated(uri, 3.8) is not None  # without a phrase budget, sentences decide
    assert ranking.best_evaluated(uri, 3.8, min_phrase_pesq=3.6) is None
    best = ranking.best_evaluated(uri, 3.8, min_phrase_pesq=3.4)
    assert best is not None and "PESQ 4.10 >= 3.8, phrases 3.50 >= 3.4" in best["reason"]


def test_best_ranks_this_machines_evaluations_and_says_when_it_has_none(
    evaluated: EvalResult, store: str, tiny_artifact: Artifact, tmp_path: Path
) -> None:
    """The best artifact depends on the CPU: `serve --artifact best` asks where each was measured."""
    import shutil

    from mlflow.tracking import MlflowClient

    from kokoro_opt.select import resolve_artifact

    here = fingerprint()["id"]
    best = ranking.best_evaluated(store, 3.8, machine_id=here)
    assert best is not None and best["measured_here"] and f"measured on this machine (id {here})" in best["reason"]

    # the same store as a team's shared one: its only evaluation was measured on another machine
    shared = tmp_path / "shared.db"
    shutil.copy(store.removeprefix("sqlite:///"), shared)
    client = MlflowClient(f"sqlite:///{shared}")
    client.set_tag(evaluated.run_id, "machine.id", "0123456789ab")
    client.set_tag(evaluated.run_id, "machine.cpu", "Other CPU")
    elsewhere = ranking.best_evaluated(f"sqlite:///{shared}", 3.8, machine_id=here)
    assert elsewhere is not None and elsewhere["artifact_id"] == evaluated.artifact_id and not elsewhere["measured_here"]
    assert "another machine (Other CPU, id 0123456789ab)" in elsewhere["reason"]
    selection = resolve_artifact("best", tiny_artifact.path.parent.parent, tracking_uri=f"sqlite:///{shared}")
    assert selection.artifact.id == evaluated.artifact_id
    assert f"evaluate them here: kokoro-opt evaluate {tiny_artifact.path}" in selection.reason

    # a server that resolved `best` never imports MLflow itself: it would hold ~200 MB for the server's lifetime
    import subprocess
    import sys

    resolve = (
        "import sys; from pathlib import Path; from kokoro_opt.select import resolve_artifact; "
        f"s = resolve_artifact('best', Path({str(tiny_artifact.path.parent.parent)!r}), 'sqlite:///{shared}'); "
        "print(s.artifact.id, 'mlflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", resolve], capture_output=True, text=True, check=True).stdout.split()
    assert out == [evaluated.artifact_id, "False"]


@pytest.fixture(scope="module")
def tiny_ort(tiny_recipe: Any, artifacts_root: Path, tiny_artifact: Artifact) -> Artifact:
    """A derived artifact through the real build: tiny export -> .ort (its reference is the export)."""
    from kokoro_opt.build import build
    from kokoro_opt.recipe import parse_recipe

    data = tiny_recipe.model_dump(mode="json", by_alias=True) | {"name": "tiny-ort", "stages": [{"kind": "ort"}]}
    return build(parse_recipe(data), artifacts_root).artifact


def test_a_derived_artifact_is_measured_beside_its_fp32_export(
    tiny_ort: Artifact, tiny_artifact: Artifact, fast: EvaluateConfig
) -> None:
    [result] = evaluate_artifacts([tiny_ort], fast.model_copy(update={"asr": False}), log=False)
    m = result.metrics
    assert result.reference_id == tiny_artifact.id and not result.is_reference
    assert math.isfinite(m["speedup_vs_reference"]) and m["speedup_vs_reference"] > 0  # measured interleaved
    assert m["durations_equal_pct"] == 100.0 and m["mcd_mean"] < 0.5 and abs(m["high_band_db_mean"]) < 0.5


def test_a_reference_measured_alongside_is_timed_and_heard_not_probed(tiny_ort: Artifact, fast: EvaluateConfig) -> None:
    """An evaluation probes the model it reports (memory, profile, its graph for Core ML); the fp32 export beside it is
    there for its timing and audio."""
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.evaluate.run import measure
    from kokoro_opt.evaluate.runners import runner_groups

    [group] = runner_groups([tiny_ort], None)
    config = fast.model_copy(update={"asr": False})
    subject, reference = measure([r.load(config.threads) for r in group], config, load_corpus(), probe=1)
    assert reference.is_reference and math.isfinite(reference.metrics["latency_p50"])
    assert "coreml_partitions" in subject.metrics and "coreml_partitions" not in reference.metrics
    assert math.isfinite(subject.metrics["peak_rss_mb"]) and not math.isfinite(reference.metrics["peak_rss_mb"])


# ---- peers --------------------------------------------------------------------------------------


def test_kokoro_onnx_int8_is_imported_as_an_external_artifact(artifacts_root: Path) -> None:
    from kokoro_opt.audio import is_speechlike
    from kokoro_opt.evaluate.runners import PEER_INT8, Runner, import_kokoro_onnx
    from kokoro_opt.text import phonemize, tokenize

    peer = import_kokoro_onnx(artifacts_root)
    assert peer.manifest.external and peer.kokoro["audio_gain"] == 1.5 and peer.name == PEER_INT8
    assert import_kokoro_onnx(artifacts_root).path == peer.path  # built once
    runner = Runner(peer.name, peer.id, "onnx", peer.path, peer.manifest, external=True).load(threads=2)  # checks input dtypes
    assert [i.name for i in runner.profiled.session.get_inputs()] == ["tokens", "style", "speed"]
    audio, durations = runner.synth_tokens(tokenize(phonemize("The boy was there when the sun rose."), runner.vocab), "jf_alpha")
    assert durations is None  # its graph has no durations output
    assert is_speechlike(audio) and 1.2 < len(audio) / 24_000 < 4.0 and np.abs(audio).max() < 1.0


def test_pytorch_eager_peer_runs_the_same_weights(tiny_artifact: Artifact) -> None:
    from kokoro_opt.audio import is_speechlike
    from kokoro_opt.evaluate.runners import Runner, reference_folder, torch_peer
    from kokoro_opt.text import phonemize, tokenize

    eager = torch_peer(tiny_artifact, reference_folder(tiny_artifact))
    assert eager is not None and eager.kind == "torch" and eager.reference_id == tiny_artifact.id
    export = Runner("fp32", tiny_artifact.id, "onnx", tiny_artifact.path, tiny_artifact.manifest).load(2)
    tokens = tokenize(phonemize("Hello world."), export.vocab)
    audio, durations = eager.load(2).synth_tokens(tokens, "tiny_0")
    ref_audio, ref_durations = export.synth_tokens(tokens, "tiny_0")
    # Same weights: the same predicted durations. (The tiny random vocoder is chaotic, so its waveforms
    # drift apart; the real-weights test below checks eager vs export quality.)
    assert np.array_equal(durations, ref_durations) and len(audio) == len(ref_audio) and is_speechlike(audio)


def test_pytorch_eager_loads_no_weights_a_fetched_manifest_chose(tiny_artifact: Artifact, tmp_path: Path) -> None:
    """A pushed manifest is written by whoever pushed it: its recipe's repository (or folder) is not downloaded and
    loaded for the eager peer of a fetched artifact; the official weights would be."""
    import json

    from kokoro_opt.artifacts import link_or_copy, open_artifact
    from kokoro_opt.evaluate.runners import reference_folder, torch_peer

    folder = tmp_path / "tiny" / tiny_artifact.id
    link_or_copy(tiny_artifact.path, folder)
    for name, edit in (("manifest.json", lambda m: m | {"recipe": m["recipe"] | {"weights": {"repo_id": "someone/else"}},
                                                        "weights": m["weights"] | {"source": "huggingface"}}),
                       ("build.json", lambda b: b | {"fetched_from": "MLflow run 0123"})):  # fmt: skip
        data = edit(json.loads((folder / name).read_text()))
        (folder / name).unlink()  # a hard link to the fixture's file: replaced, not written through
        (folder / name).write_text(json.dumps(data))
    assert torch_peer(open_artifact(folder), reference_folder(tiny_artifact)) is None  # no download was tried


def test_compare_cli_prints_one_table_as_json_and_logs_it(
    tiny_artifact: Artifact, artifacts_root: Path, store: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from kokoro_opt.cli import app

    args = [
        "compare",
        str(tiny_artifact.path),
        "--artifacts",
        str(artifacts_root),
        "--peer",
        "kokoro-onnx-int8",
        "--sentences",
        "1",
        "--phrases",
        "1",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--no-asr",
        "--tracking-uri",
        store,
        "--plot",
        str(tmp_path / "pareto.png"),
        "--json",
    ]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    rows = {r["label"]: r for r in json.loads(done.stdout)["results"]}
    assert set(rows) == {"tiny", "kokoro-onnx-int8"}
    assert rows["kokoro-onnx-int8"]["external"] and rows["kokoro-onnx-int8"]["metrics"]["rtf_p50"] > 0
    assert rows["kokoro-onnx-int8"]["metrics"].get("pesq_mean") is None  # no real-weights fp32 export here
    assert rows["kokoro-onnx-int8"]["metrics"]["edge_inputs_ok"] == 1.0  # a peer is probed like the artifact
    assert rows["tiny"]["metrics"]["speedup_vs_reference"] == 1.0
    assert rows["tiny"]["metrics"]["coreml_partitions"] >= 1  # probed: its graph is analysed for Core ML too
    here = fingerprint()
    assert json.loads(done.stdout)["machine"] == here and rows["tiny"]["machine"]["id"] == here["id"]
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("kokoro-opt-compare").experiment_id

    def session() -> tuple[Any, dict[str, Any]]:
        runs = client.search_runs([experiment])
        [parent] = [r for r in runs if r.data.tags.get("kokoro_opt_kind") == "comparison"]
        return parent, {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}

    run, children = session()
    assert {"compare.json", "compare.csv", "machine.json"} <= set(tracking.artifact_files(store, run.info.run_id))
    table = Path(client.download_artifacts(run.info.run_id, "compare.csv", str(tmp_path))).read_text().splitlines()
    assert table[0].split(",")[:3] == ["artifact", "speedup_vs_reference", "rtf_p50"] and len(table) == 3
    assert table[1].startswith(("tiny,1,", "kokoro-onnx-int8,")) and {r.split(",")[0] for r in table[1:]} == set(rows)
    # one child run per artifact, its metrics under their own names: MLflow's compare views plot them side by side
    assert set(children) == set(rows) and children["kokoro-onnx-int8"].data.metrics["rtf_p50"] > 0
    assert children["tiny"].data.metrics["speedup_vs_reference"] == 1.0 and run.data.tags["machine.id"] == here["id"]
    again = CliRunner().invoke(app, args)  # the same comparison again replaces the session, children and all
    assert again.exit_code == 0, again.output
    rerun, children = session()
    assert rerun.info.run_id != run.info.run_id and set(children) == set(rows)
    assert len(client.search_runs([experiment])) == 1 + len(rows)  # the earlier session's parent and children gone

    # the tables: the machine line above them, whole although stdout is no terminal (rich assumes 80 columns)
    unlogged = [*args[: args.index("--peer")], *args[args.index("--sentences") : args.index("--tracking-uri")]]
    tables = CliRunner().invoke(app, [*unlogged, "--plot", str(tmp_path / "pareto.png"), "--no-log"])
    assert tables.exit_code == 0, tables.output
    lines = tables.stdout.splitlines()
    assert len(describe(here)) > 80 and describe(here) in lines
    assert lines.index(describe(here)) < next(i for i, line in enumerate(lines) if line.startswith("compare:"))


def test_evaluate_cli_skips_what_is_already_logged(evaluated: EvalResult, tiny_artifact: Artifact, store: str) -> None:
    from typer.testing import CliRunner

    from kokoro_opt.cli import app

    args = [
        "evaluate",
        str(tiny_artifact.path),
        "--tracking-uri",
        store,
        "--sentences",
        "1",
        "--phrases",
        "1",
        "--runs",
        "1",
        "--warmup",
        "1",
        "--threads",
        "2",
        "--asr" if HAS_ASR else "--no-asr",
    ]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert f"already evaluated with these settings (MLflow run {evaluated.run_id})" in " ".join(done.output.split())
    assert "Downloading artifacts" not in done.output  # the logged profile is read back without MLflow's progress bar
    lines = done.stdout.splitlines()
    table = next(i for i, line in enumerate(lines) if line.strip() == "evaluation")  # the table's title
    assert describe(fingerprint()) in lines and lines.index(describe(fingerprint())) < table
    assert "another machine" not in done.output


def test_pareto_plot_and_front(tmp_path: Path) -> None:
    def result(label: str, rtf: float, pesq: float, wer: float) -> EvalResult:
        return EvalResult(label, label, "onnx", metrics={"rtf_p50": rtf, "pesq_mean": pesq, "wer": wer})

    results = [result("fp32", 0.4, 4.64, 0.05), result("int8", 0.2, 3.9, 0.06), result("bad", 0.3, 3.0, 0.2)]
    assert pareto_front([(0.4, 4.64), (0.2, 3.9), (0.3, 3.0)], higher_is_better=True) == [1, 0]
    png = pareto_png(results, tmp_path / "pareto.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pareto_png([EvalResult("x", "x", "onnx")], tmp_path / "none.png") is None


def test_mlflow_ui_serves_the_logged_runs(evaluated: EvalResult, store: str) -> None:
    """The documented `mlflow ui --backend-store-uri ...` on a free loopback port, queried over REST."""
    port = free_port()
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(
        [str(mlflow_cli), "ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_healthy(base, server, 90), "mlflow ui did not start"
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/search?max_results=50", timeout=10) as reply:
            ids = [e["experiment_id"] for e in json.loads(reply.read())["experiments"]]
        request = urllib.request.Request(
            f"{base}/api/2.0/mlflow/runs/search",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"experiment_ids": ids, "filter": "tags.kokoro_opt_kind = 'evaluation'"}).encode(),
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            runs = json.loads(reply.read())["runs"]
        assert evaluated.run_id in {r["info"]["run_id"] for r in runs}
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_best_and_tuned_settings_follow_a_recipe_built_again(tiny_recipe, tmp_path: Path) -> None:
    """An older build of a recipe built again is not served: its evaluation may have timed faster by noise, or
    predate a fix in the code that made it. Building the earlier recipe again makes that build current again."""
    from kokoro_opt.build import build
    from kokoro_opt.recipe import parse_recipe
    from kokoro_opt.select import TUNED_FILE, resolve_artifact
    from tests.serve_helpers import record_evaluations

    root, uri = tmp_path / "artifacts", f"sqlite:///{tmp_path / 'mlflow.db'}"
    data = tiny_recipe.model_dump(mode="json", by_alias=True) | {"name": "t-rebuilt"}
    first = parse_recipe(data)
    second = parse_recipe(data | {"stages": [{"kind": "simplify", "tool": "none", "ort_level": "basic"}]})
    older = build(first, root).artifact
    newer = build(second, root).artifact
    record_evaluations(
        uri, [(older.id, {"speedup_vs_reference": 3.0}), (newer.id, {"speedup_vs_reference": 2.0})]
    )  # the superseded build timed faster
    assert resolve_artifact("best", root, uri).artifact.id == newer.id
    assert build(first, root).artifact.id == older.id  # from the cache, and now the recipe's current build
    assert resolve_artifact("best", root, uri).artifact.id == older.id

    (root / TUNED_FILE).write_text(
        json.dumps({"artifact_id": newer.id, "machine": fingerprint(), "study": "s", "session": {}, "chunking": {}})
    )
    picked = resolve_artifact("best", root, uri)
    assert picked.artifact.id == older.id and f"since built again as {older.id}: not applied" in picked.reason


@pytest.mark.parametrize(
    ("uri", "match"),
    [("postgresql://kokoro:secret@127.0.0.1:1/mlflow", "tracking database at postgresql://127.0.0.1:1/mlflow does not answer"),
     ("garbage", "is not a tracking store MLflow writes"), ("file:///somewhere", "is not a tracking store MLflow writes"),
     ("sqlite:///", "is an in-memory database"), ("sqlite://", "is an in-memory database"),
     ("sqlite:///:memory:", "is an in-memory database"), ("sqlite://x.db", "is an in-memory database"),
     ("sqllite:///mlflow.db", "MLflow has no tracking store for sqllite://"),
     (f"sqlite:///{Path(__file__).resolve()}", "is not an SQLite database")],
)  # fmt: skip
def test_a_tracking_store_that_cannot_answer_is_one_line_at_once(uri: str, match: str) -> None:
    """MLflow would retry a database that does not answer for minutes, and take a bare word for a folder of the
    file store it no longer writes; the password stays out of the message."""
    from kokoro_opt.errors import UserError

    with pytest.raises(UserError, match=re.escape(match)) as raised:
        tracking_store.existing_client(uri)
    assert "secret" not in str(raised.value)


def test_an_sqlite_store_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path) -> None:
    """Else the results of minutes of measuring are lost when they are logged."""
    from kokoro_opt.errors import UserError

    (tmp_path / "a-file").write_text("")
    for db, why in ((tmp_path / "a-file" / "mlflow.db", "File exists"), (tmp_path, "is not a file")):
        with pytest.raises(UserError, match=rf"cannot write the SQLite tracking store .*{why}"):
            tracking_store.require_answers(f"sqlite:///{db}")
    tracking_store.require_answers(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")  # a new folder is made
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "mlflow.db").exists()


def test_a_tuned_pick_reads_no_evaluation_records(tiny_artifact, tmp_path: Path) -> None:
    """`best` with a tuned.json that applies is that artifact: the evaluation records are not read (MLflow, in a
    child process, ~200 MB and seconds of start-up), so a tracking store that does not even answer is never asked."""
    import shutil

    from kokoro_opt.select import TUNED_FILE, resolve_artifact

    root = tmp_path / "artifacts"
    shutil.copytree(tiny_artifact.path, root / tiny_artifact.name / tiny_artifact.id)
    tuned = {"artifact_id": tiny_artifact.id, "machine": fingerprint(), "study": "s", "session": {}, "chunking": {}}
    (root / TUNED_FILE).write_text(json.dumps(tuned))
    picked = resolve_artifact("best", root, "postgresql://kokoro:secret@127.0.0.1:1/mlflow")
    assert picked.artifact.id == tiny_artifact.id and "tuned by study 's'" in picked.reason


def test_tuned_settings_that_apply_are_what_serve_runs(tiny_artifact, tmp_path: Path) -> None:
    """tune's end-to-end test applies its winner only when it beat the defaults side by side, which a busy machine
    may not see: here a tuned.json that applies sets the session's threads and the server's chunking; one that did
    not beat the defaults sets nothing."""
    import shutil

    from kokoro_opt.runtime import open_synthesizer
    from kokoro_opt.select import TUNED_FILE, resolve_artifact
    from kokoro_opt.serve import ServeConfig

    root = tmp_path / "artifacts"
    shutil.copytree(tiny_artifact.path, root / tiny_artifact.name / tiny_artifact.id)
    session = {"intra_op_num_threads": 1, "execution_mode": "sequential"}
    chunking = {"first_chunk_tokens": 17, "chunk_tokens": 90}
    tuned = {"artifact_id": tiny_artifact.id, "machine": fingerprint(), "study": "s", "session": session, "chunking": chunking}
    (root / TUNED_FILE).write_text(json.dumps(tuned))
    picked = resolve_artifact("best", root, f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = ServeConfig.for_selection(picked)
    assert (config.first_chunk_tokens, config.chunk_tokens) == (17, 90)
    synth = open_synthesizer(picked.artifact, picked.settings)
    assert synth.session.get_session_options().intra_op_num_threads == 1  # the session ONNX Runtime runs
    (root / TUNED_FILE).write_text(json.dumps(tuned | {"applied": False, "not_applied": "slower"}))
    untuned = ServeConfig.for_selection(resolve_artifact("best", root, f"sqlite:///{tmp_path / 'mlflow.db'}"))
    assert (untuned.first_chunk_tokens, untuned.chunk_tokens) == (ServeConfig().first_chunk_tokens, ServeConfig().chunk_tokens)


def test_a_windowed_artifact_is_also_scored_as_a_stream_hears_it(tiny_recipe, artifacts_root, fast, store) -> None:
    """Beside its whole decoding: the stream's first audio, and its audio against the reference's same samples."""
    from tests.test_passes import build_with
    from tests.test_windows import WINDOWS

    windowed = build_with(tiny_recipe, artifacts_root, "t-windows", [{"kind": "simplify"}, WINDOWS]).artifact
    [result] = evaluate_artifacts([windowed], fast, tracking_uri=store)
    m = result.metrics
    assert m["served_windowed"] == 1.0 and not result.is_reference
    assert m["windowed_ttfa_p50"] - m["windowed_ttfa_model_p50"] == pytest.approx(m["frontend_seconds"])
    assert m["windowed_ttfa_model_p50"] > 0 and m["speedup_vs_reference"] > 0
    # the stream's own audio is scored: predicted statistics move it off the reference, which the whole decoding equals
    assert m["mcd_mean"] == 0.0 and 0 < m["windowed_mcd_mean"] < 50 and 0 < m["windowed_phrase_mcd_mean"] < 50
    assert math.isfinite(m["windowed_high_band_db_max"]) and m["windowed_pesq_scored"] == m["pesq_scored"]


def test_the_commit_an_evaluation_records_is_the_checkout_s_not_the_working_folder_s(tmp_path, monkeypatch) -> None:
    import subprocess

    from kokoro_opt.evaluate.tracking import _git_commit
    from kokoro_opt.paths import PROJECT_ROOT

    here = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=PROJECT_ROOT, check=False)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)  # started from a folder of another repository
    monkeypatch.chdir(tmp_path)
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                             cwd=PROJECT_ROOT, check=False).stdout.strip()  # fmt: skip
    expected = (here.stdout.strip() + ("+changes" if changed else "")) if here.returncode == 0 else None
    assert _git_commit() == expected  # "+changes": the numbers are of code no commit holds


def test_results_as_json_hold_no_nan_and_notes_print_as_written() -> None:
    """A score that could not be computed is null (strict JSON readers refuse NaN); a note's `kokoro-opt[asr]` is
    text, not Rich markup that would swallow `[asr]`."""
    import io

    from rich.console import Console

    from kokoro_opt.evaluate.report import print_results, results_json

    result = EvalResult("x", "a" * 16, "onnx", metrics={"rtf_p50": float("nan")}, notes=["pip install 'kokoro-opt[asr]'"])
    result.utterances = [{"text": "Hi.", "pesq": float("nan"), "rtf": 0.5}]
    data = json.loads(results_json([result]), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert data["results"][0]["utterances"] == [{"text": "Hi.", "pesq": None, "rtf": 0.5}]
    out = io.StringIO()
    print_results([result], Console(file=out, width=200))
    assert "pip install 'kokoro-opt[asr]'" in out.getvalue()


def test_two_builds_of_one_recipe_are_told_apart_in_tables_and_plots() -> None:
    from kokoro_opt.evaluate.report import distinct_labels

    results = [
        EvalResult("int8-mixed", "a" * 16, "onnx"),
        EvalResult("int8-mixed", "b" * 16, "onnx"),
        EvalResult("fp32", "c", "onnx"),
    ]
    assert distinct_labels(results) == ["int8-mixed aaaaaaaa", "int8-mixed bbbbbbbb", "fp32"]


def test_an_unfinished_run_is_removed_only_when_nothing_is_logging_it(tmp_path: Path) -> None:
    """Two builds of one recipe evaluate it at once: the first to look deleted the other's run while it was being
    logged, and failed it. A run is removed when it failed, or when the process logging it here is gone."""
    import subprocess
    import sys

    if not tracking._owner():
        pytest.skip("no boot id on this system: an unfinished run's logger cannot be told alive or gone")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.open_client(store)
    experiment = client.create_experiment(tracking.EXPERIMENT_PREFIX + "test", artifact_location=str(tmp_path / "runs"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    boot = tracking._owner().rpartition(":")[0]
    owners = {"gone": f"{boot}:{gone.stdout.strip()}", "alive": tracking._owner(), "unknown": "", "failed": ""}
    for name, owner in owners.items():
        run = client.create_run(experiment, tags={tracking.KEY_TAG: "k", tracking.OWNER_TAG: owner}, run_name=name)
        if name == "failed":
            client.set_terminated(run.info.run_id, "FAILED")
    assert tracking.find_evaluation(store, "k") is None
    left = {run.info.run_name for run in client.search_runs([experiment])}
    assert left == {"alive", "unknown"}  # still being logged, or nothing says it is not


def test_an_experiment_deleted_in_the_ui_is_restored_to_log_into(tmp_path: Path) -> None:
    """Deleted in MLflow's UI to start afresh, an experiment keeps its name until `mlflow gc`: logging into it
    failed after the whole measurement ("must be in the 'active' state")."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.open_client(store)
    name = tracking.EXPERIMENT_PREFIX + "test"
    first = tracking.experiment_id(client, store, name)
    run = client.create_run(first, tags={tracking.KEY_TAG: "k"})
    client.set_terminated(run.info.run_id)
    client.delete_experiment(first)
    assert tracking.experiment_id(client, store, name) == first
    assert client.get_experiment(first).lifecycle_stage == "active"
    assert client.search_runs([first]) == [] and tracking.find_evaluation(store, "k") is None  # its runs stay deleted
    client.create_run(first)  # as an evaluation's run


def test_a_long_param_is_cut_at_mlflow_s_limit_and_says_so() -> None:
    params: dict[str, str] = {}
    tracking._flat("export", {"sentences": ["x" * 100] * 80, "short": [1, 2]}, params)
    assert len(params["export.sentences"]) == 6000 and params["export.sentences"].endswith("(cut: manifest.json has it whole)")
    assert params["export.short"] == "[1, 2]"


def test_an_evaluation_found_logged_says_its_notes_again(tmp_path: Path) -> None:
    """Notes (an edge input that failed, no reference to score against) are the run's description in the UI, and
    a later `evaluate` that finds the run prints them again rather than only "already evaluated"."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.open_client(store)
    experiment = tracking.experiment_id(client, store, tracking.EXPERIMENT_PREFIX + "test")
    notes = ["edge input '?!' gave silence", "no fp32 export measured alongside: no quality numbers"]
    run = client.create_run(experiment, tags={tracking.KEY_TAG: "k", tracking.NOTES_TAG: "\n".join(notes)})
    client.set_terminated(run.info.run_id)
    found = tracking.find_evaluation(store, "k")
    assert found is not None and found.skipped and found.notes == notes
