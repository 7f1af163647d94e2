"""MLflow records of a study: one parent run per study, one nested run per finished trial, plots.

Runs are found again by tags (study key + trial number) before one is created, so a resumed or
re-synced study never logs a trial twice. The store is the evaluation store (SQLite under
experiments/ by default, see kokoro_opt.evaluate.tracking).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kokoro_opt.evaluate.tracking_store import (
    KIND_TAG,
    existing_client,
    experiment_id,
    machine_tags,
    open_client,
    our_experiments,
    resolve_tracking_uri,
)

EXPERIMENT = "kokoro-opt-tune"
log = logging.getLogger("kokoro_opt.tune")
_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


def redact(url: str) -> str:
    """A storage URL without its password: it goes into tags, tables and tuned.json."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an RDB URL: keep only the scheme
        return url.split("://", 1)[0] + "://..."


def study_key(storage: str, study: Any) -> str:
    """Storage, name and the uid set at creation: a deleted and re-created study does not inherit runs. (The storage
    as spelt: every study's records are keyed so, and one SQLite file named two ways is two keys.)"""
    uid = study.user_attrs.get("kokoro_opt.uid", "")
    return hashlib.sha256(f"{redact(storage)}|{study.study_name}|{uid}".encode()).hexdigest()[:16]


def recorded_evaluation(
    tracking_uri: str | None, artifact_id: str, scored: Callable[[dict[str, float]], bool]
) -> dict[str, float] | None:
    """Metrics of the most thorough (`scored` what is judged, most sentences, then newest) finished evaluation of an
    artifact: a larger one without a reference or ASR must not hide a smaller one that scored it."""
    opened = existing_client(tracking_uri)
    if opened is None:
        return None
    _, client = opened
    ids = our_experiments(client)
    query = f"tags.artifact_id = '{artifact_id}' and tags.{KIND_TAG} = 'evaluation' and attributes.status = 'FINISHED'"
    runs = list(client.search_runs(ids, query)) if ids else []
    if not runs:
        return None
    best = max(runs, key=lambda r: (scored(r.data.metrics), r.data.metrics.get("utterances", 0.0), r.info.start_time or 0))
    return dict(best.data.metrics)


def _finite(values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in values.items():
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


class StudyRecords:
    """The MLflow side of one study. Every call is best-effort: tracking must not kill a trial."""

    def __init__(self, tracking_uri: str | None, storage: str, study: Any) -> None:
        self.uri = resolve_tracking_uri(tracking_uri)
        self.study, self.key = str(study.study_name), study_key(storage, study)
        self.storage = redact(storage)
        self._client: Any = None
        self._experiment = ""
        self.parent_id: str | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = open_client(self.uri)
            self._experiment = experiment_id(self._client, self.uri, EXPERIMENT)
        return self._client

    def _find(self, extra: str) -> list[Any]:
        query = f"tags.study_key = '{self.key}' and {extra}"
        return list(self.client.search_runs([self._experiment], query, max_results=1000))

    def parent(self) -> str:
        """The study's run, created once (looked up by tags on every later run)."""
        if self.parent_id is None:
            self.client  # noqa: B018 (connects and creates the experiment)
            found = self._find(f"tags.{KIND_TAG} = 'tuning-study'")
            if found:
                self.parent_id = str(found[0].info.run_id)
            else:
                tags = {KIND_TAG: "tuning-study", "study_key": self.key, "study": self.study, "optuna_storage": self.storage}
                mine = str(self.client.create_run(self._experiment, tags=tags, run_name=f"study-{self.study}").info.run_id)
                self.parent_id = self._first_of(f"tags.{KIND_TAG} = 'tuning-study'", mine)
        return self.parent_id

    def _first_of(self, query: str, mine: str) -> str:
        """Two workers (processes or machines) that created the same run at once: the earliest one stays,
        the others delete their own. Check-then-create cannot be atomic over the MLflow API; this is."""
        runs = sorted(self._find(query), key=lambda r: (r.info.start_time or 0, r.info.run_id))
        keeper = str(runs[0].info.run_id) if runs else mine
        if keeper != mine:
            self.client.delete_run(mine)
        return keeper

    def logged_trials(self) -> list[int]:
        """Trial numbers with an MLflow run, sorted (a duplicate would show up twice)."""
        runs = self._find(f"tags.{KIND_TAG} = 'tuning-trial'")
        return sorted(int(r.data.tags["trial_number"]) for r in runs if "trial_number" in r.data.tags)

    def log_trial(self, trial: Any, params: dict[str, Any], metrics: dict[str, Any]) -> str | None:
        """One nested run for a finished trial, unless one exists already (a resume, or another worker)."""
        from mlflow.entities import Metric, Param

        client, parent = self.client, self.parent()
        if self._find(f"tags.{KIND_TAG} = 'tuning-trial' and tags.trial_number = '{trial.number}'"):
            return None
        tags = {
            KIND_TAG: "tuning-trial",
            "study_key": self.key,
            "study": self.study,
            "trial_number": str(trial.number),
            "state": trial.state.name,
            "mlflow.parentRunId": parent,
            "worker": str(trial.user_attrs.get("worker", "")),
        }
        if machine := trial.user_attrs.get("machine"):
            tags.update(machine_tags(machine))
        if reason := trial.user_attrs.get("pruned") or trial.user_attrs.get("error"):
            tags["reason"] = str(reason)[:500]
        run_id = str(client.create_run(self._experiment, tags=tags, run_name=f"{self.study}-trial-{trial.number}").info.run_id)
        stamp = int(time.time() * 1000)
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, stamp, 0) for k, v in _finite(metrics).items()],
            params=[Param(k, str(v)[:500]) for k, v in params.items()],
        )
        client.set_terminated(run_id, _STATUS.get(trial.state.name, "FAILED"))
        keeper = self._first_of(f"tags.{KIND_TAG} = 'tuning-trial' and tags.trial_number = '{trial.number}'", run_id)
        return run_id if keeper == run_id else None

    def finish(self, metrics: dict[str, Any], files: list[Path], params: dict[str, Any] | None = None) -> None:
        from mlflow.entities import Metric, Param

        parent = self.parent()
        stamp = int(time.time() * 1000)
        logged = set(self.client.get_run(parent).data.params) if params else set()
        fresh = [Param(k, str(v)[:500]) for k, v in (params or {}).items() if k not in logged]  # params are write-once
        self.client.log_batch(parent, metrics=[Metric(k, v, stamp, 0) for k, v in _finite(metrics).items()], params=fresh)
        for f in files:
            self.client.log_artifact(parent, str(f), "plots" if f.suffix == ".png" else None)
        self.client.set_terminated(parent, "FINISHED")


@contextlib.contextmanager
def best_effort(what: str, say: Callable[[str], None] | None = None) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # MLflow/plotting problems are reported, never fatal to the tuning itself
        message = f"{what} failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        (say or log.warning)(message)


def save_plots(study: Any, folder: Path, names: tuple[str, ...], say: Callable[[str], None]) -> list[Path]:
    """Pareto front (TTFA vs RTF), TTFA importances and history as PNGs; what cannot be drawn yet is said."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    folder.mkdir(parents=True, exist_ok=True)
    ttfa: Callable[[Any], float] = lambda t: t.values[0]  # noqa: E731
    plots: list[tuple[str, Callable[[], Any], int]] = [
        (
            "pareto",
            lambda: ovm.plot_pareto_front(study, targets=lambda t: (t.values[0], t.values[1]), target_names=list(names[:2])),
            1,
        ),
        ("importances", lambda: ovm.plot_param_importances(study, target=ttfa, target_name=names[0]), 2),
        ("history", lambda: ovm.plot_optimization_history(study, target=ttfa, target_name=names[0]), 1),
    ]
    written = []
    with _quiet_optuna():
        for name, draw, needed in plots:
            if len(complete) < needed:
                say(f"{name} plot: needs {needed} complete trial(s), the study has {len(complete)}; skipped")
                continue
            try:
                axes = draw()
                path = folder / f"{name}.png"
                axes.figure.tight_layout()
                axes.figure.savefig(path, dpi=110)
                written.append(path)
            except Exception as exc:  # e.g. importances when every trial shares one value
                say(f"{name} plot: {type(exc).__name__}: {exc}".splitlines()[0][:200])
            finally:
                plt.close("all")
    return written


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental" warnings of the matplotlib backend
        yield
