"""The tracking store's schema against the installed MLflow's, checked before any work is logged to it.

MLflow refuses a database whose schema is not its own ("out-of-date database schema", with `mlflow db upgrade`
as the fix), and kokoro-opt depends on `mlflow>=2.14`, so a new environment of the same project often brings a
newer MLflow than the one that wrote `experiments/mlflow.db`. Every command that reads or logs runs then failed.
So, where the store is older than this MLflow:
- the local SQLite store (a file of the project) is copied aside and migrated here, with MLflow's own command;
- a shared database (a team's PostgreSQL) is one error naming the command: machines with the older MLflow still
  use it, and a migration is its owner's call.
A store written by a *newer* MLflow cannot be read by this one: one error naming the upgrade.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kokoro_opt.errors import UserError

log = logging.getLogger("kokoro_opt.tracking")


def store_revision(uri: str) -> str | None:
    """The schema revision a tracking database records (alembic's), or None for a store MLflow has not made yet."""
    return _inspect(uri)[0]


def holds_mlflow_tables(uri: str, engine_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the database has MLflow's `experiments` table: a tracking store, made or begun (what no other program's
    database should be taken for, nor be written into)."""
    return _inspect(uri, engine_kwargs)[1] is not None


def _inspect(uri: str, engine_kwargs: dict[str, Any] | None = None) -> tuple[str | None, int | None]:
    """(the schema revision the database records, how many experiments it has: None without MLflow's table)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri, **(engine_kwargs or {}))
    try:
        with engine.connect() as connection:
            tables = sqlalchemy.inspect(connection)
            row = None
            if tables.has_table("alembic_version"):
                row = connection.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).first()
            experiments = None
            if tables.has_table("experiments"):
                experiments = connection.execute(sqlalchemy.text("SELECT COUNT(*) FROM experiments")).scalar_one()
            return (str(row[0]) if row else None), experiments
    finally:
        engine.dispose()


def unfinished(uri: str) -> bool:
    """Whether MLflow began making this store and never finished: it makes the tables, migrates them through dozens
    of revisions and only then its Default experiment, so a store with MLflow's tables and no experiment at all was
    stopped midway (an older kokoro-opt made a new store in place, and a Ctrl-C then left one that no MLflow
    could open or migrate). Nothing was ever logged to it."""
    found, experiments = _inspect(uri)
    known = mlflow_revisions()
    return experiments == 0 and (found is None or known is None or found in known[1])


def mlflow_revisions() -> tuple[str, set[str]] | None:
    """(the newest, every) schema revision the installed MLflow's migrations know; None where they cannot be read
    (MLflow then says what it thinks of the store itself)."""
    import mlflow

    try:
        from alembic.script import ScriptDirectory  # MLflow's own migration tool: there with its SQL stores
    except ImportError:
        return None
    folder = Path(mlflow.__file__).parent / "store" / "db_migrations"
    if not folder.is_dir():
        return None
    script = ScriptDirectory(str(folder))
    heads = script.get_heads()
    if len(heads) != 1:
        return None
    return heads[0], {revision.revision for revision in script.walk_revisions()}


def check_schema(uri: str, where: str, db: Path | None) -> None:
    """Make the store at `uri` one this MLflow reads, or fail naming the fix. `where`: the store as the user may see
    it (no password); `db`: the SQLite file when it is the local store, which is then migrated when older."""
    import mlflow

    (found, experiments), known = _inspect(uri), mlflow_revisions()
    if found is None or known is None or found == known[0]:
        return
    version = mlflow.__version__
    if found not in known[1] and experiments is None:  # another program's alembic schema (an Optuna study's file)
        raise UserError(
            f"{where} is not an MLflow tracking store: its schema {found} is another program's",
            "point --tracking-uri at MLflow's store, e.g. sqlite:///experiments/mlflow.db",
        )
    if found not in known[1]:
        raise UserError(
            f"the tracking store {where} was written by a newer MLflow than this one ({version}): its schema "
            f"{found} is not one this MLflow knows",
            "upgrade MLflow (pip install -U mlflow), or point --tracking-uri at another store",
        )
    if db is None:
        raise UserError(
            f"the tracking database {where} has an older schema ({found}) than this MLflow ({version}) reads",
            "back it up, then migrate it once for every machine: mlflow db upgrade <its URI>; or install the MLflow "
            "the other machines use",
        )
    migrate_sqlite(db, uri, version, found)


def migrate_sqlite(db: Path, uri: str, version: str, found: str) -> Path:
    """Copy the local store aside (`<name>.before-mlflow-<version>-<its revision>`, never over an earlier copy), then
    migrate it with `mlflow db upgrade`; the copy's path. Run under the store's lock (tracking_store): one process
    migrates. SQLite's migrations are not transactional: a failed one leaves the store between revisions, and the
    copy is what there was before."""
    backup = free_name(db.with_name(f"{db.name}.before-mlflow-{version}-{found}"))
    with tempfile.NamedTemporaryFile(dir=db.parent, prefix=f".{db.name}.", delete=False) as handle:
        partial = Path(handle.name)
    try:  # SQLite's own backup: a consistent copy even while another process writes to the store
        with contextlib.closing(sqlite3.connect(db)) as source, contextlib.closing(sqlite3.connect(partial)) as copy:
            source.backup(copy)
        os.replace(partial, backup)  # a copy that is there is whole
    except (OSError, sqlite3.Error) as exc:
        partial.unlink(missing_ok=True)
        raise UserError(
            f"could not copy the tracking store {db} aside before migrating it to MLflow {version}'s schema ({exc})",
            "free space there, or point --tracking-uri at a new store",
        ) from None
    result = subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", uri], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(
            f"migrating the tracking store {db} to MLflow {version}'s schema failed ({_error_line(result)[:300]})",
            f"its copy from before is {backup}: put it back, or point --tracking-uri at a new store",
        )
    log.warning("the tracking store %s was migrated to MLflow %s's schema; its copy from before: %s", db, version, backup)
    return backup


def free_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ...: the first that is not taken."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """What a failed `mlflow db upgrade` says went wrong: the last exception line of its output (SQLAlchemy ends its
    messages with a link to its docs)."""
    lines = result.stderr.strip().splitlines()
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Failure)\b", line)]
    return (raised or lines or [f"exit {result.returncode}"])[-1]
