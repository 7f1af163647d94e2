"""A tracking store whose schema is not the installed MLflow's, as a new environment of the same project meets it
(`mlflow>=2.14` installs the newest): the project's own SQLite store is copied aside and migrated, anything else is
one error naming the fix. Real MLflow stores throughout: SQLite files, and a PostgreSQL server for a team's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.evaluate import tracking_store
from kokoro_opt.evaluate.tracking_schema import mlflow_revisions, store_revision
from tests.servers import create_database, postgres_server

pytestmark = pytest.mark.slow  # servers, processes or several builds: not in make test-fast


def _sql(uri: str, statement: str) -> list[tuple]:
    """Run one statement in a transaction; the rows it returns."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    with engine.begin() as connection:
        result = connection.execute(sqlalchemy.text(statement))
        rows = [tuple(row) for row in result] if result.returns_rows else []
    engine.dispose()
    return rows


def _older_store(uri: str) -> str:
    """A store as the MLflow before this one's newest migration left it (its tables made as MLflow makes them,
    then its migrations run up to that one); that revision."""
    import sqlalchemy
    from alembic import command
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base

    config = _get_alembic_config(uri)
    script = ScriptDirectory.from_config(config)
    down = script.get_revision(script.get_current_head()).down_revision
    older = down if isinstance(down, str) else down[0]
    engine = sqlalchemy.create_engine(uri)
    Base.metadata.create_all(engine)
    engine.dispose()
    command.upgrade(config, older)
    return str(older)


def test_the_project_s_store_from_an_older_mlflow_is_copied_aside_and_migrated(tmp_path: Path) -> None:
    import mlflow

    db = tmp_path / "experiments" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    older = _older_store(uri)
    _sql(uri, "INSERT INTO experiments (name, artifact_location, lifecycle_stage) VALUES ('kept', 'here', 'active')")
    backup = db.with_name(f"mlflow.db.before-mlflow-{mlflow.__version__}-{older}")
    backup.write_text("an earlier copy")  # a migration tried before: its copy is never replaced

    client = tracking_store.open_client(uri)  # what every command that reads or logs runs does first

    head = mlflow_revisions()
    assert head is not None and store_revision(uri) == head[0] != older
    assert backup.read_text() == "an earlier copy"
    copy = backup.with_name(backup.name + "-2")
    assert store_revision(f"sqlite:///{copy}") == older
    assert _sql(f"sqlite:///{copy}", "SELECT name FROM experiments") == [("kept",)]
    kept = client.get_experiment_by_name("kept")
    assert kept is not None
    run = client.create_run(kept.experiment_id)  # and it is written to again
    client.log_metric(run.info.run_id, "pesq_mean", 4.1)
    assert client.get_run(run.info.run_id).data.metrics == {"pesq_mean": 4.1}


def _stopped_midway(uri: str) -> str:
    """What a first command stopped inside MLflow's migrations left: later migrations' tables and columns made, an
    early revision recorded, no experiment (migrating it on fails: "duplicate column"); that revision."""
    from alembic import command
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    config = _get_alembic_config(uri)
    _older_store(uri)
    command.upgrade(config, "heads")
    first = ScriptDirectory.from_config(config).get_bases()[0]
    _sql(uri, f"UPDATE alembic_version SET version_num = '{first}'")
    return str(first)


def test_a_store_whose_making_was_stopped_midway_is_moved_aside_and_made_anew(tmp_path: Path) -> None:
    """MLflow makes a store's tables through dozens of migrations before its Default experiment: a command stopped
    midway (Ctrl-C) left tables at some revision and no experiment, which no MLflow could open or migrate. Such a
    store holds nothing: it is moved aside, not deleted, and a new one made whole before it is put in place
    (a killed making's temporary file is cleared)."""
    db = tmp_path / "experiments" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    older = _stopped_midway(uri)
    stale = db.with_name(f".{db.name}.new-0123456789ab")
    stale.write_text("a killed command's half-made store")
    os.utime(db)  # changed now, however long the setup took on a busy machine
    with pytest.raises(UserError, match="another program may be making it now"):  # it changed just now
        tracking_store.open_client(uri)
    assert store_revision(uri) == older
    left = time.time() - 2 * tracking_store.UNFINISHED_AFTER
    os.utime(db, (left, left))

    client = tracking_store.open_client(uri)

    head = mlflow_revisions()
    assert head is not None and store_revision(uri) == head[0]
    assert [e.name for e in client.search_experiments()] == ["Default"]
    aside = db.with_name("mlflow.db.unfinished")
    assert store_revision(f"sqlite:///{aside}") == older
    assert not list(db.parent.glob(".mlflow.db.new-*"))
    run = client.create_run(client.create_experiment("kokoro-opt-test"))
    client.log_metric(run.info.run_id, "pesq_mean", 4.1)
    assert client.get_run(run.info.run_id).data.metrics == {"pesq_mean": 4.1}


def test_a_store_from_a_newer_mlflow_is_one_error_naming_the_upgrade_and_stays_as_it_was(tmp_path: Path) -> None:
    """Through the CLI, as a user meets it: `evaluate` checks the store before it measures anything."""
    from mlflow.tracking import MlflowClient

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    MlflowClient(tracking_uri=uri).search_experiments()  # made by this MLflow
    _sql(uri, "UPDATE alembic_version SET version_num = 'fedcba987654'")  # then written by a later one
    before = db.read_bytes()

    done = subprocess.run(
        [sys.executable, "-m", "kokoro_opt.cli", "evaluate", "all", "--tracking-uri", uri, "--artifacts", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip

    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "was written by a newer MLflow than this one" in said and "pip install -U mlflow" in said
    assert "Traceback" not in said
    assert db.read_bytes() == before and not list(tmp_path.glob("mlflow.db.before-*"))  # no copy: nothing was migrated


def test_a_shared_database_from_an_older_mlflow_is_left_to_its_owner(tmp_path: Path) -> None:
    """Machines with the older MLflow still use a team's database: it is never migrated behind their back."""
    with postgres_server() as pg:
        uri = create_database(pg, "mlflow")
        older = _older_store(uri)
        with pytest.raises(UserError, match="has an older schema") as raised:
            tracking_store.require_answers(uri + "?password=secret")  # a password in the query, ignored by trust auth
        said = str(raised.value)
        assert "mlflow db upgrade" in said and "secret" not in said and "kokoro@" not in said
        assert store_revision(uri) == older


def test_another_program_s_database_is_not_taken_for_a_newer_mlflow_s(tmp_path: Path) -> None:
    """Optuna's study file sits beside MLflow's in experiments/ and has an alembic schema of its own."""
    import optuna

    study = tmp_path / "optuna.db"
    optuna.storages.RDBStorage(f"sqlite:///{study}")
    with pytest.raises(UserError, match="is not an MLflow tracking store") as raised:
        tracking_store.require_answers(f"sqlite:///{study}")
    assert "sqlite:///experiments/mlflow.db" in str(raised.value)
