"""The MLflow tracking store: which one (--tracking-uri, MLFLOW_TRACKING_URI, or SQLite under ./experiments), that it
answers before any work, its client, kokoro-opt's experiments in it, and the machine tags every run carries.
Evaluations (tracking.py), tuning trials (tuning/records.py), rankings and push/fetch (remote.py) open it here."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kokoro_opt.errors import UserError
from kokoro_opt.evaluate.tracking_schema import check_schema, free_name, unfinished
from kokoro_opt.paths import database_for_messages, sqlite_file

STORE = Path("experiments")
UNFINISHED_AFTER = 60.0  # seconds a store without an experiment must have been left to be taken as abandoned
KIND_TAG = "kokoro_opt_kind"
EXPERIMENT_PREFIX = "kokoro-opt-"
log = logging.getLogger("kokoro_opt.tracking")


def resolve_tracking_uri(uri: str | None = None) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else SQLite under ./experiments (absolute: cwd-proof)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(STORE / 'mlflow.db').resolve()}"


def existing_client(tracking_uri: str | None) -> tuple[str, Any] | None:
    """(resolved URI, client) of the tracking store, or None when it is an SQLite file that does not exist
    yet: nothing was logged, and looking must not create an empty store."""
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_file(uri)
    if db is not None and not db.exists():
        return None
    return uri, open_client(uri)


_HINT = "start it, or fix --tracking-uri / MLFLOW_TRACKING_URI"
_DATABASES = ("postgresql", "mysql", "mssql")  # SQLAlchemy URLs MLflow keeps its store in (+driver allowed)


@cache
def _answers(uri: str) -> None:
    """A tracking store that cannot answer fails here at once, not after MLflow's retries (minutes): an http(s)
    server or a database that does not answer, or a URI that names neither (MLflow would take a bare word for
    a folder of its file store, which it no longer writes). Any answer will do: what it says is MLflow's."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if (db := sqlite_file(uri)) is not None:
        _sqlite_writable(db, uri)
        if db.is_file() and db.stat().st_size:
            from kokoro_opt.artifacts import exclusive

            with exclusive(_lock_of(db)):  # the process that finds it older migrates it, the others wait
                if unfinished(uri):
                    _set_unfinished_aside(db)
                else:
                    check_schema(uri, str(db), db)
        return
    if scheme.split("+")[0] in _DATABASES:
        _database_answers(uri, scheme)
        check_schema(uri, database_for_messages(uri), None)
        return
    if scheme in ("", "file"):
        raise UserError(f"{uri!r} is not a tracking store MLflow writes", "use sqlite:///path/to/mlflow.db or http://host:5000")
    if scheme == "databricks":  # answered by MLflow's own client, which knows its profiles
        return
    if scheme not in ("http", "https"):  # else MLflow would fail only after the work is done, at the first log
        raise UserError(
            f"{uri!r}: MLflow has no tracking store for {scheme}://", "use sqlite:///path/to/mlflow.db or http://host:5000"
        )
    from urllib.error import HTTPError, URLError
    from urllib.request import urlopen

    try:
        with urlopen(uri.rstrip("/") + "/health", timeout=10):
            pass
    except HTTPError:
        return
    except (URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"the MLflow tracking server at {uri} does not answer ({reason})", _HINT) from None


def _set_unfinished_aside(db: Path) -> None:
    """A store MLflow began and never finished (tracking_schema.unfinished) is moved aside, to be made anew. One changed
    within the last minute may be another program's making it now (`mlflow ui` takes no lock of ours): left alone."""
    if time.time() - db.stat().st_mtime < UNFINISHED_AFTER:
        raise UserError(
            f"the tracking store {db} has MLflow's tables but no experiment, and changed within the last minute: "
            "another program may be making it now",
            "try again in a minute; if nothing is making it, it is moved aside then (a store a stopped command left)",
        )
    aside = free_name(db.with_name(f"{db.name}.unfinished"))
    os.replace(db, aside)
    log.warning("the tracking store %s was never finished (made when a command was stopped) and holds no experiment: "
                "moved aside to %s, a new one is made", db, aside)  # fmt: skip


def _sqlite_writable(db: Path, uri: str) -> None:
    """The database's folder exists (made now) and takes a new file, and the database, when there, is a file."""
    import tempfile

    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        if db.exists() and not db.is_file():
            raise IsADirectoryError(f"{db} is not a file")
        with tempfile.NamedTemporaryFile(dir=db.parent, prefix=".kokoro-opt-probe-"):
            pass
        if db.is_file() and db.stat().st_size:
            _is_sqlite(db, uri)
    except OSError as exc:
        why = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
        hint = f"point --tracking-uri ({uri}) at a writable place, e.g. sqlite:///experiments/mlflow.db"
        raise UserError(f"cannot write the SQLite tracking store {db} ({why})", hint) from None


def _is_sqlite(db: Path, uri: str) -> None:
    """An existing file is an SQLite database (MLflow's or not yet): else MLflow fails after the work, with a traceback."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
            connection.execute("PRAGMA schema_version")
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
            return  # another process writes or migrates it: it is one
        hint = f"point --tracking-uri ({uri}) at a new file or an MLflow database"
        raise UserError(f"{db} is not an SQLite database ({exc})", hint) from None


def _lock_of(db: Path) -> Path:
    """Held while a process makes or migrates the SQLite store's tables."""
    return db.with_name(f".{db.name}.lock")


def _database_answers(uri: str, scheme: str) -> None:
    import sqlalchemy

    where = database_for_messages(uri)
    try:
        engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": 10})
        with engine.connect():
            pass
        engine.dispose()
    except ModuleNotFoundError as exc:
        raise UserError(
            f"no driver for {scheme} ({exc.name})", "install the team extra: pip install 'kokoro-opt[team]'"
        ) from None
    except Exception as exc:  # SQLAlchemy's URL and connection errors
        raise UserError(f"the tracking database at {where} does not answer ({type(exc).__name__})", _HINT) from None


def require_answers(tracking_uri: str | None) -> None:
    """Fail now if the tracking store cannot answer: before work whose results would be logged to it."""
    _answers(resolve_tracking_uri(tracking_uri))


def download_quietly(client: Any, run_id: str, path: str, into: str) -> str:
    """A small file of a run, without the progress bar MLflow draws for every download (noise among our messages)."""
    previous = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        return str(client.download_artifacts(run_id, path, into))
    finally:
        if previous is None:
            del os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"]
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = previous


def open_client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    _answers(uri)
    for name in ("mlflow", "alembic"):  # schema migration chatter on a new store
        logging.getLogger(name).setLevel(logging.WARNING)
    db = sqlite_file(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    from kokoro_opt.artifacts import exclusive

    db.parent.mkdir(parents=True, exist_ok=True)
    # two processes making a new store's tables at once fail in MLflow's migration: one makes it, the others wait
    with exclusive(_lock_of(db)):
        if not db.is_file() or not db.stat().st_size:
            _make_store(db)
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    return client


def _make_store(db: Path) -> None:
    """A new SQLite store, made whole in a temporary file and then renamed into place: MLflow makes its tables in
    dozens of migrations, and a command stopped midway left a store no MLflow could open or migrate. It is made
    in a process of its own, which leaves no connection to the file behind. Run under the store's lock, so a
    temporary file already there is a killed command's."""
    import subprocess
    import sys
    import uuid

    for stale in db.parent.glob(f".{db.name}.new-*"):
        stale.unlink(missing_ok=True)
    partial = db.with_name(f".{db.name}.new-{uuid.uuid4().hex[:12]}")
    make = "import sys; from mlflow.tracking import MlflowClient; MlflowClient(sys.argv[1]).search_experiments(max_results=1)"
    try:
        result = subprocess.run([sys.executable, "-c", make, f"sqlite:///{partial}"], capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"MLflow could not make a new tracking store {db} ({last[:300]})",
                            "check the free space and permissions of its folder, or point --tracking-uri elsewhere")  # fmt: skip
        os.replace(partial, db)
    finally:
        partial.unlink(missing_ok=True)


# MLflow 3 opens an experiment without a kind on its GenAI overview (traces, token usage: empty
# here); this kind opens it on the runs table, where artifacts are compared.
EXPERIMENT_TAGS = {
    "mlflow.experimentKind": "custom_model_development",
    "mlflow.note.content": (
        "kokoro-opt: one run per evaluated artifact, comparison or tuning trial.\n\n"
        "Headline metrics: speedup_vs_reference (x fp32, measured side by side in one session: compare by this), "
        "rtf_p50 (compute seconds per second of audio) and ttfa_p50 (seconds), lower is better; "
        "pesq_mean / pesq_min (PESQ-WB vs fp32, higher is better; phrase_pesq_mean on the short-phrase slice), "
        "mcd_mean (dB, lower is better), wer_delta (lower is better), size_mb, peak_rss_mb. "
        "Per-op profile: profile/ops.json; precision map and plots are files of each run."
    ),
}


def experiment_id(client: Any, uri: str, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":  # deleted in the UI: its name stays taken until `mlflow gc`
            client.restore_experiment(found.experiment_id)
            # restoring brings its runs back too: they were deleted with it (and some before it), so they go again
            for run in client.search_runs([found.experiment_id], max_results=50_000):
                client.delete_run(run.info.run_id)
            log.warning("MLflow experiment %s had been deleted: restored, empty, to log into it", name)
        for key, value in EXPERIMENT_TAGS.items():
            if found.tags.get(key) != value:  # an experiment made by an earlier kokoro-opt
                client.set_experiment_tag(found.experiment_id, key, value)
        return str(found.experiment_id)
    db = sqlite_file(uri)
    # Beside the SQLite file, not in the cwd's ./mlruns; a server picks its own artifact store.
    location = (db.parent / "mlruns" / name).resolve().as_uri() if db is not None else None
    return str(client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS))


def our_experiments(client: Any) -> list[str]:
    return [e.experiment_id for e in client.search_experiments() if e.name.startswith(EXPERIMENT_PREFIX)]


def machine_tags(fp: dict[str, Any]) -> dict[str, str]:
    """MLflow tags of a kokoro_opt.machine fingerprint: searchable (tags.`machine.id` = '...'), shown in lists."""
    return {f"machine.{k}": str(fp.get(k, "")) for k in ("id", "cpu", "arch", "cores")}


def machine_from_tags(tags: dict[str, str]) -> dict[str, Any]:
    """The fingerprint's headline of a logged run (the whole one is its machine.json); {} for older runs."""
    found: dict[str, Any] = {k: tags[f"machine.{k}"] for k in ("id", "cpu", "arch", "cores") if f"machine.{k}" in tags}
    if str(found.get("cores", "")).isdigit():
        found["cores"] = int(found["cores"])
    return found


def tracking_location(tracking_uri: str | None) -> str:
    uri = resolve_tracking_uri(tracking_uri)
    parsed = urlparse(uri)
    return str(sqlite_file(uri)) if parsed.scheme == "sqlite" else uri
