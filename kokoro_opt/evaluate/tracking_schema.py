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

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kokoro_opt.errors import UserError

log = logging.getLogger("kokoro_opt.tracking")


def store_revision(uri: str) -> str | None:
    """The schema revision a tracking database records (alembic's), or None for a store MLflow has not made yet."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    try:
        with engine.connect() as connection:
            if not sqlalchemy.inspect(connection).has_table("alembic_version"):
                return None
            row = connection.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).first()
    finally:
        engine.dispose()
    return str(row[0]) if row else None


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

    found, known = store_revision(uri), mlflow_revisions()
    if found is None or known is None or found == known[0]:
        return
    version = mlflow.__version__
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
    migrate_sqlite(db, uri, version)


def migrate_sqlite(db: Path, uri: str, version: str) -> Path:
    """Copy the local store aside (`<name>.before-mlflow-<version>`), then migrate it with `mlflow db upgrade`;
    the copy's path. Run under the store's lock (tracking_store.open_client): one process migrates."""
    backup = db.with_name(f"{db.name}.before-mlflow-{version}")
    with tempfile.NamedTemporaryFile(dir=db.parent, prefix=f".{db.name}.", delete=False) as handle:
        partial = Path(handle.name)
    shutil.copy2(db, partial)
    os.replace(partial, backup)  # a copy that is there is whole
    result = subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", uri], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise UserError(
            f"migrating the tracking store {db} to MLflow {version}'s schema failed ({last[:300]})",
            f"its copy from before is {backup}: put it back, or point --tracking-uri at a new store",
        )
    log.warning("the tracking store %s was migrated to MLflow %s's schema; its copy from before: %s", db, version, backup)
    return backup
