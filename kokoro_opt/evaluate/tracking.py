"""MLflow records of evaluations: one run per (artifact, evaluation settings), never two.

Default store: SQLite at experiments/mlflow.db with artifacts under experiments/mlruns (no server);
any other tracking URI (a server) works the same. Each run is tagged with `eval_key`, a hash of the
artifact id and every setting that shapes the numbers; evaluating again searches for it first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kokoro_opt.evaluate.report import EvalResult, mel_png, ops_json, ops_png, precision_summary, results_json
from kokoro_opt.evaluate.tracking_store import (
    EXPERIMENT_PREFIX,
    KIND_TAG,
    download_quietly,
    existing_client,
    experiment_id,
    machine_from_tags,
    machine_tags,
    open_client,
    our_experiments,
    resolve_tracking_uri,
)

KEY_TAG = "eval_key"
OWNER_TAG = "kokoro_opt_owner"  # boot id and process of the run's logger (`_abandoned`)
_PARAM_CHARS = 6000  # MLflow's cap on a param value; a longer one is cut, and says so (manifest.json has it whole)
NOTES_TAG = "mlflow.note.content"  # the run's description in MLflow's UI: the evaluation's notes


def recipe_family(name: str) -> str:
    """int8-dynamic, int8-static, int8-mixed -> int8: variants of one idea share an experiment."""
    return name.split("-")[0] or name


def evaluation_key(artifact_id: str, settings: dict[str, Any]) -> str:
    payload = json.dumps({"artifact": artifact_id, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _runs_with_key(client: Any, key: str) -> list[Any]:
    ids = our_experiments(client)
    return list(client.search_runs(ids, f"tags.{KEY_TAG} = '{key}'")) if ids else []


def find_evaluation(tracking_uri: str | None, key: str, needs: str | None = None) -> EvalResult | None:
    """The logged result of an identical evaluation, or None. Runs a crash left unfinished are removed (not one
    another process is logging now: `_abandoned`). `needs`: a metric the result must hold (`wer`: an evaluation
    asked for ASR that was not installed then is measured again)."""
    opened = existing_client(tracking_uri)
    if opened is None:
        return None
    _, client = opened
    found = None
    for run in _runs_with_key(client, key):
        if run.info.status == "FINISHED" and found is None and (needs is None or needs in run.data.metrics):
            found = run
        elif run.info.status != "FINISHED" and _abandoned(run):
            client.delete_run(run.info.run_id)
    return None if found is None else _result_from_run(found, client)


def _owner() -> str:
    """Who logs a run: this boot of this machine (a random id the kernel draws at boot, no host name), the process-id
    namespace (containers on one host share its boot but not its process ids) and the process."""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}:{os.getpid()}"
    return ""


def _abandoned(run: Any) -> bool:
    """Whether an unfinished run will never finish: it failed or was killed, or the process logging it on this
    machine, since this boot and in this process-id namespace, is gone. A run another process may still be logging
    is left alone: two builds of one recipe evaluate it at once, and deleting the other's run failed it."""
    if run.info.status in ("FAILED", "KILLED"):
        return True
    boot, _, pid = run.data.tags.get(OWNER_TAG, "").rpartition(":")
    if not pid.isdigit() or not boot or boot != _owner().rpartition(":")[0]:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _result_from_run(run: Any, client: Any) -> EvalResult:
    tags, metrics = run.data.tags, dict(run.data.metrics)
    ops = {k.split(".", 1)[1]: v for k, v in metrics.items() if k.startswith("op_seconds.")} or _logged_ops(client, run)
    return EvalResult(
        label=tags.get("artifact_name", "?"),
        artifact_id=tags.get("artifact_id", "?"),
        kind=tags.get("runtime", "onnx"),
        external=tags.get("external") == "true",
        reference_id=tags.get("reference_id") or None,
        is_reference=tags.get("is_reference") == "true",
        run_id=run.info.run_id,
        skipped=True,
        metrics={k: v for k, v in metrics.items() if not k.startswith(("op_seconds.", "op_share."))},
        op_times=dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        machine=machine_from_tags(tags),
        notes=[line for line in tags.get(NOTES_TAG, "").splitlines() if line],  # said again when found logged
    )


def _flat(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        cut = " ... (cut: manifest.json has it whole)"
        out[prefix] = text if len(text) <= _PARAM_CHARS else text[: _PARAM_CHARS - len(cut)] + cut


def _params(runner: Any, settings: dict[str, Any], threads: int, machine: dict[str, Any]) -> dict[str, str]:
    from kokoro_opt.artifacts import versions
    from kokoro_opt.runtime.session import SessionSettings

    manifest = runner.manifest
    recipe = manifest.recipe or {}
    out: dict[str, str] = {}
    kinds = ">".join(str(stage.get("kind", "?")) for stage in recipe.get("stages", []))
    _flat("recipe", {"name": recipe.get("name", "?"), "hash": manifest.recipe_hash or "", "stages": kinds or "export"}, out)
    _flat("export", recipe.get("export", {}), out)
    for i, stage in enumerate(recipe.get("stages", [])):
        _flat(f"stage.{i}.{stage.get('kind', '?')}", {k: v for k, v in stage.items() if k != "kind"}, out)
    _flat("ort", asdict(SessionSettings(intra_op_num_threads=threads)), out)
    _flat("version", versions(), out)
    _flat("built_with", runner.built_with, out)
    isa = machine.get("isa", [])
    shown = {k: v for k, v in machine.items() if k != "versions"}  # the versions are the version.* params
    _flat("machine", {**shown, "isa": ",".join(isa), "avx512_vnni": "avx512_vnni" in isa}, out)
    _flat("eval", settings, out)
    return out


def _git_commit() -> str | None:
    """The commit of the kokoro-opt checkout that measured (not of the folder it was started from), "+changes" when
    its tracked files differ from it: the numbers are then of code no commit holds."""
    from kokoro_opt.paths import PROJECT_ROOT

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False, cwd=PROJECT_ROOT)

    try:
        head, changed = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changed.returncode == 0 and changed.stdout.strip() else "")


# The columns a person compares artifacts by (a compare run logs these per artifact); an evaluation
# logs every other scalar too, but the per-op profile (one value per ONNX op type, 200+ of them)
# goes to profile/ops.json instead of the metric columns.
HEADLINE_METRICS = (
    "speedup_vs_reference", "rtf_p50", "ttfa_p50", "pesq_mean", "pesq_min", "phrase_pesq_mean", "mcd_mean", "wer_delta",
    "size_mb", "peak_rss_mb",
    "coreml_partitions", "coreml_node_share",
)  # fmt: skip
OPS_FILE = "profile/ops.json"


def _metrics(result: EvalResult) -> dict[str, float]:
    return {k: float(v) for k, v in result.metrics.items() if v is not None and math.isfinite(v)}


def _logged_ops(client: Any, run: Any) -> dict[str, float]:
    """The per-op profile of a logged evaluation (profile/ops.json); {} if it has none."""
    try:
        with tempfile.TemporaryDirectory(prefix="kokoro-opt-ops-") as tmp:
            local = download_quietly(client, run.info.run_id, OPS_FILE, tmp)
            return {row["op"]: row["seconds"] for row in json.loads(Path(local).read_text(encoding="utf-8"))["ops"]}
    except Exception:  # an older run or a store without the file: the profile is optional
        return {}


def _log_batch(client: Any, run_id: str, metrics: dict[str, float], params: dict[str, str]) -> None:
    from mlflow.entities import Metric, Param

    stamp = int(time.time() * 1000)
    # six significant digits: what the measurements resolve; the UI shows them without float noise
    items = [Metric(k, float(f"{v:.6g}"), stamp, 0) for k, v in metrics.items()]
    for i in range(0, len(items), 900):  # MLflow takes at most 1000 metrics and 100 params per batch
        client.log_batch(run_id, metrics=items[i : i + 900])
    pairs = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(pairs), 90):
        client.log_batch(run_id, params=pairs[i : i + 90])


def log_evaluation(
    tracking_uri: str | None, result: EvalResult, runner: Any, settings: dict[str, Any], key: str, pareto: Path | None = None
) -> str:
    """One run for this (artifact, settings): headline metrics, params saying what was built and where
    it was measured, tags, and files (manifest, metrics JSON, per-op profile, precision map, sample
    WAVs, plots). An earlier run with the same key (a forced re-evaluation) is replaced."""
    from kokoro_opt.audio import write_wav
    from kokoro_opt.machine import fingerprint

    uri = resolve_tracking_uri(tracking_uri)
    client = open_client(uri)
    machine = result.machine or fingerprint()
    manifest = runner.manifest
    family = "peers" if result.external else recipe_family(manifest.name or result.label)
    experiment = experiment_id(client, uri, EXPERIMENT_PREFIX + family)
    weights = manifest.weights.model_dump() if manifest.weights else {}
    tags = {
        KEY_TAG: key,
        KIND_TAG: "evaluation",
        OWNER_TAG: _owner(),
        "artifact_id": result.artifact_id,
        "artifact_name": result.label,
        "runtime": result.kind,
        "external": str(result.external).lower(),
        "is_reference": str(result.is_reference).lower(),
        "reference_id": result.reference_id or "",
        "weights_source": str(weights.get("source", "")),
        "weights_sha256": str(weights.get("sha256", "")),
        "corpus_sha256": str(settings.get("corpus_sha256", "")),
        **machine_tags(machine),
    }
    if result.notes:
        tags[NOTES_TAG] = "\n".join(result.notes)
    if commit := _git_commit():
        tags["git_commit"] = commit
    started, ended = result.span_ms or (None, None)  # the run spans the measuring, not only the logging
    # a peer's id is its name and a hash of its weights ("pytorch-eager-a7dbb1c2"): its label says the name
    short = result.artifact_id.rpartition("-")[2] if result.external else result.artifact_id
    run = client.create_run(experiment, start_time=started, tags=tags, run_name=f"{result.label}-{short[:8]}-{key[:6]}")
    run_id = str(run.info.run_id)
    try:
        params = _params(runner, settings, int(settings.get("threads", 0)), machine)
        _flat("precision", precision_summary(Path(runner.folder)), params)
        _log_batch(client, run_id, _metrics(result), params)
        with tempfile.TemporaryDirectory(prefix="kokoro-opt-mlflow-") as tmp:
            folder = Path(tmp)
            (folder / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
            (folder / "machine.json").write_text(json.dumps(machine, indent=2, sort_keys=True), encoding="utf-8")
            (folder / "metrics.json").write_text(results_json([result], {"settings": settings}), encoding="utf-8")
            (folder / "profile").mkdir()
            (folder / OPS_FILE).write_text(ops_json(result.op_times), encoding="utf-8")
            if (Path(runner.folder) / "precision_map.json").is_file():
                shutil.copy2(Path(runner.folder) / "precision_map.json", folder / "precision_map.json")
            (folder / "samples").mkdir()
            (folder / "plots").mkdir()
            if pareto is not None and pareto.is_file():
                shutil.copy2(pareto, folder / "plots" / "pareto.png")
            rate = int(result.samples.get("rate", 24_000))
            for i, (name, test, ref) in enumerate(result.samples.get("clips", [])):
                stem = f"{i:02d}-{name.replace('/', '_').replace('@', '_')}"
                write_wav(folder / "samples" / f"{stem}.wav", test, rate)
                if ref is not None and not result.is_reference:
                    write_wav(folder / "samples" / f"{stem}.fp32.wav", ref, rate)
                    mel_png(ref, test, rate, folder / "plots" / f"mel-{stem}.png", f"{result.label}: {name}")
            ops_png(result.op_times, folder / "plots" / "ops.png", f"{result.label}: ORT time by op type")
            client.log_artifacts(run_id, str(folder))
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, end_time=ended)
    _replace_earlier(client, key, run_id)
    return run_id


def _replace_earlier(client: Any, key: str, run_id: str) -> None:
    """Delete the earlier runs of `key` (a forced evaluation, an earlier comparison session, one a crash left) with
    their child runs, once `run_id` is whole: killed while logging, it leaves the last good run. One another
    process is logging now stays (`_abandoned`)."""
    for old in _runs_with_key(client, key):
        if old.info.run_id != run_id and (old.info.status == "FINISHED" or _abandoned(old)):
            for child in client.search_runs([old.info.experiment_id], f"tags.`mlflow.parentRunId` = '{old.info.run_id}'"):
                client.delete_run(child.info.run_id)
            client.delete_run(old.info.run_id)


def log_comparison(tracking_uri: str | None, results: list[EvalResult], settings: dict[str, Any], plot: Path | None) -> str:
    """A compare session as a run in `kokoro-opt-compare` (its settings, table and plot) with one child run per
    artifact holding that artifact's headline metrics under their plain names, so that MLflow's compare views plot
    the artifacts of one session against each other. Keyed by (artifact set, settings): comparing the same set
    again replaces the earlier session's runs once the new ones are whole."""
    from kokoro_opt.machine import fingerprint

    uri = resolve_tracking_uri(tracking_uri)
    client = open_client(uri)
    machine = next((r.machine for r in results if r.machine), None) or fingerprint()
    ids = sorted(r.artifact_id for r in results)
    key = evaluation_key("+".join(ids), settings)
    tags = {KEY_TAG: key, KIND_TAG: "comparison", OWNER_TAG: _owner(), "artifacts": ",".join(ids)[:_PARAM_CHARS],
            **machine_tags(machine)}  # fmt: skip
    if commit := _git_commit():
        tags["git_commit"] = commit
    # its key's head tells apart comparisons of the same artifacts under other settings, as evaluations' names do
    name = "compare-" + "-".join(sorted({r.label.replace(" ", "_") for r in results}))[:200] + f"-{key[:6]}"
    experiment = experiment_id(client, uri, EXPERIMENT_PREFIX + "compare")
    spans = [r.span_ms for r in results if r.span_ms]
    run_id = str(client.create_run(experiment, start_time=min(s[0] for s in spans) if spans else None, tags=tags,
                                   run_name=name).info.run_id)  # fmt: skip
    labels = [r.label for r in results]
    # two builds of one recipe share a label: their id keeps them apart
    names = [f"{r.label}-{r.artifact_id[:8]}" if labels.count(r.label) > 1 else r.label for r in results]
    try:
        params: dict[str, str] = {}
        _flat("eval", settings, params)
        _log_batch(client, run_id, {}, params)
        for r, label in zip(results, names, strict=True):
            child = client.create_run(experiment, run_name=label, tags={
                "mlflow.parentRunId": run_id, KIND_TAG: "comparison-artifact", "artifact_id": r.artifact_id,
                "artifact_name": r.label, "external": str(r.external).lower(), "is_reference": str(r.is_reference).lower(),
                **machine_tags(machine)})  # fmt: skip
            metrics = {m: r.metric(m) for m in HEADLINE_METRICS}
            _log_batch(client, child.info.run_id, {k: v for k, v in metrics.items() if math.isfinite(v)}, {})
            client.set_terminated(child.info.run_id)
        with tempfile.TemporaryDirectory(prefix="kokoro-opt-mlflow-") as tmp:
            (Path(tmp) / "compare.json").write_text(results_json(results, {"settings": settings}), encoding="utf-8")
            rows = ["artifact," + ",".join(HEADLINE_METRICS)]  # the side-by-side table, one artifact a row
            rows += [
                f"{n}," + ",".join(f"{r.metric(m):.6g}" for m in HEADLINE_METRICS) for r, n in zip(results, names, strict=True)
            ]
            (Path(tmp) / "compare.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
            (Path(tmp) / "machine.json").write_text(json.dumps(machine, indent=2, sort_keys=True), encoding="utf-8")
            client.log_artifacts(run_id, tmp)
        if plot is not None and plot.is_file():
            client.log_artifact(run_id, str(plot))
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, end_time=max(s[1] for s in spans) if spans else None)
    _replace_earlier(client, key, run_id)
    for r in results:
        r.run_id = run_id
    return run_id


def artifact_files(tracking_uri: str | None, run_id: str) -> list[str]:
    """Paths of the files logged with a run (recursively), for tests and reports."""
    client = open_client(resolve_tracking_uri(tracking_uri))
    found, stack = [], [""]
    while stack:
        for item in client.list_artifacts(run_id, stack.pop() or None):
            (stack if item.is_dir else found).append(item.path)
    return sorted(found)
