"""The Optuna side: the study (created once, resumed ever after), the objective, workers.

Distribution is Optuna's own: every worker process, on this machine or another, opens the same RDB
storage (storage.py) and asks it for trials. Heartbeats turn the trials of a killed worker into FAIL after a grace
period; the trial budget counts COMPLETE + PRUNED trials, so an interrupted run continues where it
stopped. The budget is exact: a worker starts a trial only while finished + running trials are
fewer than the budget, and a trial that two workers created at the same moment beyond it is closed
at once as a surplus (FAIL, never measured). Each worker's sampler is seeded from (seed, worker
index, trials already in the study): a fresh study with one worker replays the same parameters, a
resumed one does not repeat old ones.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kokoro_opt.errors import UserError
from kokoro_opt.machine import fingerprint
from kokoro_opt.tuning.config import SamplerConfig, TuneRecipe, load_tune_recipe
from kokoro_opt.tuning.measure import Bench, SessionCache
from kokoro_opt.tuning.records import StudyRecords, best_effort
from kokoro_opt.tuning.space import ResolvedSpace, TrialSettings, available_providers, resolve_space, suggest
from kokoro_opt.tuning.storage import load_optuna, make_storage

SPACE_ATTR, HASH_ATTR, UID_ATTR = "kokoro_opt.space", "kokoro_opt.space_hash", "kokoro_opt.uid"
SURPLUS_ATTR = "surplus"
MAX_CONSECUTIVE_FAILURES = 5
Say = Callable[[str], None]


def objective_names(resolved: ResolvedSpace) -> list[str]:
    return ["ttfa_p50", "rtf_p50", "quality"] if resolved.quality_objective else ["ttfa_p50", "rtf_p50"]


def make_sampler(config: SamplerConfig, seed: int) -> Any:
    optuna = load_optuna()
    if config.kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, config.startup_trials))
    # multivariate+group: conditional settings (inter-op threads, provider options) are modelled jointly
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=config.startup_trials, multivariate=True, group=True, constant_liar=True
    )


def sampler_seed(base: int, worker: int, existing: int) -> int:
    return base + 1000 * worker + existing


def finished(study: Any) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def claimed(study: Any, stale_after: float, before: int | None = None) -> int:
    """Finished and running trials (numbered below `before`): the budget places already taken.

    A worker's running trial holds its place until it ends or its heartbeat goes stale. A running trial
    that no kokoro-opt worker claimed (no `worker` attribute `stale_after` seconds after it started: made
    by hand with `study.ask()`) has no heartbeat, would never go stale, and so holds no place."""
    from optuna.trial import TrialState

    now = datetime.datetime.now()

    def holds(t: Any) -> bool:
        if t.state != TrialState.RUNNING or "worker" in t.user_attrs or t.datetime_start is None:
            return True
        return (now - t.datetime_start).total_seconds() < stale_after

    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(1 for t in study.get_trials(deepcopy=False, states=states) if (before is None or t.number < before) and holds(t))


def study_space(study: Any, recipe: TuneRecipe) -> ResolvedSpace:
    """The space pinned in a study this recipe made; any other study is refused (its front would be judged by
    another recipe's rules)."""
    name = study.study_name
    if SPACE_ATTR not in study.user_attrs:
        raise UserError(f"study '{name}' exists but was not created by kokoro-opt tune", "pass another --study")
    if study.user_attrs.get(HASH_ATTR) != recipe.space_hash():
        raise UserError(
            f"study '{name}' was created with a different space, measurement or quality rule than {recipe.name}",
            "restore the recipe, or start a new study with --study NAME",
        )
    return ResolvedSpace.from_json(study.user_attrs[SPACE_ATTR])


def open_study(
    recipe: TuneRecipe,
    storage: Any,
    name: str,
    root: Path,
    tracking_uri: str | None,
    say: Say,
    resolved: ResolvedSpace | None = None,
) -> tuple[Any, ResolvedSpace]:
    """Load the study, or create it with its space pinned (`resolved`, when already resolved); a changed recipe space
    is refused."""
    optuna = load_optuna()
    if name in optuna.study.get_all_study_names(storage):
        study = optuna.load_study(study_name=name, storage=storage)
        resolved = study_space(study, recipe)
        missing = set(resolved.space.providers) - set(available_providers(resolved.space, lambda _: None))
        if missing:
            raise UserError(
                f"study '{name}' uses {', '.join(sorted(missing))}, not available here", "run its workers on alike machines"
            )
        return study, resolved
    resolved = resolved or resolve_space(recipe, root, tracking_uri, say)
    directions = ["minimize", "minimize"] + (
        ["maximize" if resolved.quality_metric == "pesq" else "minimize"] * resolved.quality_objective
    )
    study = optuna.create_study(storage=storage, study_name=name, directions=directions, load_if_exists=True)
    if SPACE_ATTR not in study.user_attrs:  # another machine may have created it a moment ago
        study.set_user_attr(UID_ATTR, uuid.uuid4().hex)  # keys its MLflow runs: a re-created study is a new one
        study.set_user_attr(SPACE_ATTR, resolved.to_json())
        study.set_user_attr(HASH_ATTR, recipe.space_hash())
        study.set_user_attr("kokoro_opt.objectives", objective_names(resolved))
    return study, ResolvedSpace.from_json(study.user_attrs[SPACE_ATTR])


def worker_id(index: int, run: str = "", pid: int | None = None) -> str:
    """<machine fingerprint id>:<pid>[:<run>]:w<index>: which kind of machine ran a trial, without naming the host;
    `run` tells apart alike machines whose workers have the same pids (containers) in a shared study. `pid`: another
    process's (a run's workers), by default this one's."""
    return ":".join([fingerprint()["id"], str(os.getpid() if pid is None else pid), *([run] if run else []), f"w{index}"])


def trial_settings(attrs: dict[str, Any]) -> TrialSettings:
    """A trial's settings back from its user attributes (what tuned.json is written from)."""
    from kokoro_opt.runtime.session import SessionSettings

    s = attrs["settings"]
    session = {k: tuple(v) if isinstance(v, list) else v for k, v in s["session"].items()}
    return TrialSettings(s["artifact_id"], SessionSettings(**session), **s["chunking"])


class Objective:
    """One trial: sample, load (or reuse) the session, warm up, time; stop early if hopeless."""

    def __init__(
        self, recipe: TuneRecipe, resolved: ResolvedSpace, cache: SessionCache, worker: str, budget: int | None = None
    ) -> None:
        self.recipe, self.resolved, self.cache, self.worker, self.budget = recipe, resolved, cache, worker, budget

    def __call__(self, trial: Any) -> list[float]:
        from optuna import TrialPruned

        trial.set_user_attr("worker", self.worker)
        stale_after = self.recipe.workers.stale_after_seconds
        if self.budget is not None and claimed(trial.study, stale_after, before=trial.number) >= self.budget:
            trial.set_user_attr(SURPLUS_ATTR, True)  # another worker took the last place a moment earlier
            raise Surplus(f"trial {trial.number}: the study's {self.budget} trials are taken")
        machine = fingerprint()
        trial.set_user_attr("machine_id", machine["id"])
        trial.set_user_attr("machine", machine)
        try:
            return self._measure(trial)
        except TrialPruned:
            raise
        except Exception as exc:
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:500])
            raise

    def _measure(self, trial: Any) -> list[float]:
        started = time.perf_counter()
        settings = suggest(trial, self.resolved)
        key = next(c.key for c in self.resolved.candidates if settings.artifact_id in c.formats.values())
        fmt = next(f for c in self.resolved.candidates for f, i in c.formats.items() if i == settings.artifact_id)
        trial.set_user_attr(
            "settings",
            {
                "artifact": key,
                "artifact_id": settings.artifact_id,
                "model_format": fmt,
                "session": asdict(settings.session),
                "chunking": settings.chunking,
            },
        )
        synth, load_seconds = self.cache.get(settings.artifact_id, settings.session)
        trial.set_user_attr("load_seconds", round(load_seconds, 3))
        bench = Bench(synth, settings, self.recipe.measure)
        if load_seconds:  # a cached session has run before: its first-run costs are paid
            bench.warm_up()
        runs = self.recipe.measure
        ttfa = [bench.ttfa()]
        self._stop_if_hopeless(trial, key, 0, ttfa[0], "TTFA")
        ttfa += [bench.ttfa() for _ in range(runs.ttfa_runs - 1)]
        rtf = [bench.rtf()]
        self._stop_if_hopeless(trial, key, 1, rtf[0], "RTF")
        rtf += [bench.rtf() for _ in range(runs.rtf_runs - 1)]
        trial.set_user_attr("ttfa_runs", [round(t, 4) for t in ttfa])
        trial.set_user_attr("rtf_runs", [round(r, 4) for r in rtf])
        trial.set_user_attr("seconds", round(time.perf_counter() - started, 2))
        values = [statistics.median(ttfa), statistics.median(rtf)]
        return values + [self.resolved.candidate(key).quality] * self.resolved.quality_objective

    def _stop_if_hopeless(self, trial: Any, key: str, index: int, first: float, label: str) -> None:
        """Optuna's pruners do not take multi-objective reports: compare the first run with the complete
        trials of the same artifact (another artifact may be slower for a quality reason). Their median by
        default: on a shared machine one trial timed in a quiet minute would make every later one "hopeless"."""
        from optuna import TrialPruned
        from optuna.trial import TrialState

        prune = self.recipe.prune
        same = [
            t.values[index]
            for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("settings", {}).get("artifact") == key
        ]
        if not prune.enabled or len(same) < prune.min_trials:
            return
        ref = statistics.median(same) if prune.reference == "median" else min(same)
        trial.set_user_attr(f"first_{label.lower()}", round(first, 4))
        if first > prune.factor * ref:
            reason = f"first {label} run {first:.3f} > {prune.factor} x {prune.reference} {ref:.3f} of {key}"
            trial.set_user_attr("pruned", reason)
            raise TrialPruned(reason)


class Surplus(Exception):
    """A trial created beyond the budget by a race between workers: closed unmeasured."""


def is_surplus(trial: Any) -> bool:
    return bool(trial.user_attrs.get(SURPLUS_ATTR))


def trial_record(trial: Any, names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, metrics) of a finished trial for MLflow."""
    attrs = trial.user_attrs
    s = attrs.get("settings", {})
    params: dict[str, Any] = {**trial.params, "artifact_id": s.get("artifact_id", ""), "model_format": s.get("model_format", "")}
    params.update({f"session.{k}": v for k, v in s.get("session", {}).items()})
    params.update({f"chunking.{k}": v for k, v in s.get("chunking", {}).items()})
    metrics: dict[str, Any] = {"load_seconds": attrs.get("load_seconds"), "trial_seconds": attrs.get("seconds")}
    for name in ("ttfa", "rtf"):
        runs = attrs.get(f"{name}_runs") or ([attrs[f"first_{name}"]] if f"first_{name}" in attrs else [])
        if runs:
            metrics[f"{name}_first"] = runs[0]
    if trial.values is not None:
        metrics.update(zip(names, trial.values, strict=False))
    return params, metrics


@dataclass(frozen=True)
class WorkerArgs:
    recipe: str
    storage: str
    study: str
    trials: int
    seed: int
    index: int
    root: str
    tracking_uri: str | None
    run: str = ""  # a token of the `tune` invocation that started the worker (worker_id)


def run_worker(args: WorkerArgs, on_trial: Callable[[Any, Any], None] | None = None, say: Say = print) -> SessionCache:
    """Run trials of the (existing) study until it holds `args.trials` finished ones; returns the session cache.

    One trial per `optimize` call, each started only while a budget place is free: running trials of
    other workers hold their place until they finish or go stale (their worker was killed)."""
    optuna = load_optuna()
    recipe = load_tune_recipe(args.recipe)
    storage = make_storage(args.storage, recipe.workers)
    existing = len(optuna.load_study(study_name=args.study, storage=storage).trials)
    sampler = make_sampler(recipe.sampler, sampler_seed(args.seed, args.index, existing))
    study = optuna.load_study(study_name=args.study, storage=storage, sampler=sampler)
    resolved = ResolvedSpace.from_json(study.user_attrs[SPACE_ATTR])
    cache = SessionCache(Path(args.root), recipe.measure.max_sessions)
    for candidate in resolved.candidates:  # a missing artifact is a setup error, not a failed trial
        for artifact_id in candidate.formats.values():
            cache.artifact(artifact_id)
    records = StudyRecords(args.tracking_uri, args.storage, study)
    failures, last_error = 0, ""

    def after(study: Any, trial: Any) -> None:
        nonlocal failures, last_error
        if is_surplus(trial):
            return
        failures = failures + 1 if trial.state.name == "FAIL" else 0
        if trial.state.name == "FAIL":
            last_error = trial.user_attrs.get("error", "see the worker output")
            say(f"trial {trial.number} failed: {last_error}")
        with best_effort(f"MLflow record of trial {trial.number}", say):
            records.log_trial(trial, *trial_record(trial, objective_names(resolved)))
        if on_trial is not None:
            on_trial(study, trial)

    objective = Objective(recipe, resolved, cache, worker_id(args.index, args.run), budget=args.trials)
    waiting_said = False
    while finished(study) < args.trials and failures < MAX_CONSECUTIVE_FAILURES:
        optuna.storages.fail_stale_trials(study)  # a killed worker's trial gives its place back
        if claimed(study, recipe.workers.stale_after_seconds) >= args.trials:
            if not waiting_said:  # else a resumed study looks stuck for up to stale_after_seconds
                say(
                    "every place of the budget is held by a running trial: waiting for it to finish, or for its "
                    f"heartbeat to go stale if its worker was killed (workers.stale_after_seconds: "
                    f"{recipe.workers.stale_after_seconds} s)"
                )
                waiting_said = True
            time.sleep(min(1.0, recipe.workers.heartbeat_seconds / 2))
            continue
        study.optimize(objective, n_trials=1, catch=(Exception,), callbacks=[after])
    if failures >= MAX_CONSECUTIVE_FAILURES:  # a setup problem, not noise: the exit status says so
        raise UserError(
            f"{failures} trials in a row failed, the last with: {last_error}",
            "fix what it names, then run the same command again: the study resumes (a fix in the recipe's space, "
            "measure or quality starts a new one: add --study NEW)",
        )
    return cache
