"""Locating files: the project's committed data (calibration/, recipes/), files the user names for output, the
database file of an SQLite store URL, and a database URL as messages show it.

Committed data is found relative to the project checkout that holds this package, never the current directory: a
build started from another folder must read (and hash) the same files.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

from kokoro_opt.errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CACHE_ENV = "KOKORO_OPT_CACHE"


def user_cache() -> Path:
    """What is kept per user, not per checkout (rebuilt weights, compiled kernels): KOKORO_OPT_CACHE overrides."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kokoro-opt")


def project_file(relative: str) -> Path:
    """A committed file of the project checkout (e.g. `calibration/sentences.txt`)."""
    candidate = PROJECT_ROOT / relative
    if not candidate.exists():
        raise UserError(
            f"{relative} not found beside the kokoro_opt package ({PROJECT_ROOT})",
            "install kokoro-opt from a checkout of the project (pip install -e .): it holds calibration/ and recipes/",
        )
    return candidate


def output_file(path: str | Path, suffix: str, example: str) -> Path:
    """Where a file the user named may be written, checked before any work goes into it: its name ends in `suffix`,
    it is not a folder, and the folder it goes into is one (or will be, under one) this process can write to."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder", f"name a file in it, like {path / Path(example).name}")
    if path.suffix.lower() != suffix:
        raise UserError(f"{str(path) or 'the output'} is not a {suffix} file name", f"name the output like {example}")
    folder = next((p for p in path.parents if p.exists()), Path("."))
    if not folder.is_dir():
        raise UserError(f"{folder} is a file, not a folder", f"write the {suffix} file into a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write into {folder}", "choose a folder you can write to")
    return path


def sqlite_file(url: str) -> Path | None:
    """The database file of an `sqlite:///` URL (an MLflow store, an Optuna storage; `+driver` and `?options`
    allowed), absolute against the working directory; None for any other URL. An in-memory database is refused:
    what is written there ends with the process."""
    scheme, _, rest = url.partition("://")
    if scheme.lower().split("+")[0] != "sqlite":
        return None
    path = unquote(rest.split("?")[0][1:]) if rest.startswith("/") else ""  # sqlite://host names no file either
    if not path or path == ":memory:" or "mode=memory" in rest:
        raise UserError(
            f"{url!r} is an in-memory database: nothing written to it outlives this command",
            "name a file: sqlite:///experiments/mlflow.db (relative) or sqlite:////abs/path.db",
        )
    return Path(path).resolve()


def database_for_messages(url: str) -> str:
    """A database URL as a message may show it: its host and database, no user, password or query (which may carry
    either)."""
    import sqlalchemy

    scheme = url.split("://", 1)[0]
    try:
        parsed = sqlalchemy.engine.make_url(url)
        shown = sqlalchemy.engine.URL.create(parsed.drivername, host=parsed.host, port=parsed.port, database=parsed.database)
        return shown.render_as_string(hide_password=False)
    except Exception:  # SQLAlchemy's URL errors: what follows the last @, without its query
        return f"{scheme}://{url.rsplit('@', 1)[-1].split('://')[-1].split('?')[0]}"
