"""`kokoro-opt tune`: open or resume the study, run its workers, then pick, compare and write tuned.json."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kokoro_opt.errors import UserError
from kokoro_opt.machine import fingerprint
from kokoro_opt.paths import sqlite_file
from kokoro_opt.tables import make_progress, print_table
from kokoro_opt.tuning.config import load_tune_recipe
from kokoro_opt.tuning.measure import Comparison, SessionCache, compare_with_defaults
from kokoro_opt.tuning.records import StudyRecords, best_effort, save_plots, study_key
from kokoro_opt.tuning.report import front_table, pick_best, previous_tuned, ratio_line, tuned_json, write_tuned
from kokoro_opt.tuning.space import ResolvedSpace, resolve_space
from kokoro_opt.tuning.storage import load_optuna, make_storage
from kokoro_opt.tuning.study import (
    WorkerArgs,
    finished,
    is_surplus,
    objective_names,
    open_study,
    run_worker,
    study_space,
    trial_record,
    trial_settings,
    worker_id,
)

PLOTS = Path("experiments") / "tune"


@dataclass
class TuneResult:
    study: Any
    names: list[str]
    best: Any | None = None
    comparison: Comparison | None = None
    tuned_path: Path | None = None
    plots: list[Path] = field(default_factory=list)
    ran: int = 0  # trials finished by this invocation (all of its workers)


def _say(console: Console) -> Any:
    return lambda message: console.print(message, markup=False, highlight=False)


def _describe(trial: Any) -> str:
    if trial.state.name == "COMPLETE":
        return f"trial {trial.number}: TTFA {1000 * trial.values[0]:.0f} ms, RTF {trial.values[1]:.3f}"
    return f"trial {trial.number}: {trial.state.name.lower()}"


def _progress(console: Console) -> Progress:
    return make_progress(TextColumn("tuning"), BarColumn(), TextColumn("{task.completed}/{task.total} trials"),
                    TextColumn("{task.description}"), TimeElapsedColumn(), console=console)  # fmt: skip


def _spawn(args: list[WorkerArgs], total: int, study: Any, console: Console) -> None:
    """N worker processes on this machine against the same storage; progress read back from the storage."""
    # a session of their own: a terminal's Ctrl-C reaches this process alone, which interrupts each worker once
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kokoro_opt.tuning.worker", json.dumps(asdict(a))],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        for a in args
    ]
    interrupts = _Interrupts()
    with interrupts.installed():
        try:
            with _progress(console) as progress:
                task = progress.add_task("", total=total, completed=finished(study))
                while any(p.poll() is None for p in procs):
                    time.sleep(1.0)
                    trials = study.get_trials(deepcopy=False)
                    done = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
                    last = max(done, key=lambda t: t.number, default=None)
                    progress.update(task, completed=len(done), description=_describe(last) if last else "")
        except BaseException:
            _stop(procs)
            with interrupts.held(after=False):  # what interrupted the run is what it ends with
                _fail_left_running(args, procs, console)
            raise
        with interrupts.held():  # a worker killed outright left its trial RUNNING
            _fail_left_running(args, procs, console)
    failed = [p.returncode for p in procs if p.returncode]
    if failed:
        raise UserError(f"{len(failed)} of {len(procs)} workers exited with an error", "see their messages above")


class _Interrupts:
    """Ctrl-C and SIGTERM (`kill`) as KeyboardInterrupt while `installed`, so a killed run stops its workers as an
    interrupted one does; within `held`, the first waits until the block is done (a second one interrupts at once)."""

    def __init__(self) -> None:
        self.holding, self.arrived = False, 0

    def _handle(self, *_: Any) -> None:
        if self.holding and not self.arrived:
            self.arrived = 1
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def held(self, after: bool = True) -> Iterator[None]:
        """`after`: an interrupt that waited is raised once the block is done."""
        self.holding, self.arrived = True, 0
        try:
            yield
        finally:
            self.holding = False
        if self.arrived and after:
            raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 30.0) -> None:
    """Interrupt the workers as Ctrl-C does, so each marks its running trial failed at once; those still running after
    `grace` seconds are terminated, and the run fails what they leave (`_fail_left_running`). A worker
    stops within a second or two; the grace is for one whose last write waits on a busy disk (both workers of a
    run on a loaded machine were once terminated after 10 s with their trials still RUNNING)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    try:
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
    finally:  # also when interrupted again while waiting
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:  # gone before their trials are failed (_fail_left_running), not writing one meanwhile
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
            if p.poll() is None:
                p.kill()


def _fail_left_running(args: list[WorkerArgs], procs: list[subprocess.Popen[bytes]], console: Console) -> None:
    """Fail the trials these workers left RUNNING: one killed, or terminated after the grace (its last write waited
    on a disk busy with other work), would hold its place until its heartbeat went stale. Through a storage of its
    own: the run's may have been interrupted mid-query."""
    from optuna.trial import TrialState

    ours = {worker_id(a.index, a.run, pid=p.pid) for a, p in zip(args, procs, strict=True)}
    storage = None
    try:
        storage = make_storage(args[0].storage)
        study = load_optuna().load_study(study_name=args[0].study, storage=storage)
        left = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if t.user_attrs.get("worker") in ours]
        for trial in left:
            with contextlib.suppress(Exception):  # its worker's own write landed meanwhile
                study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    except Exception as exc:  # the storage is unreachable: their heartbeats go stale, and a later run fails them
        console.print(f"could not fail the trials the workers left running: {type(exc).__name__}", markup=False)
    finally:
        engine = getattr(storage, "engine", None)
        if engine is not None:
            engine.dispose()


def _sync_records(study: Any, records: StudyRecords, names: list[str]) -> None:
    """Log this machine's finished trials that have no MLflow run yet (e.g. killed before the record)."""
    here = fingerprint()["id"]
    logged = set(records.logged_trials())
    for t in study.get_trials(deepcopy=False):
        if t.state.name in ("COMPLETE", "PRUNED", "FAIL") and t.number not in logged and not is_surplus(t) \
                and str(t.user_attrs.get("worker", here)).startswith(f"{here}:"):  # fmt: skip
            records.log_trial(t, *trial_record(t, names))


def run_tuning(
    recipe_path: str | Path,
    *,
    trials: int | None = None,
    workers: int = 1,
    storage: str | None = None,
    study_name: str | None = None,
    seed: int | None = None,
    root: Path = Path("artifacts"),
    tracking_uri: str | None = None,
    console: Console | None = None,
    out: Console | None = None,
    plots: Path = PLOTS,
) -> TuneResult:
    """Tune until the study holds `trials` finished trials; then pick, compare with defaults, write tuned.json.
    Progress and notes go to `console`; the Pareto front and the TTFA ratio to `out` (default: the same)."""
    console = console or Console(stderr=True)
    say = _say(console)
    if workers < 1:
        raise UserError("--workers must be at least 1")
    if trials is not None and trials < 1:
        raise UserError(f"--trials {trials}: a study needs at least 1 finished trial", "e.g. --trials 20 (a rerun resumes)")
    recipe = load_tune_recipe(recipe_path)
    url, name, total = storage or recipe.storage, study_name or recipe.study_name, trials or recipe.trials
    # a new study file is made only once there is something to tune in it: a refused run leaves none behind
    new_file = (db := sqlite_file(url)) is not None and not db.exists()
    resolved = resolve_space(recipe, root, tracking_uri, say) if new_file else None
    store = make_storage(url, recipe.workers)
    study, resolved = open_study(recipe, store, name, root, tracking_uri, say, resolved)
    names = objective_names(resolved)
    say(
        f"study '{name}': {len(resolved.candidates)} artifact(s) within the quality budget: "
        + ", ".join(f"{c.key} ({'/'.join(sorted(c.formats))})" for c in resolved.candidates)
    )
    records = StudyRecords(tracking_uri, url, study)
    with best_effort("MLflow study run", say):
        records.parent()
    before = finished(study)
    cache: SessionCache | None = None
    base = WorkerArgs(
        str(recipe_path),
        url,
        name,
        total,
        recipe.sampler.seed if seed is None else seed,
        0,
        str(root),
        tracking_uri,
        run=uuid.uuid4().hex[:8],
    )
    if before >= total:
        say(f"study '{name}' already holds {before} finished trials (--trials {total}): nothing to run")
    elif workers == 1:
        say(f"resuming study '{name}' at {before} finished trials" if before else f"new study '{name}'")
        with _progress(console) as progress:
            task = progress.add_task("", total=total, completed=before)

            def tick(study: Any, trial: Any) -> None:
                progress.update(task, completed=finished(study), description=_describe(trial))

            cache = run_worker(base, on_trial=tick, say=say)
    else:
        say(f"{workers} worker processes on study '{name}' ({before} finished trials so far)")
        _spawn([WorkerArgs(**{**asdict(base), "index": i}) for i in range(workers)], total, study, console)
    result = TuneResult(study, names, ran=finished(study) - before)
    with best_effort("MLflow trial records", say):
        _sync_records(study, records, names)
    result.plots = save_plots(study, plots / name, ("TTFA p50 (s)", "RTF p50"), say)
    _finish(result, recipe, resolved, url, root, cache, records, console, out or console)
    return result


def _finish(result: TuneResult, recipe: Any, resolved: ResolvedSpace, url: str, root: Path, cache: SessionCache | None,
            records: StudyRecords, console: Console, out: Console) -> None:  # fmt: skip
    say = _say(console)
    study, names = result.study, result.names
    best, score, note = pick_best(study, names, recipe.best)
    if note:
        say(note)
    print_table(out, front_table(study, names, resolved.quality_metric, recipe.best))
    if best is None:
        say("no complete trial: tuned.json not written")
        return
    result.best = best
    settings = trial_settings(best.user_attrs)
    data = previous_tuned(root)
    same_study = data is not None and data.get("study_key") == study_key(url, study)
    if result.ran == 0 and same_study and data.get("trial") == best.number:
        say(f"{root / 'tuned.json'} already holds trial {best.number} of this study: not measured again")
        result.tuned_path = root / "tuned.json"
    else:
        say(f"trial {best.number} wins; measuring it against the default settings, interleaved ({recipe.compare_rounds} rounds)")
        cache = cache or SessionCache(root, recipe.measure.max_sessions)
        result.comparison = comparison = compare_with_defaults(cache, settings, recipe.measure, recipe.compare_rounds)
        out.print(ratio_line(comparison.to_json()), highlight=False)
        data = tuned_json(study, url, best, settings, names, resolved.quality_metric, comparison, score[best.number])
        result.tuned_path = write_tuned(root, data)
        if data.get("applied", True):
            served = f"{data['artifact']} ({data['model_format']})"
            say(f"wrote {result.tuned_path}: `kokoro-opt serve --artifact best` uses {served} with these settings")
        else:
            say(f"wrote {result.tuned_path}, not applied: {data['not_applied']}; `serve --artifact best` keeps the defaults")
    with best_effort("MLflow study summary", say):
        ratio = data.get("ttfa_ratio") if data else None
        metrics = {"trials_finished": finished(study), "best_trial": best.number, "ttfa_ratio": ratio}
        metrics.update({f"best_{n}": v for n, v in zip(names, best.values, strict=True)})
        records.finish(metrics, [*result.plots, result.tuned_path], {"recipe": recipe.name, "objectives": ",".join(names)})


def show_front(recipe_path: str | Path, *, storage: str | None = None, study_name: str | None = None,
               root: Path = Path("artifacts"), console: Console | None = None, plots: Path = PLOTS) -> Any:  # fmt: skip
    """Print the study's Pareto front (and the current tuned.json's ratio) and write Optuna's plots as
    PNG (Pareto front, history, importances) without running anything."""
    console = console or Console()
    recipe = load_tune_recipe(recipe_path)
    name = study_name or recipe.study_name
    optuna = load_optuna()
    url = storage or recipe.storage
    if (db := sqlite_file(url)) is not None and not db.is_file():  # showing makes nothing
        raise UserError(f"no study '{name}': nothing was tuned into {url}", f"run it first: kokoro-opt tune {recipe_path}")
    store = make_storage(url)
    if name not in optuna.study.get_all_study_names(store):
        raise UserError(f"no study '{name}' in the storage", f"run it first: kokoro-opt tune {recipe_path}")
    study = optuna.load_study(study_name=name, storage=store)
    resolved = study_space(study, recipe)
    print_table(console, front_table(study, objective_names(resolved), resolved.quality_metric, recipe.best))
    say = _say(console)
    written = save_plots(study, plots / name, ("TTFA p50 (s)", "RTF p50"), say)
    if written:
        say(f"plots: {', '.join(str(p) for p in written)}")
    tuned = previous_tuned(root)
    if tuned and tuned.get("study_key") == study_key(url, study) and "ttfa_ratio" in tuned:
        console.print(
            f"tuned.json: trial {tuned.get('trial')} on {tuned.get('artifact')} ({tuned.get('model_format')}); "
            + ratio_line(tuned["vs_defaults"]),
            highlight=False,
        )
    return study
